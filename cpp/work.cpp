#include "work.h"

#include "error.h"
#include "flight.h"

namespace gridweave {

// Either side may come first: each writes its own field, then reads the other's (sequentially
// consistent), so at least one of them hands the stamp to the recorder (which takes the first).
void Work::attach_flight(const std::shared_ptr<FlightRecorder>& rec, std::uint64_t id) {
  flight_ = rec;
  flight_id_.store(id);
  if (const std::int64_t s = flight_start_ns_.load()) rec->started(id, s);
  if (const std::int64_t e = flight_end_.load()) rec->ended(id, e >> 1, e & 1);
}

void Work::flight_started() {
  // no recorder records in this process (GRIDWEAVE_FLIGHT_ENTRIES=0): no clock read, no stamp
  if (!flight_id_.load() && !FlightRecorder::any_enabled()) return;
  std::int64_t none = 0;
  const std::int64_t ns = FlightRecorder::now_ns();
  if (!flight_start_ns_.compare_exchange_strong(none, ns)) return;
  if (const std::uint64_t id = flight_id_.load()) flight_->started(id, ns);
}

void Work::flight_ended(bool ok) {
  if (!flight_id_.load() && !FlightRecorder::any_enabled()) return;
  std::int64_t none = 0;
  const std::int64_t ns = FlightRecorder::now_ns();
  if (!flight_end_.compare_exchange_strong(none, (ns << 1) | (ok ? 1 : 0))) return;
  if (const std::uint64_t id = flight_id_.load()) flight_->ended(id, ns, ok);
}

bool TaskWork::test() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void TaskWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
    throw Error(ErrorKind::Timeout, "gridweave: " + what_ + " timed out after " +
                                        std::to_string(timeout.count() / 1000.0) + " s waiting for its peers");
  }
  if (error_) std::rethrow_exception(error_);
}

int TaskWork::source() const {
  std::lock_guard<std::mutex> lock(mu_);
  return source_;
}

void TaskWork::complete(int source) {
  flight_ended(true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    source_ = source;
  }
  cv_.notify_all();
}

void TaskWork::fail(std::exception_ptr error) {
  flight_ended(false);
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

Worker::Worker() : thread_([this] { loop(); }) {}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Worker::submit(std::shared_ptr<TaskWork> work, std::function<int()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(work), std::move(task));
  }
  cv_.notify_one();
}

bool Worker::run_inline(const std::function<void()>& task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || !queue_.empty()) return false;
    busy_ = true;
  }
  struct Release {
    Worker* w;
    ~Release() {
      {
        std::lock_guard<std::mutex> lock(w->mu_);
        w->busy_ = false;
      }
      w->cv_.notify_all();
    }
  } release{this};
  task();
  return true;
}

void Worker::loop() {
  for (;;) {
    std::pair<std::shared_ptr<TaskWork>, std::function<int()>> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return (stop_ && !busy_) || (!queue_.empty() && !busy_); });
      if (queue_.empty()) return;  // stop requested and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    item.first->flight_started();
    try {
      item.first->complete(item.second());
    } catch (...) {
      item.first->fail(std::current_exception());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
  }
}

}  // namespace gridweave
