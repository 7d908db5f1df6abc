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

void Worker::loop() {
  for (;;) {
    std::pair<std::shared_ptr<TaskWork>, std::function<int()>> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop requested and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      item.first->complete(item.second());
    } catch (...) {
      item.first->fail(std::current_exception());
    }
  }
}

}  // namespace gridweave
