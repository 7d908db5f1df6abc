// CUDA stream and event plumbing for the NCCL transport: the engine's own stream,
// ordered against the caller's stream with events, and a Work that completes when
// an event does.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <string>

#include "work.h"

namespace gridweave {

void check_cuda(cudaError_t status, const char* what);

// Makes `engine` wait for everything queued on `caller` so far.
void order_after(cudaStream_t engine, cudaStream_t caller);

// Done when `event` (recorded on the engine stream after the op) has fired. wait()
// also orders the caller's stream after the event, then blocks the host up to the
// timeout; `poll_error` reports transport errors (ncclCommGetAsyncError) while waiting.
class EventWork : public Work {
 public:
  EventWork(std::string what, cudaStream_t engine, cudaStream_t caller, std::function<std::string()> poll_error,
            std::function<void()> on_timeout);
  ~EventWork() override;
  bool test() override;
  void wait(std::chrono::milliseconds timeout) override;
  int source() const override { return -1; }

 private:
  cudaEvent_t event_ = nullptr;
  cudaStream_t caller_;
  std::function<std::string()> poll_error_;
  std::function<void()> on_timeout_;
};

}  // namespace gridweave
