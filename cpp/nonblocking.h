// Calls on a non-blocking communicator: issue, poll until the transport says the call has
// settled, and only then let the caller record its completion event and hand the op to the
// watchdog. NCCL's non-blocking communicators (config.blocking = 0) may return "in progress"
// from a collective or from ncclGroupEnd before the kernel is on the stream, and no other call
// on that communicator is valid until ncclCommGetAsyncError reports ncclSuccess
// (NCCL user guide, "Nonblocking group operation" and ncclCommGetAsyncError; torch's
// C10D_NCCL_CHECK_TIMEOUT / C10D_NCCL_CHECK_TIMEOUT_GROUPEND in c10d/NCCLUtils.hpp).
// Framework-free (no CUDA, no NCCL): the transports map their result codes to CallState, so the
// emulation of NCCL's rules and the unit tests run the same code on CPUs.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "error.h"

namespace gridweave {

enum class CallState : int { Success = 0, InProgress = 1, Error = 2 };

const char* call_state_name(CallState s);

// What a call returned, or what the communicator reports now.
struct CallStatus {
  CallState state = CallState::Success;
  std::string detail;  // the transport's words for an error ("unhandled system error"), for messages
};

class NonBlockingCalls {
 public:
  using Clock = std::chrono::steady_clock;
  // poll: the communicator's state now (ncclCommGetAsyncError); may throw, which counts as an error.
  using Poll = std::function<CallStatus()>;
  // abort: called once per failed call, before the throw, with the error about to be thrown
  // (it aborts the communicator, or the grid through its watchdog, as a watched op's failure).
  using Abort = std::function<void(const Error&)>;

  // transport: names the library in messages ("NCCL").
  NonBlockingCalls(std::string transport, Poll poll, Abort abort);

  // After a call (`what`: the op, naming its axis, as Communicator::describe) returned `issued`:
  // returns once the communicator reports Success (at once if the call did). An error, or still
  // in progress at `deadline`, calls abort and throws Error (Comm or Timeout). Between
  // ncclGroupStart and ncclGroupEnd only ncclGroupEnd's result is settled here.
  void settle(const std::string& what, const CallStatus& issued, Clock::time_point deadline);

  // Polls that found the call still in progress, over this communicator's life (for tests).
  std::uint64_t in_progress_polls() const { return in_progress_polls_.load(std::memory_order_relaxed); }

 private:
  [[noreturn]] void fail(const Error& e);
  std::string transport_;
  Poll poll_;
  Abort abort_;
  std::atomic<std::uint64_t> in_progress_polls_{0};
};

}  // namespace gridweave
