// The issue step of non-blocking communicators (cpp/nonblocking.h): a call that NCCL reports
// "in progress" is polled until it settles, and only then is its completion event recorded and
// the op handed to the watchdog; an error or a call that never settles aborts, naming the op.
// Driven here by a fake transport, and through the emulation of NCCL's rules on Gloo.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "emulate_nccl.h"
#include "error.h"
#include "fork_ranks.h"
#include "gloo_communicator.h"
#include "nonblocking.h"
#include "store.h"
#include "watchdog.h"

using namespace gridweave;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// A communicator whose calls return "in progress" and settle after `in_progress` polls, with
// `end` (Success or Error), or never. Everything it is asked is logged, in order.
struct FakeTransport {
  int in_progress = 0;
  bool never = false;
  CallState end = CallState::Success;
  int polls = 0;
  std::vector<std::string> log;

  CallStatus issue(CallState returned) {
    log.push_back("issue");
    return {returned, returned == CallState::Error ? "invalid usage" : ""};
  }
  CallStatus poll() {
    log.push_back("poll");
    if (never || polls++ < in_progress) return {CallState::InProgress, ""};
    return {end, end == CallState::Error ? "unhandled system error" : ""};
  }
};

// What a stream-ordered op is to the watchdog before its event fires.
class PendingWork : public Work {
 public:
  using Work::Work;
  bool test() override { return false; }
  void wait(std::chrono::milliseconds) override {}
  int source() const override { return -1; }
};

// The transport's sequence for one op (cuda/nccl_communicator.cu): issue, settle, record the
// completion event, hand the op to the watchdog.
void run_op(NonBlockingCalls& calls, FakeTransport& t, Watchdog& dog, const std::string& what, CallState returned,
            Clock::time_point deadline) {
  const CallStatus issued = t.issue(returned);
  calls.settle(what, issued, deadline);
  t.log.push_back("record");
  dog.watch(std::make_shared<PendingWork>(what), deadline);
}

const std::string kOp = "all_gather on axis 'tp' (rank 1, peers [0, 1])";

}  // namespace

TEST(NonBlockingCalls, PollsUntilSuccessThenRecordsAndWatches) {
  FakeTransport t;
  t.in_progress = 5;
  int aborts = 0;
  Watchdog dog([](const Error&) {}, milliseconds(50));
  NonBlockingCalls calls("NCCL", [&] { return t.poll(); }, [&](const Error&) { ++aborts; });
  run_op(calls, t, dog, kOp, CallState::InProgress, Clock::now() + milliseconds(5000));
  // six polls: five "in progress", then the one that settled; the event only after them
  const std::vector<std::string> want = {"issue", "poll", "poll", "poll", "poll", "poll", "poll", "record"};
  EXPECT_EQ(t.log, want);
  EXPECT_EQ(calls.in_progress_polls(), 5u);
  EXPECT_EQ(dog.outstanding(), 1u);
  EXPECT_EQ(aborts, 0);

  // a call that returned success is not polled (the next call is valid at once)
  t.log.clear();
  run_op(calls, t, dog, kOp, CallState::Success, Clock::now() + milliseconds(5000));
  EXPECT_EQ(t.log, (std::vector<std::string>{"issue", "record"}));
  EXPECT_EQ(calls.in_progress_polls(), 5u);
  EXPECT_FALSE(dog.failed());
}

TEST(NonBlockingCalls, AnErrorAbortsOnceAndNamesTheOp) {
  FakeTransport t;
  t.in_progress = 2;
  t.end = CallState::Error;
  std::vector<std::string> aborted;
  Watchdog dog([](const Error&) {}, milliseconds(50));
  NonBlockingCalls calls("NCCL", [&] { return t.poll(); }, [&](const Error& e) { aborted.push_back(e.what()); });
  try {
    run_op(calls, t, dog, kOp, CallState::InProgress, Clock::now() + milliseconds(5000));
    ADD_FAILURE() << "no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Comm);
    const std::string msg = e.what();
    EXPECT_NE(msg.find(kOp), std::string::npos) << msg;
    EXPECT_NE(msg.find("unhandled system error"), std::string::npos) << msg;
    ASSERT_EQ(aborted.size(), 1u);
    EXPECT_EQ(aborted[0], msg);  // abort is told the error that is thrown
  }
  EXPECT_EQ(t.log, (std::vector<std::string>{"issue", "poll", "poll", "poll"}));  // never recorded
  EXPECT_EQ(calls.in_progress_polls(), 2u);
  EXPECT_EQ(dog.outstanding(), 0u);  // never watched

  // a call that fails at once is not polled; a poll that throws is an error too
  t.log.clear();
  EXPECT_THROW(run_op(calls, t, dog, kOp, CallState::Error, Clock::now() + milliseconds(5000)), Error);
  EXPECT_EQ(t.log, (std::vector<std::string>{"issue"}));
  NonBlockingCalls throwing("NCCL", []() -> CallStatus { throw std::runtime_error("driver gone"); },
                            [&](const Error& e) { aborted.push_back(e.what()); });
  try {
    throwing.settle(kOp, {CallState::InProgress, ""}, Clock::now() + milliseconds(5000));
    ADD_FAILURE() << "no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Comm);
    EXPECT_NE(std::string(e.what()).find("driver gone"), std::string::npos) << e.what();
  }
  EXPECT_EQ(aborted.size(), 3u);
}

TEST(NonBlockingCalls, NeverSettlingTimesOutWithinTheDeadlineAndAbortsTheGrid) {
  FakeTransport t;
  t.never = true;
  std::atomic<int> grid_aborts{0};
  Watchdog dog([&](const Error&) { ++grid_aborts; }, milliseconds(50));
  int aborts = 0;
  // the abort a transport passes: the grid's watchdog keeps the failure and aborts the grid
  NonBlockingCalls calls("NCCL", [&] { return t.poll(); }, [&](const Error& e) {
    ++aborts;
    dog.abort(e);
  });
  const auto start = Clock::now();
  try {
    run_op(calls, t, dog, kOp, CallState::InProgress, start + milliseconds(200));
    ADD_FAILURE() << "no timeout raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Timeout);
    const std::string msg = e.what();
    EXPECT_NE(msg.find(kOp), std::string::npos) << msg;
    EXPECT_NE(msg.find("in progress"), std::string::npos) << msg;
  }
  const auto took = Clock::now() - start;
  EXPECT_GE(took, milliseconds(200));
  EXPECT_LT(took, milliseconds(2000));  // bounded by the deadline, not by the transport
  EXPECT_EQ(aborts, 1);
  EXPECT_EQ(grid_aborts.load(), 1);
  EXPECT_GT(calls.in_progress_polls(), 0u);
  EXPECT_EQ(std::count(t.log.begin(), t.log.end(), std::string("record")), 0);
  // the next op of the grid raises the failure that aborted it, by name
  try {
    dog.check();
    ADD_FAILURE() << "check() did not raise";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Timeout);
    EXPECT_NE(std::string(e.what()).find(kOp), std::string::npos) << e.what();
  }
}

namespace {

// Runs body(rules, rank) on 2 forked ranks, each a Gloo line wrapped in NCCL's rules (rendezvous
// sends: eager_bytes 0); returns the number of ranks that failed.
int run_rules(const std::function<void(NcclRulesCommunicator&, int)>& body) {
  return test_support::fork_ranks(2, [&](int r, const std::string& dir) {
    CommInfo info;
    info.axis = "pp";
    info.members = {0, 1};
    info.rank = r;
    info.timeout = milliseconds(20000);
    info.counters = std::make_shared<TrafficCounters>();
    auto inner = std::make_shared<GlooCommunicator>(info, make_file_store(dir), make_gloo_device("127.0.0.1"));
    auto rules = std::make_shared<NcclRulesCommunicator>(info, inner, 0);
    body(*rules, r);
  });
}

}  // namespace

// Under NCCL's rules every op goes through the same issue step: it is "in progress" until the
// worker takes it or it queues behind a running op. So the host issues ops while earlier ones
// wait on a peer (as on NCCL), and the results are those of the ops in issue order.
TEST(NcclRulesIssue, OpsQueuedBehindAPeerWaitIssueAtOnce) {
  EXPECT_EQ(run_rules([](NcclRulesCommunicator& c, int rank) {
    std::vector<double> a = {1.0}, b = {2.0};
    BufferView va{a.data(), a.size(), DType::Float64}, vb{b.data(), b.size(), DType::Float64};
    if (rank == 0) {
      const auto start = Clock::now();
      auto r1 = c.recv(va, 1, 0);  // waits for rank 1, which sends late
      auto r2 = c.recv(vb, 1, 1);  // queued behind it
      auto s = c.all_reduce(va, ReduceOp::Sum);
      EXPECT_LT(Clock::now() - start, milliseconds(300)) << "issuing waited on the peer";
      r1->wait(milliseconds(20000));
      r2->wait(milliseconds(20000));
      s->wait(milliseconds(20000));
      EXPECT_EQ(b[0], 20.0);
      EXPECT_EQ(a[0], 20.0);  // 10 received, then summed with rank 1's 10
    } else {
      std::this_thread::sleep_for(milliseconds(600));
      a[0] = 10.0;
      b[0] = 20.0;
      c.send(va, 0, 0)->wait(milliseconds(20000));
      c.send(vb, 0, 1)->wait(milliseconds(20000));
      c.all_reduce(va, ReduceOp::Sum)->wait(milliseconds(20000));
      EXPECT_EQ(a[0], 20.0);
    }
    // one op at a time, each waited: each is issued to an idle worker and polled until taken
    for (int k = 0; k < 20; ++k) {
      std::vector<double> x = {double(k + rank)};
      c.all_reduce({x.data(), 1, DType::Float64}, ReduceOp::Sum)->wait(milliseconds(20000));
      EXPECT_EQ(x[0], double(2 * k + 1));
    }
    std::printf("rank %d: %llu polls found an op still in progress\n", rank,
                static_cast<unsigned long long>(c.in_progress_polls()));
  }), 0);
}
