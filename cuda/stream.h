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

// Engine streams come from a pool that lives as long as the process, as torch's ProcessGroupNCCL
// takes its streams from torch's stream pool: a tensor the engine used records the engine's
// stream (Tensor.record_stream), and torch's allocator records an event on that stream when the
// tensor is freed, which may be after the grid shut down (seen on an H100: a tensor freed after
// gw.shutdown() met a destroyed stream, "context is destroyed", and the process aborted).
cudaStream_t acquire_stream(int device);
void release_stream(int device, cudaStream_t stream);

// Events come from a pool (one per device): no cudaEventCreate / Destroy per op.
cudaEvent_t acquire_event(int device);
void release_event(int device, cudaEvent_t event);

// Done when `event` (recorded on the engine stream after the op) has fired. wait() is
// stream-ordered, as torch's ProcessGroupNCCL: the issuing stream (wait_on: the given one,
// torch's current stream) waits for the event and the host goes on at once; the grid's
// watchdog owns the op's timeout and transport errors.
// wait_host() blocks the host up to the timeout (the engine reading a message's header);
// `poll_error` reports transport errors (ncclCommGetAsyncError) while it waits.
class EventWork : public Work {
 public:
  EventWork(std::string what, int device, cudaStream_t engine, cudaStream_t caller,
            std::function<std::string()> poll_error, std::function<void()> on_timeout);
  ~EventWork() override;
  bool test() override;
  void wait(std::chrono::milliseconds timeout) override;  // the issuing stream waits
  void wait_on(void* stream, std::chrono::milliseconds timeout) override;
  void wait_host(std::chrono::milliseconds timeout) override;
  int source() const override { return -1; }
  void* stream() const override { return engine_; }

 private:
  int device_;
  cudaStream_t engine_;
  cudaEvent_t event_ = nullptr;
  cudaStream_t caller_;
  std::function<std::string()> poll_error_;
  std::function<void()> on_timeout_;
};

}  // namespace gridweave
