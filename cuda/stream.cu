#include "stream.h"

#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "error.h"

namespace gridweave {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(ErrorKind::Comm, std::string("gridweave: CUDA error in ") + what + ": " + cudaGetErrorString(status));
}

namespace {
// Per-device free lists of CUDA handles, never destroyed: events may be released at exit, and
// a freed tensor may still name an engine stream (record_stream) after its grid shut down.
struct Pool {
  std::mutex mu;
  std::map<int, std::vector<cudaEvent_t>> events;
  std::map<int, std::vector<cudaStream_t>> streams;
};
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

template <class Handle, class Make>
Handle take(std::map<int, std::vector<Handle>> Pool::*list, int device, Make make) {
  {
    std::lock_guard<std::mutex> lock(pool().mu);
    auto& f = (pool().*list)[device];
    if (!f.empty()) {
      Handle h = f.back();
      f.pop_back();
      return h;
    }
  }
  return make();
}

template <class Handle>
void give(std::map<int, std::vector<Handle>> Pool::*list, int device, Handle h) {
  std::lock_guard<std::mutex> lock(pool().mu);
  (pool().*list)[device].push_back(h);
}
}  // namespace

cudaStream_t acquire_stream(int device) {
  return take(&Pool::streams, device, [] {
    cudaStream_t s;
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return s;
  });
}

void release_stream(int device, cudaStream_t stream) { give(&Pool::streams, device, stream); }

cudaEvent_t acquire_event(int device) {
  return take(&Pool::events, device, [] {
    cudaEvent_t e;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return e;
  });
}

// A recorded event may be re-recorded at once: a later record replaces the pending one.
void release_event(int device, cudaEvent_t event) { give(&Pool::events, device, event); }

void order_after(cudaStream_t engine, cudaStream_t caller) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  cudaEvent_t ready = acquire_event(device);
  check_cuda(cudaEventRecord(ready, caller), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(engine, ready, 0), "cudaStreamWaitEvent");
  release_event(device, ready);  // the wait captured the event's work at record time
}

EventWork::EventWork(std::string what, int device, cudaStream_t engine, cudaStream_t caller,
                     std::function<std::string()> poll_error, std::function<void()> on_timeout)
    : Work(std::move(what)), device_(device), engine_(engine), caller_(caller), poll_error_(std::move(poll_error)),
      on_timeout_(std::move(on_timeout)) {
  event_ = acquire_event(device_);
  check_cuda(cudaEventRecord(event_, engine), "cudaEventRecord");
  flight_started();  // on its stream: the recorder cannot see when the kernel itself begins
}

EventWork::~EventWork() {
  if (event_) release_event(device_, event_);
}

bool EventWork::test() {
  cudaError_t s = cudaEventQuery(event_);
  if (s == cudaErrorNotReady) return false;
  check_cuda(s, "cudaEventQuery");
  flight_ended(true);  // the first test that saw the event (the watchdog polls every watched op)
  return true;
}

void EventWork::wait(std::chrono::milliseconds /*timeout: the watchdog's*/) {
  check_cuda(cudaStreamWaitEvent(caller_, event_, 0), "cudaStreamWaitEvent");
}

// torch's WorkNCCL::wait: the current stream at wait time waits (it may not be the issuing one).
void EventWork::wait_on(void* stream, std::chrono::milliseconds /*timeout: the watchdog's*/) {
  check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_, 0), "cudaStreamWaitEvent");
}

void EventWork::wait_host(std::chrono::milliseconds timeout) {
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
