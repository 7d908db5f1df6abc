#include "nonblocking.h"

#include <thread>

namespace gridweave {

const char* call_state_name(CallState s) {
  switch (s) {
    case CallState::Success: return "success";
    case CallState::InProgress: return "in progress";
    case CallState::Error: return "error";
  }
  return "unknown";
}

NonBlockingCalls::NonBlockingCalls(std::string transport, Poll poll, Abort abort)
    : transport_(std::move(transport)), poll_(std::move(poll)), abort_(std::move(abort)) {}

void NonBlockingCalls::fail(const Error& e) {
  if (abort_) abort_(e);
  throw e;
}

void NonBlockingCalls::settle(const std::string& what, const CallStatus& issued, Clock::time_point deadline) {
  CallStatus now = issued;
  const auto start = Clock::now();
  for (std::uint64_t polls = 0; now.state == CallState::InProgress; ++polls) {
    // A launch handed to NCCL's background thread takes microseconds, a first connection to a
    // peer far longer: yield at first (torch's sched_yield for collectives), then sleep briefly.
    if (polls < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
    try {
      now = poll_();
    } catch (const std::exception& e) {
      now = CallStatus{CallState::Error, e.what()};
    }
    if (now.state != CallState::InProgress) break;
    in_progress_polls_.fetch_add(1, std::memory_order_relaxed);
    if (Clock::now() >= deadline) {
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      fail(Error(ErrorKind::Timeout, "gridweave: " + what + " timed out: " + transport_ + " still reported the call '" +
                                         call_state_name(now.state) + "' after " + std::to_string(waited) +
                                         " s (its kernel never reached the stream: a peer is slow to connect, "
                                         "skipped this op or died); the communicator was aborted"));
    }
  }
  if (now.state == CallState::Error)
    fail(Error(ErrorKind::Comm, "gridweave: " + what + " failed: " + transport_ + " reported '" +
                                    call_state_name(now.state) + "'" + (now.detail.empty() ? "" : " (" + now.detail + ")") +
                                    (now.state == issued.state ? " when it was called" : " while it was being issued") +
                                    "; the communicator was aborted"));
}

}  // namespace gridweave
