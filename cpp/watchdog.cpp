#include "watchdog.h"

namespace gridweave {

Watchdog::Watchdog(std::function<void(const Error&)> abort, std::chrono::milliseconds poll)
    : abort_(std::move(abort)), poll_(poll), thread_([this] { loop(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::watch(std::shared_ptr<Work> work, Clock::time_point deadline, std::function<std::string()> poll_error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.push_back({std::move(work), deadline, std::move(poll_error)});
  }
  cv_.notify_all();
}

void Watchdog::check() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_) throw *failure_;
}

bool Watchdog::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_ != nullptr;
}

std::size_t Watchdog::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void Watchdog::poll_outstanding() {
  std::vector<std::shared_ptr<Work>> works;
  {
    std::unique_lock<std::mutex> lock(mu_);
    passed_.wait_for(lock, std::chrono::seconds(1), [&] { return !passing_; });
    works.reserve(entries_.size());
    for (const auto& e : entries_) works.push_back(e.work);
  }
  for (const auto& w : works) {
    try {
      w->test();
    } catch (...) {  // the watchdog's next pass sees it too, and fails the grid
    }
  }
}

void Watchdog::fail(const Error& e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) return;  // the first failure speaks; the abort makes the rest fail too
    failure_ = std::make_unique<Error>(e);
  }
  if (abort_) abort_(e);
}

void Watchdog::loop() {
  for (;;) {
    std::vector<Entry> now;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle, it sleeps until an op is watched; with ops outstanding it polls them every poll_
      // (waiting on "entries not empty" then would return at once: a core spun while an op ran)
      cv_.wait(lock, [&] { return stop_ || !entries_.empty(); });
      cv_.wait_for(lock, poll_, [&] { return stop_; });
      if (stop_) return;
      now.swap(entries_);  // polled outside the lock: test() may call into the driver
      passing_ = true;
    }
    std::vector<Entry> keep;
    for (auto& e : now) {
      try {
        if (e.work->test()) continue;
        const std::string err = e.poll_error ? e.poll_error() : std::string();
        if (!err.empty()) {
          e.work->flight_ended(false);
          fail(Error(ErrorKind::Comm, "gridweave: " + e.work->what() + " failed: " + err));
          continue;
        }
        if (Clock::now() > e.deadline) {
          e.work->flight_ended(false);  // aborted: it never completes now
          fail(Error(ErrorKind::Timeout, "gridweave: " + e.work->what() +
                                             " timed out (the grid's watchdog aborted its communicators): a peer is "
                                             "slow, skipped this op or died"));
          continue;
        }
        keep.push_back(std::move(e));
      } catch (const Error& err) {
        e.work->flight_ended(false);
        fail(err);
      } catch (const std::exception& err) {
        e.work->flight_ended(false);
        fail(Error(ErrorKind::Comm, std::string("gridweave: ") + e.work->what() + " failed: " + err.what()));
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_) keep.clear();  // aborted: nothing left to wait for
      entries_.insert(entries_.begin(), std::make_move_iterator(keep.begin()), std::make_move_iterator(keep.end()));
      passing_ = false;
    }
    passed_.notify_all();
  }
}

}  // namespace gridweave
