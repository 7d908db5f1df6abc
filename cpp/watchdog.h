// The owner of a grid's timeouts for operations that complete on their own (stream-ordered
// GPU ops, whose wait() returns at once: torch's ProcessGroupNCCL watchdog). A thread polls
// each outstanding op and its transport's error against the op's deadline; on a failure or a
// timeout it aborts every communicator of the grid (so no kernel waits forever on a peer) and
// keeps why, which the next op of the grid raises.
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "error.h"
#include "work.h"

namespace gridweave {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  // abort: called once, with the failure (it aborts the grid): from the watchdog's thread, or
  // from the thread that called abort().
  explicit Watchdog(std::function<void(const Error&)> abort,
                    std::chrono::milliseconds poll = std::chrono::milliseconds(2));
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  // Watches `work` until it completes; poll_error (may be empty) reports the transport's
  // asynchronous error ("" while healthy).
  void watch(std::shared_ptr<Work> work, Clock::time_point deadline, std::function<std::string()> poll_error = {});
  // A failure seen outside the watchdog's thread (an NCCL call that errored or never settled,
  // cpp/nonblocking.h): aborts the grid and is kept, as a watched op's failure; the first one speaks.
  void abort(const Error& e) { fail(e); }
  // Throws the failure that aborted the grid, if any.
  void check() const;
  bool failed() const;
  std::size_t outstanding() const;
  // Tests every outstanding op once on the calling thread (after the watchdog's pass under way,
  // if any, is done): an op that completed but was not yet seen is stamped ended in the flight
  // recorder (the grid's shutdown, before its dump). Its errors are left to the watchdog.
  void poll_outstanding();

 private:
  struct Entry {
    std::shared_ptr<Work> work;
    Clock::time_point deadline;
    std::function<std::string()> poll_error;
  };
  void loop();
  void fail(const Error& e);
  std::function<void(const Error&)> abort_;
  std::chrono::milliseconds poll_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable passed_;  // a pass over the ops ended
  bool passing_ = false;            // the thread holds the ops (out of entries_) and tests them
  std::vector<Entry> entries_;
  std::unique_ptr<Error> failure_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace gridweave
