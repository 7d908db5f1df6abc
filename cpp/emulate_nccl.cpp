#include "emulate_nccl.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

#include "error.h"
#include "watchdog.h"

namespace gridweave {

namespace {

using Clock = std::chrono::steady_clock;

// The inner transport's tags: a message and its clear-to-send share the pair's order number.
constexpr std::uint64_t kOrderWrap = 8192;
int data_tag(std::uint64_t order) { return static_cast<int>(2 * (order % kOrderWrap)); }
int cts_tag(std::uint64_t order) { return data_tag(order) + 1; }

// A receive's clear-to-send: what it expects, so the sender can tell a message that NCCL
// would match to the wrong receive (by order) from the right one.
constexpr std::size_t kCtsWords = 4;  // tag, count, dtype, order

BufferView host_words(std::int64_t* p, std::size_t n) {
  BufferView v;
  v.ptr = p;
  v.count = n;
  v.dtype = DType::Int64;
  return v;
}

std::chrono::milliseconds left(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// What a user holds: the op's part of a queued item. On a timeout it aborts the communicator,
// as NCCL's watchdog does, and names the op the communicator was still running.
class RuledWork : public Work {
 public:
  RuledWork(std::string what, std::shared_ptr<TaskWork> task, int source, std::weak_ptr<Communicator> comm,
            std::function<std::string()> running)
      : Work(std::move(what)), task_(std::move(task)), source_(source), comm_(std::move(comm)),
        running_(std::move(running)) {}
  bool test() override { return task_->test(); }
  void wait(std::chrono::milliseconds timeout) override {
    try {
      task_->wait(timeout);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Timeout) throw;
      const std::string ahead = running_();
      if (auto c = comm_.lock()) c->close();  // the watchdog's abort: queued and running ops fail
      const bool itself = ahead.rfind(what_, 0) == 0;
      throw Error(ErrorKind::Timeout, "gridweave: " + what_ + " timed out after " +
                                          std::to_string(timeout.count() / 1000.0) + " s under NCCL's rules" +
                                          (ahead.empty() ? " (queued behind ops that had failed)"
                                           : itself      ? " (it was running: its peer never met it)"
                                                         : " (the communicator was still running " + ahead + ")") +
                                          ": a peer skipped it, died, or is waiting for this rank in an order "
                                          "NCCL cannot progress (group a send with the receive it waits on)");
    }
  }
  int source() const override { return task_->test() ? source_ : -1; }

 private:
  std::shared_ptr<TaskWork> task_;
  int source_;
  std::weak_ptr<Communicator> comm_;
  std::function<std::string()> running_;
};

void wait_all(const std::vector<std::shared_ptr<Work>>& works, Clock::time_point deadline) {
  for (const auto& w : works)
    if (w) w->wait(left(deadline));
}

}  // namespace

struct NcclRulesCommunicator::Eager {
  Item item;
  std::vector<char> copy;              // the message, owned: the caller's buffer is free at once
  std::vector<std::int64_t> cts;       // the receive's clear-to-send, checked when it comes
  std::shared_ptr<Work> data, ready;
  Clock::time_point deadline;
};

NcclRulesCommunicator::NcclRulesCommunicator(CommInfo info, std::shared_ptr<Communicator> inner,
                                             std::size_t eager_bytes)
    : Communicator(std::move(info)), inner_(std::move(inner)), eager_bytes_(eager_bytes),
      sent_(size(), 0), received_(size(), 0),
      calls_(
          "NCCL (emulated)",
          [this]() -> CallStatus {
            // settle() returns before the next op is issued: the op polled is the last one issued
            const std::uint64_t mine = issued_ops_;
            const bool taken = taken_.load() >= mine;
            const bool queued_behind = finished_.load() + 1 < mine;  // an earlier op is still on the worker
            return {taken || queued_behind ? CallState::Success : CallState::InProgress, ""};
          },
          [this](const Error& e) {  // as the watchdog does for a watched op: the grid goes down
            mark_broken(e.what());
            if (info_.watchdog) info_.watchdog->abort(e);
            close();
          }),
      worker_(std::make_unique<Worker>()) {
  GW_CHECK(inner_ && inner_->device() == Device::CPU && inner_->size() == size() && inner_->rank() == rank(),
           "NCCL's rules need a host communicator over the same members");
}

NcclRulesCommunicator::~NcclRulesCommunicator() {
  close();
  worker_.reset();  // queued ops fail fast (broken), the running one ends with its inner op
  drop_eager();
}

namespace {
void settle(const std::shared_ptr<Work>& w) {  // an aborted op's end, whatever it was
  try {
    if (w) w->wait(std::chrono::milliseconds(2000));
  } catch (...) {
  }
}
}  // namespace

void NcclRulesCommunicator::drop_eager() {
  // after close(): the inner transport ends the posted ops before their buffers go
  for (auto& e : eager_) {
    settle(e->ready);
    settle(e->data);
  }
  eager_.clear();
}

void NcclRulesCommunicator::close() {
  Communicator::close();
  inner_->close();  // cancels the inner receives a running op waits on
}

std::string NcclRulesCommunicator::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

std::vector<std::shared_ptr<Work>> NcclRulesCommunicator::enqueue(std::vector<Item> items, const std::string& what) {
  auto task = std::make_shared<TaskWork>(what);
  std::vector<std::shared_ptr<Work>> works;
  auto self = std::static_pointer_cast<NcclRulesCommunicator>(shared_from_this());
  std::weak_ptr<NcclRulesCommunicator> weak = self;
  auto running = [weak]() -> std::string {
    auto c = weak.lock();
    return c ? c->running() : std::string();
  };
  for (Item& it : items) {
    const bool p2p = it.op == OpKind::Send || it.op == OpKind::Recv;
    works.push_back(std::make_shared<RuledWork>(p2p ? describe(it.op, it.root) : describe(it.op), task,
                                                it.op == OpKind::Recv ? it.root : -1, weak, running));
    it.flight = works.back();
  }
  const std::uint64_t position = ++issued_ops_;
  // Raw `this`: the destructor drains the worker before the communicator goes.
  worker_->submit(task, [this, items = std::move(items), what, position]() {
    taken_.fetch_add(1);
    // The flight recorder's stamps of the users' Works: started now, ended as the item ends
    // (an exception that leaves here fails them; the item's own Works are stamped alike).
    struct Flown {
      const std::vector<Item>& items;
      bool ok = false;
      ~Flown() {
        for (const Item& it : items)
          if (it.flight) it.flight->flight_ended(ok);
      }
    } flown{items};
    for (const Item& it : items)
      if (it.flight) it.flight->flight_started();
    struct Finished {
      std::atomic<std::uint64_t>& n;
      ~Finished() { n.fetch_add(1); }
    } finished{finished_};
    if (broken()) {  // aborted: fail as the op that aborted it did (a timeout stays a timeout)
      std::lock_guard<std::mutex> lock(mu_);
      throw Error(abort_kind_, "gridweave: " + what + " not run: the communicator was aborted after " +
                                   (abort_what_.empty() ? std::string("an earlier failure") : abort_what_));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = what + " (op #" + std::to_string(position) + " issued here)";
    }
    struct Idle {
      NcclRulesCommunicator* c;
      ~Idle() {
        std::lock_guard<std::mutex> lock(c->mu_);
        c->running_.clear();
      }
    } idle{this};
    try {
      reap(false);
      const OpKind op = items.front().op;
      if (op == OpKind::Send || op == OpKind::Recv) run_group(items);
      else run_one_collective(items.front());
      flown.ok = true;
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (abort_what_.empty()) {
        abort_kind_ = e.kind();
        abort_what_ = what + " failed: " + e.what();
      }
      throw;
    }
    return -1;
  });
  // NCCL's issue step: a non-blocking communicator may return ncclInProgress while its launch is
  // handed to a background thread (here the worker), and is polled until it settles. The op is
  // handed over once the worker took it or it queued behind a running op (a kernel behind
  // another): never a wait on a peer, so async ops issue as freely as on NCCL.
  calls_.settle(what, CallStatus{CallState::InProgress, ""}, Clock::now() + info_.timeout);
  return works;
}

void NcclRulesCommunicator::run_one_collective(const Item& it) {
  const auto deadline = Clock::now() + info_.timeout;
  Communicator& c = *inner_;
  std::shared_ptr<Work> w;
  switch (it.op) {
    case OpKind::AllGather: w = c.all_gather(it.in, it.out); break;
    case OpKind::ReduceScatter: w = c.reduce_scatter(it.in, it.out, it.rop); break;
    case OpKind::AllReduce: w = c.all_reduce(it.out, it.rop); break;
    case OpKind::Broadcast: w = c.broadcast(it.out, it.root); break;
    case OpKind::Reduce: w = c.reduce(it.out, it.rop, it.root); break;
    case OpKind::Scatter: w = c.scatter(it.in, it.out, it.root); break;
    case OpKind::Gather: w = c.gather(it.in, it.out, it.root); break;
    case OpKind::AllToAll: w = c.all_to_all(it.in, it.out); break;
    case OpKind::Barrier: w = c.barrier(); break;
    default: GW_CHECK(false, describe(it.op) << " is not a collective");
  }
  w->wait(left(deadline));
}

// One NCCL group: every receive says it runs (a clear-to-send carrying what it expects) and
// is posted; every send waits for its receive to run, checks it is the message that receive
// expects, then goes. All of it posted before anything is waited on: the ops progress together.
void NcclRulesCommunicator::run_group(const std::vector<Item>& items) {
  const std::size_t n = items.size();
  std::vector<std::vector<std::int64_t>> cts(n, std::vector<std::int64_t>(kCtsWords));
  std::vector<std::shared_ptr<Work>> posted(n), ready(n);
  std::vector<std::unique_ptr<Eager>> buffered;
  try {
    run_group(items, cts, posted, ready, buffered);
  } catch (...) {
    // The inner transport may still hold these buffers: abort it (NCCL's watchdog would abort
    // the communicator) and let every posted op end before the buffers go.
    close();
    for (std::size_t k = 0; k < n; ++k) {
      settle(posted[k]);
      settle(ready[k]);
    }
    for (auto& e : buffered) {
      settle(e->ready);
      settle(e->data);
    }
    throw;
  }
  for (auto& e : buffered) eager_.push_back(std::move(e));
}

void NcclRulesCommunicator::run_group(const std::vector<Item>& items, std::vector<std::vector<std::int64_t>>& cts,
                                      std::vector<std::shared_ptr<Work>>& posted,
                                      std::vector<std::shared_ptr<Work>>& ready,
                                      std::vector<std::unique_ptr<Eager>>& buffered) {
  const auto deadline = Clock::now() + info_.timeout;
  const std::size_t n = items.size();
  for (std::size_t k = 0; k < n; ++k) {
    const Item& it = items[k];
    if (it.op != OpKind::Recv) continue;
    cts[k] = {it.tag, static_cast<std::int64_t>(it.out.count), static_cast<std::int64_t>(it.out.dtype),
              static_cast<std::int64_t>(it.order)};
    ready[k] = inner_->send(host_words(cts[k].data(), kCtsWords), it.root, cts_tag(it.order));
    posted[k] = inner_->recv(it.out, it.root, data_tag(it.order));
  }
  for (std::size_t k = 0; k < n; ++k) {
    const Item& it = items[k];
    if (it.op != OpKind::Send) continue;
    if (it.in.nbytes() <= eager_bytes_) {  // buffered: the send completes now, the message follows
      auto e = std::make_unique<Eager>();
      e->item = it;
      e->item.flight = nullptr;  // the group's Works are stamped by the worker, not kept here
      e->copy.assign(static_cast<const char*>(it.in.ptr), static_cast<const char*>(it.in.ptr) + it.in.nbytes());
      e->item.in.ptr = e->copy.data();
      e->cts.assign(kCtsWords, 0);
      e->ready = inner_->recv(host_words(e->cts.data(), kCtsWords), it.root, cts_tag(it.order));
      e->data = inner_->send(e->item.in, it.root, data_tag(it.order));
      e->deadline = deadline;
      buffered.push_back(std::move(e));
      continue;
    }
    ready[k] = inner_->recv(host_words(cts[k].data(), kCtsWords), it.root, cts_tag(it.order));
  }
  for (std::size_t k = 0; k < n; ++k) {  // each send runs once its receive does
    const Item& it = items[k];
    if (it.op != OpKind::Send || !ready[k]) continue;
    ready[k]->wait(left(deadline));
    check_expected(it, cts[k]);
    posted[k] = inner_->send(it.in, it.root, data_tag(it.order));
  }
  wait_all(posted, deadline);
  wait_all(ready, deadline);
  for (const Item& it : items)  // a receive is counted once its message is in, as elsewhere
    if (it.op == OpKind::Recv) count(OpKind::Recv, it.out, it.root);
}

// A send meets the receive NCCL would match it with (the pair's next, by order): that receive's
// clear-to-send must expect this message, or the code relied on tags NCCL ignores.
void NcclRulesCommunicator::check_expected(const Item& it, const std::vector<std::int64_t>& want) {
  const bool same = want[0] == it.tag && want[1] == static_cast<std::int64_t>(it.in.count) &&
                    want[2] == static_cast<std::int64_t>(it.in.dtype);
  if (same) return;
  std::ostringstream os;
  os << "gridweave: " << describe(OpKind::Send, it.root) << ": NCCL matches a pair's messages in issue order, "
     << "and this rank's message #" << it.order + 1 << " to that peer (tag " << it.tag << ", " << it.in.count
     << " x " << dtype_name(it.in.dtype) << ") meets the peer's receive #" << want[3] + 1 << " from this rank (tag "
     << want[0] << ", " << want[1] << " x " << dtype_name(static_cast<DType>(want[2]))
     << "): the code relies on tags or an order NCCL does not keep";
  mark_broken(os.str());  // an op submitted after this is refused naming it
  throw Error(ErrorKind::Comm, os.str());
}

void NcclRulesCommunicator::reap(bool all) {
  while (!eager_.empty()) {
    Eager& e = *eager_.front();
    if (!all && !(e.ready->test() && e.data->test())) {
      if (Clock::now() < e.deadline) return;  // still on its way
    }
    try {
      e.ready->wait(left(e.deadline));
      e.data->wait(left(e.deadline));
    } catch (...) {
      close();
      drop_eager();
      throw;
    }
    check_expected(e.item, e.cts);
    eager_.pop_front();
  }
}

std::shared_ptr<Work> NcclRulesCommunicator::run_collective(OpKind op, const BufferView& in, const BufferView& out,
                                                            ReduceOp rop, int root, bool /*async_op*/,
                                                            const Fingerprint& /*fp*/) {
  Item it;
  it.op = op;
  it.in = in;
  it.out = out;
  it.rop = rop;
  it.root = root;
  return enqueue({it}, describe(op)).front();
}

std::shared_ptr<Work> NcclRulesCommunicator::run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers,
                                                     int tag, const Fingerprint& fp) {
  P2P p;
  p.op = op;
  p.buf = buf;
  p.peer = peers.front();  // check_p2p refused several peers (no receive-from-any)
  p.tag = tag;
  return run_batch({p}, {fp}).front();
}

std::vector<std::shared_ptr<Work>> NcclRulesCommunicator::run_batch(const std::vector<P2P>& ops,
                                                                    const std::vector<Fingerprint>& /*fps*/) {
  if (ops.empty()) return {};
  std::vector<Item> items;
  std::ostringstream what;
  for (const P2P& o : ops) {
    Item it;
    it.op = o.op;
    it.root = o.peer;
    it.tag = o.tag;
    (o.op == OpKind::Send ? it.in : it.out) = o.buf;
    it.order = o.op == OpKind::Send ? sent_[o.peer]++ : received_[o.peer]++;
    items.push_back(it);
    what << (items.size() > 1 ? " + " : "") << describe(o.op, o.peer);
  }
  return enqueue(std::move(items), ops.size() > 1 ? "group of " + what.str() : what.str());
}

}  // namespace gridweave
