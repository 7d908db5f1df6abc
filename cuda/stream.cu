#include "stream.h"

#include <thread>

#include "error.h"

namespace gridweave {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(ErrorKind::Comm, std::string("gridweave: CUDA error in ") + what + ": " + cudaGetErrorString(status));
}

void order_after(cudaStream_t engine, cudaStream_t caller) {
  cudaEvent_t ready;
  check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(ready, caller), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(engine, ready, 0), "cudaStreamWaitEvent");
  check_cuda(cudaEventDestroy(ready), "cudaEventDestroy");  // freed once it fires
}

EventWork::EventWork(std::string what, cudaStream_t engine, cudaStream_t caller,
                     std::function<std::string()> poll_error, std::function<void()> on_timeout)
    : Work(std::move(what)), caller_(caller), poll_error_(std::move(poll_error)), on_timeout_(std::move(on_timeout)) {
  check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(event_, engine), "cudaEventRecord");
}

EventWork::~EventWork() {
  if (event_) cudaEventDestroy(event_);
}

bool EventWork::test() {
  cudaError_t s = cudaEventQuery(event_);
  if (s == cudaErrorNotReady) return false;
  check_cuda(s, "cudaEventQuery");
  return true;
}

void EventWork::wait(std::chrono::milliseconds timeout) {
  check_cuda(cudaStreamWaitEvent(caller_, event_, 0), "cudaStreamWaitEvent");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!test()) {
    std::string err = poll_error_ ? poll_error_() : std::string();
    if (!err.empty()) throw Error(ErrorKind::Comm, "gridweave: " + what_ + " failed: " + err);
    if (std::chrono::steady_clock::now() > deadline) {
      if (on_timeout_) on_timeout_();
      throw Error(ErrorKind::Timeout, "gridweave: " + what_ + " timed out after " +
                                          std::to_string(timeout.count() / 1000.0) + " s waiting for its peers");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace gridweave
