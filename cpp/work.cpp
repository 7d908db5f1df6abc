#include "work.h"

#include "error.h"

namespace gridweave {

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
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    source_ = source;
  }
  cv_.notify_all();
}

void TaskWork::fail(std::exception_ptr error) {
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
