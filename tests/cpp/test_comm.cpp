// Every op of the Gloo transport on 2-8 processes (fork) through the file store.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>

#include "error.h"
#include "fork_ranks.h"
#include "gloo_communicator.h"
#include "emulate_nccl.h"
#include "pipeline.h"
#include "ring.h"
#include "store.h"
#include "watchdog.h"

using namespace gridweave;
using std::chrono::milliseconds;

namespace {

BufferView view_of(std::vector<double>& v) { return {v.data(), v.size(), DType::Float64}; }
BufferView view_of(std::vector<int64_t>& v) { return {v.data(), v.size(), DType::Int64}; }
BufferView view_of(std::vector<float>& v) { return {v.data(), v.size(), DType::Float32}; }

// Runs body(comm) on n forked ranks; returns the number of ranks that failed.
int run_ranks(int n, const std::function<void(GlooCommunicator&)>& body, milliseconds timeout = milliseconds(20000),
              std::shared_ptr<TrafficCounters> counters = nullptr, CheckLevel check = CheckLevel::Cheap) {
  return test_support::fork_ranks(n, [&](int r, const std::string& dir) {
    CommInfo info;
    info.axis = "world";
    info.members.resize(n);
    std::iota(info.members.begin(), info.members.end(), 0);
    info.rank = r;
    info.timeout = timeout;
    info.counters = counters ? counters : std::make_shared<TrafficCounters>();
    info.check = check;
    auto comm = std::make_shared<GlooCommunicator>(info, make_file_store(dir), make_gloo_device("127.0.0.1"));
    body(*comm);
  });
}

const milliseconds kWait(20000);

}  // namespace

class Comm : public ::testing::TestWithParam<int> {};

TEST_P(Comm, AllGatherReduceScatterAllReduce) {
  const int n = GetParam();
  EXPECT_EQ(run_ranks(n, [n](GlooCommunicator& c) {
    const int r = c.rank();
    std::vector<double> in(5), out(5 * n);
    for (int k = 0; k < 5; ++k) in[k] = r * 100 + k;
    c.all_gather(view_of(in), view_of(out))->wait(kWait);
    for (int p = 0; p < n; ++p)
      for (int k = 0; k < 5; ++k) EXPECT_EQ(out[p * 5 + k], p * 100 + k);

    std::vector<int64_t> big(3 * n), mine(3);
    for (int k = 0; k < 3 * n; ++k) big[k] = (r + 1) * k;
    c.reduce_scatter(view_of(big), view_of(mine), ReduceOp::Sum)->wait(kWait);
    const int64_t s = n * (n + 1) / 2;
    for (int k = 0; k < 3; ++k) EXPECT_EQ(mine[k], s * (r * 3 + k));
    c.reduce_scatter(view_of(big), view_of(mine), ReduceOp::Max)->wait(kWait);
    for (int k = 0; k < 3; ++k) EXPECT_EQ(mine[k], n * (r * 3 + k));

    std::vector<double> v = {double(r), -double(r), 1.0};
    c.all_reduce(view_of(v), ReduceOp::Sum)->wait(kWait);
    EXPECT_EQ(v[0], n * (n - 1) / 2.0);
    EXPECT_EQ(v[2], n);
    std::vector<int64_t> w = {r, -r};
    c.all_reduce(view_of(w), ReduceOp::Min)->wait(kWait);
    EXPECT_EQ(w[0], 0);
    EXPECT_EQ(w[1], -(n - 1));
    // a count no group size divides: the ring's chunks differ by one element
    std::vector<float> u(1003);
    for (int k = 0; k < 1003; ++k) u[k] = float(r) + 0.5f * float(k);
    c.all_reduce(view_of(u), ReduceOp::Sum)->wait(kWait);
    for (int k = 0; k < 1003; ++k) ASSERT_EQ(u[k], n * (n - 1) / 2.0f + 0.5f * float(k) * float(n)) << k;
  }), 0);
}

TEST_P(Comm, RootedOps) {
  const int n = GetParam();
  EXPECT_EQ(run_ranks(n, [n](GlooCommunicator& c) {
    const int r = c.rank(), root = n - 1;
    std::vector<double> b(4, r);
    c.broadcast(view_of(b), root)->wait(kWait);
    for (double x : b) EXPECT_EQ(x, root);

    std::vector<int64_t> red = {r, 2 * r, 7};
    c.reduce(view_of(red), ReduceOp::Sum, 0)->wait(kWait);
    if (r == 0) EXPECT_EQ(red, (std::vector<int64_t>{n * (n - 1) / 2, n * (n - 1), 7 * n}));
    else EXPECT_EQ(red, (std::vector<int64_t>{r, 2 * r, 7}));  // untouched off the root

    std::vector<double> full(2 * n), part(2);
    if (r == root) std::iota(full.begin(), full.end(), 0.0);
    c.scatter(view_of(full), view_of(part), root)->wait(kWait);
    EXPECT_EQ(part[0], 2 * r);
    EXPECT_EQ(part[1], 2 * r + 1);

    std::vector<double> mine = {double(r), double(r * r)}, all(2 * n, -1);
    c.gather(view_of(mine), view_of(all), 0)->wait(kWait);
    if (r == 0)
      for (int p = 0; p < n; ++p) EXPECT_EQ(all[2 * p + 1], p * p);

    std::vector<int64_t> a2a(n), got(n);
    for (int p = 0; p < n; ++p) a2a[p] = r * 1000 + p;
    c.all_to_all(view_of(a2a), view_of(got))->wait(kWait);
    for (int p = 0; p < n; ++p) EXPECT_EQ(got[p], p * 1000 + r);
    c.barrier()->wait(kWait);
  }), 0);
}

TEST_P(Comm, SendRecvAndRecvAny) {
  const int n = GetParam();
  EXPECT_EQ(run_ranks(n, [n](GlooCommunicator& c) {
    const int r = c.rank();
    std::vector<double> out = {double(r)}, in = {-1};
    auto s = c.send(view_of(out), (r + 1) % n, 3);
    auto q = c.recv(view_of(in), (r + n - 1) % n, 3);
    q->wait(kWait);
    s->wait(kWait);
    EXPECT_EQ(in[0], (r + n - 1) % n);
    EXPECT_EQ(q->source(), (r + n - 1) % n);
    // Everyone sends to rank 0; it takes messages in whatever order they arrive.
    if (r == 0) {
      std::vector<int> pending(n - 1);
      std::iota(pending.begin(), pending.end(), 1);
      std::vector<int> seen;
      while (!pending.empty()) {
        std::vector<double> buf = {0};
        auto w = c.recv_any(view_of(buf), pending, 9);
        w->wait(kWait);
        EXPECT_EQ(buf[0], 10.0 * w->source());
        seen.push_back(w->source());
        pending.erase(std::find(pending.begin(), pending.end(), w->source()));
      }
      EXPECT_EQ(static_cast<int>(seen.size()), n - 1);
    } else {
      std::vector<double> msg = {10.0 * r};
      c.send(view_of(msg), 0, 9)->wait(kWait);
    }
  }), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Comm, ::testing::Values(2, 3, 4, 8));

TEST(CommFaults, BadArgumentsFailBeforeCommunicating) {
  EXPECT_EQ(run_ranks(2, [](GlooCommunicator& c) {
    std::vector<double> in(3), out(5);
    try {
      c.all_gather(view_of(in), view_of(out));
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Config);
      EXPECT_NE(std::string(e.what()).find("needs 2 x 3"), std::string::npos) << e.what();
    }
    EXPECT_THROW(c.broadcast(view_of(in), 5), Error);
    EXPECT_FALSE(c.broken());
    c.barrier()->wait(kWait);  // both ranks still in step: nothing was sent
  }), 0);
}

TEST(CommFaults, SkippedCollectiveTimesOutWithANamedError) {
  EXPECT_EQ(run_ranks(2, [](GlooCommunicator& c) {
    std::vector<double> v(4, 1.0);
    if (c.rank() == 1) {
      std::this_thread::sleep_for(milliseconds(2500));  // skips the all_reduce, outlives rank 0's timeout
      return;
    }
    try {
      c.all_reduce(view_of(v), ReduceOp::Sum)->wait(milliseconds(10000));
      ADD_FAILURE() << "expected a timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("all_reduce on axis 'world'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("peers [0, 1]"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(c.broken());
    EXPECT_THROW(c.all_reduce(view_of(v), ReduceOp::Sum), Error);
  }, milliseconds(1000)), 0);
}

// Members that pass different counts: at Cheap the fingerprint is the Gloo tag (no data moves;
// a timeout, then notes compared over the store), at Detail the fingerprints are all-gathered
// first. Either way a CommError on both ranks naming what each passed.
void disagreeing_counts(CheckLevel check) {
  EXPECT_EQ(run_ranks(2, [](GlooCommunicator& c) {
    c.barrier()->wait(kWait);
    const std::size_t n = c.rank() == 0 ? 2 : 3;
    std::vector<double> in(n, 1.0), out(2 * n, 0.0);
    try {
      c.all_gather(view_of(in), view_of(out))->wait(milliseconds(10000));
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.kind(), ErrorKind::Comm) << what;
      EXPECT_NE(what.find("ranks disagree on all_gather on axis 'world'"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 0 passed all_gather #2 of 2 x float64"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 1 passed all_gather #2 of 3 x float64"), std::string::npos) << what;
    }
    EXPECT_TRUE(c.broken());
  }, milliseconds(1500), nullptr, check), 0);
}

TEST(CommFaults, DisagreeingCountsAreACommErrorAtTheCheapLevel) { disagreeing_counts(CheckLevel::Cheap); }
TEST(CommFaults, DisagreeingCountsAreACommErrorAtTheDetailLevel) { disagreeing_counts(CheckLevel::Detail); }

TEST(Fingerprint, ASendMatchesItsReceiveAndEveryFieldCounts) {
  Fingerprint send{OpKind::Send, DType::Float32, 4, 1, 7};
  Fingerprint recv = send;
  recv.op = OpKind::Recv;
  EXPECT_EQ(send.hash(), recv.hash());
  for (int field = 0; field < 4; ++field) {
    Fingerprint other = send;
    if (field == 0) other.dtype = DType::Float64;
    if (field == 1) other.count = 8;
    if (field == 2) other.root = 0;
    if (field == 3) other.seq = 8;
    EXPECT_NE(other.hash(), send.hash()) << field;
  }
  std::int64_t f[Fingerprint::kFields];
  send.to_fields(f);
  EXPECT_EQ(Fingerprint::from_fields(f), send);
  EXPECT_EQ((Fingerprint{OpKind::AllReduce, DType::BFloat16, 6, -1, 0}).str(), "all_reduce #1 of 6 x bfloat16");
}

TEST(CommFaults, AsyncOpOverlapsWithCompute) {
  EXPECT_EQ(run_ranks(4, [](GlooCommunicator& c) {
    std::vector<double> v(1 << 18, c.rank() + 1.0);
    auto w = c.all_reduce(view_of(v), ReduceOp::Sum);
    double acc = 0;  // the caller keeps computing while the worker thread communicates
    for (int k = 0; k < 1000000; ++k) acc += std::sqrt(double(k));
    w->wait(kWait);
    EXPECT_TRUE(w->test());
    EXPECT_GT(acc, 0);
    EXPECT_EQ(v[12345], 10.0);
  }), 0);
}

TEST(CommFaults, CloseCancelsAPendingReceive) {
  EXPECT_EQ(run_ranks(2, [](GlooCommunicator& c) {
    // both ranks connect first, and rank 1 stays until rank 0 has closed: rank 0 closing must
    // not race rank 1's connecting (CI saw it under load)
    c.barrier();
    if (c.rank() == 1) {  // never sends; its receive fails once rank 0 closes
      std::vector<double> never(1);
      try {
        c.recv(view_of(never), 0, 5)->wait(kWait);
      } catch (const Error&) {
      }
      return;
    }
    std::vector<double> buf(2);
    auto w = c.recv_any(view_of(buf), {1}, 4);
    EXPECT_FALSE(w->test());
    const auto start = std::chrono::steady_clock::now();
    c.close();
    try {
      w->wait(kWait);
      ADD_FAILURE() << "expected a cancellation";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Comm);
      EXPECT_NE(std::string(e.what()).find("cancelled"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    EXPECT_THROW(c.barrier(), Error);  // closed: refuses new ops
  }), 0);
}

TEST(Ring, BlocksVisitEveryRankInOrder) {
  for (int n : {2, 4}) {
    EXPECT_EQ(run_ranks(n, [n](GlooCommunicator& c) {
      std::shared_ptr<Communicator> self(&c, [](Communicator*) {});  // borrowed
      Ring ring(self);
      EXPECT_EQ(ring.next(), (c.rank() + 1) % n);
      EXPECT_EQ(ring.prev(), (c.rank() + n - 1) % n);
      std::vector<double> cur = {double(c.rank()), 10.0 * c.rank()}, nxt(2);
      for (int s = 0; s < n; ++s) {
        EXPECT_EQ(cur[0], ring.source_at(s));  // the block held at step s came from source_at(s)
        EXPECT_EQ(cur[1], 10.0 * ring.source_at(s));
        auto w = ring.exchange({view_of(cur)}, {view_of(nxt)}, s);
        w->wait(kWait);
        cur.swap(nxt);
      }
      EXPECT_EQ(cur[0], c.rank());  // n exchanges bring every block home
    }), 0);
  }
}

// A pipeline whose "compute" adds (virtual stage + 1): stage 0 must get back, for every
// microbatch, the gradient the last virtual stage made from that microbatch's activation (its
// output, passed back unchanged). Every send's bytes are released through cfg.sent once, and
// the engine copies no payload (the callbacks here keep their own copies of their inputs).
enum class Sched { MessageDriven, OneFOneB, Interleaved };

struct StageRun {
  PipelineStats st;
  int sends = 0, released = 0;
  std::vector<double> seen;          // stage 0: what came back for each microbatch
  std::vector<std::string>* log = nullptr;  // "forward mb.c" / "backward mb.c" as the callbacks run
};

StageRun run_stage(Communicator& pp, Sched sched, int m, int chunks, ReceiveStrategy receive, const StageLinks& links,
                   Communicator* control, std::vector<std::string>* log = nullptr) {
  const int s = pp.rank(), p = pp.size(), v = chunks;
  StageRun run;
  run.seen.assign(m, -1);
  run.log = log;
  std::map<std::pair<int, int>, std::vector<double>> outs, grads;
  std::set<const void*> in_flight;
  PipelineConfig cfg{s, p, m, 2, 4 * sizeof(double), receive};
  cfg.sent = [&](const void* data) {
    EXPECT_EQ(in_flight.erase(data), 1u) << "released twice, or never sent";
    ++run.released;
  };
  auto sending = [&](const std::vector<double>& d) -> const void* {
    in_flight.insert(d.data());
    ++run.sends;
    return d.data();
  };
  const bool last_virtual = s == p - 1;
  ChunkForward fwd = [&](int mb, int c, const void* in) -> const void* {
    if (log) log->push_back("forward " + std::to_string(mb) + "." + std::to_string(c));
    std::vector<double> x(4, mb);
    if (in) std::memcpy(x.data(), in, 4 * sizeof(double));
    for (double& e : x) e += c * p + s + 1;
    outs[{mb, c}] = x;
    return last_virtual && c == v - 1 ? nullptr : sending(outs[{mb, c}]);
  };
  ChunkBackward bwd = [&](int mb, int c, const void* g) -> const void* {
    if (log) log->push_back("backward " + std::to_string(mb) + "." + std::to_string(c));
    std::vector<double> d(4);
    if (g) std::memcpy(d.data(), g, 4 * sizeof(double));
    else d = outs[{mb, c}];  // the last virtual stage's "loss gradient" is its output
    if (s == 0 && c == 0) {
      run.seen[mb] = d[0];
      return nullptr;
    }
    grads[{mb, c}] = d;
    return sending(grads[{mb, c}]);
  };
  StageForward f = [&](int mb, const void* in) { return fwd(mb, 0, in); };
  StageBackward b = [&](int mb, const void* g) { return bwd(mb, 0, g); };
  if (sched == Sched::Interleaved) run.st = run_interleaved(pp, cfg, v, fwd, bwd, links);
  else if (sched == Sched::OneFOneB) run.st = run_one_f_one_b(pp, cfg, f, b, links);
  else run.st = run_message_driven(pp, cfg, f, b, control, links);
  EXPECT_TRUE(in_flight.empty()) << in_flight.size() << " sends never released";
  EXPECT_EQ(run.st.forwards, m * v);
  EXPECT_EQ(run.st.backwards, m * v);
  EXPECT_EQ(run.st.copies, 0);  // sent in place; the callbacks' copies are theirs to count
  EXPECT_EQ(run.st.copied_bytes, 0);
  const int V = p * v;
  if (s == 0)
    for (int mb = 0; mb < m; ++mb) EXPECT_EQ(run.seen[mb], mb + V * (V + 1) / 2) << "microbatch " << mb;
  return run;
}

// What a schedule that knows its order posts ahead: every message but the first one a stage
// needs before any compute (stage > 0's first activation).
void expect_posted_ahead(const StageRun& run, int stage) {
  EXPECT_EQ(run.st.posted_ahead, run.st.messages - (stage > 0 ? 1 : 0)) << "stage " << stage;
}

void pipeline_case(bool message_driven, ReceiveStrategy receive = ReceiveStrategy::Auto) {
  EXPECT_EQ(run_ranks(3, [message_driven, receive](GlooCommunicator& c) {
    // the announced strategy's control channel: here the same Gloo line (its own tag)
    StageRun run = run_stage(c, message_driven ? Sched::MessageDriven : Sched::OneFOneB, 5, 1, receive, {}, &c);
    EXPECT_EQ(run.sends, run.released);
    if (!message_driven) expect_posted_ahead(run, c.rank());
  }), 0);
}

TEST(Pipeline, MessageDrivenRunsEveryMicrobatchBothWays) { pipeline_case(true); }
TEST(Pipeline, PerPeerReceivesRunEveryMicrobatchBothWays) { pipeline_case(true, ReceiveStrategy::PerPeer); }
TEST(Pipeline, AnnouncedReceivesRunEveryMicrobatchBothWays) { pipeline_case(true, ReceiveStrategy::Announced); }
TEST(Pipeline, OneFOneBRunsEveryMicrobatchBothWays) { pipeline_case(false); }

TEST(Pipeline, InterleavedRunsEveryMicrobatchBothWays) {
  for (int p : {2, 3})
    EXPECT_EQ(run_ranks(p, [p](GlooCommunicator& c) {
      StageRun run = run_stage(c, Sched::Interleaved, 2 * p, 2, ReceiveStrategy::PerPeer, {}, nullptr);
      expect_posted_ahead(run, c.rank());
    }), 0);
}

namespace {

// Records the point-to-point ops posted on a communicator ("recv" / "send"), in the log the
// callbacks write to, and passes them on.
class LoggedLink : public Communicator {
 public:
  LoggedLink(std::shared_ptr<Communicator> inner, std::vector<std::string>& log)
      : Communicator(without_counters(inner->info())), inner_(std::move(inner)), log_(log) {}
  Device device() const override { return inner_->device(); }
  const char* backend() const override { return inner_->backend(); }
  bool can_recv_any() const override { return false; }
  bool matches_tags() const override { return inner_->matches_tags(); }

 protected:
  std::shared_ptr<Work> run_collective(OpKind op, const BufferView&, const BufferView&, ReduceOp, int, bool,
                                       const Fingerprint&) override {
    throw Error(ErrorKind::Config, describe(op) + ": a link carries messages only");
  }
  std::shared_ptr<Work> run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag,
                                const Fingerprint&) override {
    log_.push_back(op == OpKind::Send ? "send" : "recv");
    return op == OpKind::Send ? inner_->send(buf, peers[0], tag) : inner_->recv(buf, peers[0], tag);
  }

 private:
  static CommInfo without_counters(CommInfo info) {
    info.counters = nullptr;  // the inner one counts
    return info;
  }
  std::shared_ptr<Communicator> inner_;
  std::vector<std::string>& log_;
};

// A stage's links as Grid::link makes them: one two-member communicator per (sender, receiver,
// kind), every rank making its own in one global order, here Gloo under NCCL's rules with no
// eager sends (a send completes only once its receive runs; a pair's messages match in issue order).
StageLinks nccl_rules_links(GlooCommunicator& world, const std::string& dir, bool cyclic,
                            std::vector<std::string>* log_from_prev) {
  const int n = world.size(), s = world.rank();
  const int prev = cyclic ? (s + n - 1) % n : s - 1, next = cyclic ? (s + 1) % n : (s + 1 < n ? s + 1 : -1);
  std::set<std::tuple<int, int, int, int>> all;  // (low, high, sender, kind): every stage's, in one order
  for (int t = 0; t < n; ++t) {
    const int tp = cyclic ? (t + n - 1) % n : t - 1, tn = cyclic ? (t + 1) % n : (t + 1 < n ? t + 1 : -1);
    if (tn >= 0) {
      all.insert({std::min(t, tn), std::max(t, tn), t, 0});   // activations t -> tn
      all.insert({std::min(t, tn), std::max(t, tn), tn, 1});  // gradients tn -> t
    }
    if (tp >= 0) {
      all.insert({std::min(t, tp), std::max(t, tp), tp, 0});
      all.insert({std::min(t, tp), std::max(t, tp), t, 1});
    }
  }
  std::map<std::tuple<int, int, int>, std::shared_ptr<Communicator>> made;  // (sender, receiver, kind)
  for (const auto& [lo, hi, sender, kind] : all) {
    const int receiver = sender == lo ? hi : lo;
    if (s != sender && s != receiver) continue;
    const std::string key = "link:" + std::to_string(sender) + ">" + std::to_string(receiver) + "#" + std::to_string(kind);
    CommInfo info;
    info.axis = key;
    info.members = {world.info().members[sender], world.info().members[receiver]};
    info.rank = s == sender ? 0 : 1;
    info.timeout = world.info().timeout;
    auto gloo = std::make_shared<GlooCommunicator>(info, make_prefix_store(key, make_file_store(dir)),
                                                   make_gloo_device("127.0.0.1"));
    info.counters = std::make_shared<TrafficCounters>();
    made[{sender, receiver, kind}] = std::make_shared<NcclRulesCommunicator>(info, gloo, 0);
  }
  StageLinks links;
  if (next >= 0) {
    links.to_next = made.at({s, next, 0});
    links.from_next = made.at({next, s, 1});
  }
  if (prev >= 0) {
    links.from_prev = made.at({prev, s, 0});
    links.to_prev = made.at({s, prev, 1});
    if (log_from_prev) links.from_prev = std::make_shared<LoggedLink>(links.from_prev, *log_from_prev);
  }
  return links;
}

// In `log`, the receives posted on the activation link before each forward callback: the
// message it computes on, and the next one (posted ahead), wherever there is a next one.
void expect_next_receive_posted_before_each_forward(const std::vector<std::string>& log, int messages) {
  int posted = 0, forwards = 0;
  for (const std::string& e : log) {
    if (e == "recv") ++posted;
    if (e.rfind("forward", 0) == 0 && forwards++ < messages)
      EXPECT_GE(posted, std::min(forwards + 1, messages)) << "before " << e;  // forwards: its input's count, 1-based
  }
}

}  // namespace

// 1F1B, interleaved and the message-driven schedule over links under NCCL's rules (matched in
// issue order, a send waits for its receive): each link's receives are posted ahead in the order
// its sender sends (no deadlock, every gradient right), the receive of the next activation
// before the forward of the current one; the engine copies no payload.
TEST(Pipeline, ReceivesPostedAheadOnLinksUnderNcclRules) {
  struct Case {
    Sched sched;
    int chunks;
    ReceiveStrategy receive;
  };
  for (const Case& k : {Case{Sched::OneFOneB, 1, ReceiveStrategy::Auto}, Case{Sched::Interleaved, 2, ReceiveStrategy::PerPeer},
                        Case{Sched::MessageDriven, 1, ReceiveStrategy::PerPeer},
                        Case{Sched::MessageDriven, 1, ReceiveStrategy::Announced}}) {
    const int n = 3, m = 6;
    const int failed = test_support::fork_ranks(n, [&](int r, const std::string& dir) {
      CommInfo info;
      info.axis = "pp";
      info.members = {0, 1, 2};
      info.rank = r;
      info.timeout = milliseconds(20000);
      info.counters = std::make_shared<TrafficCounters>();
      auto world = std::make_shared<GlooCommunicator>(info, make_file_store(dir), make_gloo_device("127.0.0.1"));
      std::vector<std::string> log;
      const StageLinks links = nccl_rules_links(*world, dir, k.sched == Sched::Interleaved, &log);
      // pp under the rules too (the links carry every message); the announcements' control
      // channel is the host line, which can receive from any peer
      std::shared_ptr<Communicator> inner = world;
      CommInfo ruled = info;
      ruled.counters = std::make_shared<TrafficCounters>();
      auto pp = std::make_shared<NcclRulesCommunicator>(ruled, inner, 0);
      StageRun run = run_stage(*pp, k.sched, m, k.chunks, k.receive, links, world.get(), &log);
      EXPECT_EQ(run.sends, run.released);
      if (k.sched != Sched::MessageDriven) expect_posted_ahead(run, r);
      const int acts = static_cast<int>(std::count(log.begin(), log.end(), "recv"));
      if (r > 0 && k.receive != ReceiveStrategy::Announced)  // announced: a receive only for an announced message
        expect_next_receive_posted_before_each_forward(log, acts);
    });
    EXPECT_EQ(failed, 0) << "schedule " << static_cast<int>(k.sched) << " receive " << static_cast<int>(k.receive);
  }
}

// NCCL's rules (cpp/emulate_nccl.h) over a Gloo line: the ring's grouped exchange passes; the
// exchange as it was (a receive, then a send, ungrouped) times out on every rank, since each
// rank's send queues behind its receive, which waits for the previous rank's send.
TEST(NcclRules, GroupedRingExchangePassesUngroupedTimesOut) {
  for (int n : {2, 3}) {
    EXPECT_EQ(run_ranks(n, [](GlooCommunicator& c) {
      std::shared_ptr<Communicator> inner(&c, [](Communicator*) {});  // borrowed
      CommInfo info = c.info();
      info.counters = std::make_shared<TrafficCounters>();
      auto rules = std::make_shared<NcclRulesCommunicator>(info, inner, 0);
      EXPECT_FALSE(rules->can_recv_any());
      EXPECT_FALSE(rules->matches_tags());
      Ring ring(rules);
      std::vector<double> cur = {double(c.rank()), 1.0}, nxt(2);
      ring.exchange({view_of(cur)}, {view_of(nxt)}, 0)->wait(kWait);
      EXPECT_EQ(nxt[0], ring.prev());
      auto r = rules->recv(view_of(nxt), ring.prev(), 0);
      auto s = rules->send(view_of(cur), ring.next(), 0);
      ErrorKind kind = ErrorKind::Config;
      try {
        r->wait(milliseconds(1500));
      } catch (const Error& e) {
        kind = e.kind();
      }
      EXPECT_EQ(kind, ErrorKind::Timeout);
      EXPECT_TRUE(rules->broken());  // the watchdog's abort: the queued send fails, nothing hangs
      EXPECT_THROW(s->wait(kWait), Error);
    }, milliseconds(3000)), 0);
  }
}

// A communicator runs its ops in issue order: a collective issued after a receive waits for
// it, so a rank that receives before a collective its sender only joins later, deadlocks.
TEST(NcclRules, CollectivesAndMessagesRunInIssueOrder) {
  EXPECT_EQ(run_ranks(2, [](GlooCommunicator& c) {
    std::shared_ptr<Communicator> inner(&c, [](Communicator*) {});
    CommInfo info = c.info();
    info.counters = std::make_shared<TrafficCounters>();
    auto rules = std::make_shared<NcclRulesCommunicator>(info, inner, 0);
    std::vector<double> sum = {1.0 + c.rank()}, msg = {42.0};
    // in the same order on both ranks: fine
    auto a = rules->all_reduce(view_of(sum), ReduceOp::Sum);
    auto m = c.rank() == 0 ? rules->send(view_of(msg), 1, 0) : rules->recv(view_of(msg), 0, 0);
    a->wait(kWait);
    m->wait(kWait);
    EXPECT_EQ(sum[0], 3.0);
    EXPECT_EQ(msg[0], 42.0);
    // rank 1 receives before the collective, rank 0 sends after it: the collective on rank 1
    // waits behind the receive, which waits for rank 0's send, behind its collective
    if (c.rank() == 0) {
      auto x = rules->all_reduce(view_of(sum), ReduceOp::Sum);
      auto y = rules->send(view_of(msg), 1, 0);
      EXPECT_THROW(x->wait(milliseconds(1500)), Error);
    } else {
      auto y = rules->recv(view_of(msg), 0, 0);
      auto x = rules->all_reduce(view_of(sum), ReduceOp::Sum);
      EXPECT_THROW(y->wait(milliseconds(1500)), Error);
    }
  }, milliseconds(3000)), 0);
}

namespace {
// A Work that completes when told to (or never): what a stream-ordered op looks like to the
// watchdog before its event fires.
class ManualWork : public Work {
 public:
  using Work::Work;
  bool test() override { return done; }
  void wait(std::chrono::milliseconds) override {}
  int source() const override { return -1; }
  std::atomic<bool> done{false};
};
}  // namespace

// The grid's watchdog (cpp/watchdog.h): an op that completes leaves it; one past its deadline
// aborts the grid once, and every later check raises that op's timeout; a transport error
// aborts at once, naming the op.
TEST(Watchdog, AbortsOnceOnATimeoutOrATransportErrorAndNamesTheOp) {
  std::atomic<int> aborts{0};
  {
    Watchdog dog([&](const Error&) { ++aborts; }, milliseconds(1));
    auto fine = std::make_shared<ManualWork>("all_reduce on axis 'dp'");
    auto stuck = std::make_shared<ManualWork>("all_gather on axis 'tp' (rank 1, peers [0, 1])");
    dog.watch(fine, Watchdog::Clock::now() + milliseconds(5000));
    dog.watch(stuck, Watchdog::Clock::now() + milliseconds(100));
    fine->done = true;
    for (int i = 0; i < 400 && !dog.failed(); ++i) std::this_thread::sleep_for(milliseconds(5));
    ASSERT_TRUE(dog.failed());
    EXPECT_EQ(dog.outstanding(), 0u);
    try {
      dog.check();
      ADD_FAILURE() << "check() did not raise";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Timeout);
      EXPECT_NE(std::string(e.what()).find("all_gather on axis 'tp'"), std::string::npos) << e.what();
    }
    dog.watch(std::make_shared<ManualWork>("late"), Watchdog::Clock::now());  // after the abort: no second one
    std::this_thread::sleep_for(milliseconds(50));
  }
  EXPECT_EQ(aborts.load(), 1);
  std::atomic<int> errors{0};
  Watchdog dog([&](const Error& e) { errors += e.kind() == ErrorKind::Comm; }, milliseconds(1));
  dog.watch(std::make_shared<ManualWork>("send on axis 'pp'"), Watchdog::Clock::now() + milliseconds(60000),
            [] { return std::string("remote process exited"); });
  for (int i = 0; i < 400 && !dog.failed(); ++i) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(errors.load(), 1);
  EXPECT_THROW(dog.check(), Error);
}

// The watchdog sleeps between polls: idle, until an op is watched; with an op outstanding, a
// poll interval between looks (it spun a core while any op was outstanding). What it costs is
// this process's CPU time over a window the test thread sleeps through, as a share of the window.
TEST(Watchdog, SleepsBetweenPolls) {
  auto cpu = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
  };
  Watchdog dog([](const Error&) {}, milliseconds(2));
  for (bool outstanding : {false, true}) {
    auto op = std::make_shared<ManualWork>("recv on axis 'pp'");
    if (outstanding) dog.watch(op, Watchdog::Clock::now() + milliseconds(60000));
    const double c0 = cpu();
    const auto t0 = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(milliseconds(300));
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT((cpu() - c0) / wall, 0.25) << (outstanding ? "an op outstanding" : "idle");
    op->done = true;
  }
  EXPECT_FALSE(dog.failed());
}
