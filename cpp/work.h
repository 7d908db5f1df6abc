// Work handles of asynchronous operations, and the per-communicator worker
// thread that runs CPU collectives so communication overlaps with compute.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace gridweave {

class FlightRecorder;

class Work {
 public:
  explicit Work(std::string what) : what_(std::move(what)) {}
  virtual ~Work() = default;
  // True once finished (successfully or not); never blocks.
  virtual bool test() = 0;
  // Blocks up to `timeout`; rethrows the op's error; throws CommTimeout naming the op. A
  // stream-ordered op (NCCL) blocks nothing: the caller's stream waits for it, and the grid's
  // watchdog owns its timeout (cpp/watchdog.h).
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // wait() as torch's Work.wait(): `stream` (a cudaStream_t; null is the legacy default stream),
  // the caller's current stream at wait time, waits for the op, whichever stream issued it. Host
  // transports have no streams: their results are ready when wait() returns.
  virtual void wait_on(void* /*stream*/, std::chrono::milliseconds timeout) { wait(timeout); }
  // Blocks the host until the op's results are readable by the host (what the engine needs
  // before it reads a message's header); the same as wait() for host transports.
  virtual void wait_host(std::chrono::milliseconds timeout) { wait(timeout); }
  // Source rank (index in the communicator) of a recv / recv_any, else -1.
  virtual int source() const = 0;
  // The stream the op runs on (stream-ordered transports), else null: its buffers must live
  // until that stream is past the op (torch: Tensor.record_stream).
  virtual void* stream() const { return nullptr; }
  const std::string& what() const { return what_; }

  // The flight recorder's entry of this op (cpp/flight.h), attached once by the code that issued
  // it. Whoever runs the op stamps when it starts and ends, maybe before the entry is attached (a
  // worker may finish it first): those stamps are kept and handed over on attach. Lock-free: the
  // issuing thread's attach and a worker's stamps never wait on each other. A Work that wraps
  // another passes the entry on.
  virtual void attach_flight(const std::shared_ptr<FlightRecorder>& rec, std::uint64_t id);
  void flight_started();
  void flight_ended(bool ok);

 protected:
  std::string what_;

 private:
  std::shared_ptr<FlightRecorder> flight_;  // written once, before flight_id_ publishes it
  std::atomic<std::uint64_t> flight_id_{0};
  std::atomic<std::int64_t> flight_start_ns_{0};
  std::atomic<std::int64_t> flight_end_{0};  // (steady ns << 1) | ok; 0: not ended
};

// Completed by whoever runs it (a worker thread, a p2p waiter).
class TaskWork : public Work {
 public:
  using Work::Work;
  bool test() override;
  void wait(std::chrono::milliseconds timeout) override;
  int source() const override;
  void complete(int source = -1);
  void fail(std::exception_ptr error);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  int source_ = -1;
  std::exception_ptr error_;
};

// FIFO of tasks on one thread: ops on a communicator run in issue order, as
// every rank of it issues them, so tags never collide.
class Worker {
 public:
  Worker();
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  void submit(std::shared_ptr<TaskWork> work, std::function<int()> task);
  // Runs `task` on the calling thread if nothing is queued or running, keeping FIFO
  // order; returns false (and runs nothing) otherwise. Exceptions propagate.
  bool run_inline(const std::function<void()>& task);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<TaskWork>, std::function<int()>>> queue_;
  bool stop_ = false;
  bool busy_ = false;  // a task runs, on the worker or inline
  std::thread thread_;
};

}  // namespace gridweave
