#include "communicator.h"

#include <algorithm>
#include <functional>
#include <sstream>
#include <thread>

#include "error.h"
#include "store.h"
#include "watchdog.h"

namespace gridweave {

namespace {

// "all_gather on axis 'x' (rank 3, peers [2, 3])", or the one peer of a point-to-point op.
std::string description(const CommInfo& info, OpKind op, int peer) {
  std::ostringstream os;
  os << op_name(op) << " on axis '" << info.axis << "' (rank " << info.members[info.rank] << ", peers ";
  if (peer >= 0) os << "[" << info.members.at(peer) << "]";
  else os << join_ranks(info.members);
  os << ")";
  return os.str();
}

}  // namespace

Communicator::Communicator(CommInfo info) : info_(std::move(info)) {
  GW_CHECK(!info_.members.empty(), "communicator for axis '" << info_.axis << "' has no members");
  GW_CHECK(info_.rank >= 0 && info_.rank < size(),
           "rank " << info_.rank << " is not a member of the " << size() << "-rank communicator '" << info_.axis << "'");
  if (info_.member_nodes.empty()) info_.member_nodes.assign(info_.members.size(), 0);
  GW_CHECK(info_.member_nodes.size() == info_.members.size(), "member_nodes must list one node per member");
  for (std::size_t k = 0; k < info_.members.size(); ++k)
    peer_is_intra_.push_back(info_.member_nodes[k] == info_.member_nodes[info_.rank]);
  for (int op = 0; op <= static_cast<int>(OpKind::Barrier); ++op)
    described_.push_back(description(info_, static_cast<OpKind>(op), -1));
  if (info_.flight && info_.flight->capacity() == 0) info_.flight = nullptr;  // disabled: no per-op call
  if (info_.flight && info_.flight_line < 0)
    info_.flight_line = info_.flight->add_line(info_.name.empty() ? info_.axis : info_.name, info_.members);
}

FlightOp Communicator::flight_issue(OpKind op, const BufferView& buf, int root, int peer, int tag) {
  if (!info_.flight) return FlightOp();
  FlightEntry e;
  e.line = info_.flight_line;
  e.kind = static_cast<int>(op);
  const bool p2p = op == OpKind::Send || op == OpKind::Recv;
  e.seq = p2p ? p2p_seq_.fetch_add(1) + 1 : seq_ + 1;
  e.tag = p2p ? tag : -1;
  e.peer = peer >= 0 ? info_.members[peer] : -1;
  e.root = root >= 0 ? info_.members[root] : -1;
  e.count = buf.count;
  e.bytes = buf.nbytes();
  e.dtype = buf.dtype;
  return FlightOp(info_.flight.get(), info_.flight->issue(e));
}

std::string Communicator::describe(OpKind op, int peer) const {
  return peer < 0 ? described_[static_cast<std::size_t>(op)] : description(info_, op, peer);
}

std::uint32_t Fingerprint::hash() const {
  std::uint32_t h = 2166136261u;  // FNV-1a, 32 bits: Gloo tags are 32 bits wide
  auto mix = [&h](std::uint64_t v) {
    for (int b = 0; b < 8; ++b) h = (h ^ static_cast<std::uint8_t>(v >> (8 * b))) * 16777619u;
  };
  mix(static_cast<std::uint64_t>(op == OpKind::Recv ? OpKind::Send : op));  // a send matches its receive
  mix(static_cast<std::uint64_t>(dtype));
  mix(static_cast<std::uint64_t>(count));
  mix(static_cast<std::uint64_t>(static_cast<std::int64_t>(root)));
  mix(seq);
  return h;
}

std::string Fingerprint::str() const {
  std::ostringstream os;
  const bool p2p = op == OpKind::Send || op == OpKind::Recv;
  os << op_name(op);
  if (p2p) os << " (tag " << seq << ")";
  else os << " #" << seq + 1;  // the n-th collective on this communicator
  if (op != OpKind::Barrier) os << " of " << count << " x " << dtype_name(dtype);
  if (root >= 0) os << (p2p ? " with peer " : ", root ") << root;
  return os.str();
}

void Fingerprint::to_fields(std::int64_t* f) const {
  f[0] = static_cast<std::int64_t>(op);
  f[1] = static_cast<std::int64_t>(dtype);
  f[2] = count;
  f[3] = root;
  f[4] = static_cast<std::int64_t>(seq);
}

Fingerprint Fingerprint::from_fields(const std::int64_t* f) {
  return Fingerprint{static_cast<OpKind>(f[0]), static_cast<DType>(f[1]), f[2], static_cast<int>(f[3]),
                     static_cast<std::uint64_t>(f[4])};
}

Fingerprint Fingerprint::exchange() const {
  return Fingerprint{OpKind::AllGather, DType::Int64, static_cast<std::int64_t>(kFields), -1,
                     seq | (std::uint64_t{1} << 63)};
}

Fingerprint Communicator::agree(OpKind op, const BufferView& buf, int root) {
  const Fingerprint fp = Fingerprint::of(op, buf, root, seq_);
  if (info_.check == CheckLevel::Detail && size() > 1) {
    const std::vector<Fingerprint> all = exchange_fingerprints(fp);
    std::ostringstream os;
    bool differ = false;
    for (int k = 0; k < size(); ++k) {
      differ = differ || all[k] != fp;
      os << (k ? "; " : "") << "rank " << info_.members[k] << " passed " << all[k].str();
    }
    if (differ) {
      const std::string msg = "gridweave: ranks disagree on " + describe(op) + ": " + os.str();
      mark_broken(msg);
      throw Error(ErrorKind::Comm, msg);
    }
  }
  ++seq_;
  return fp;
}

std::vector<Fingerprint> Communicator::exchange_fingerprints(const Fingerprint& mine) {
  GW_CHECK(device() == Device::CPU, backend() << " transport: the Detail check needs exchange_fingerprints");
  std::vector<std::int64_t> in(Fingerprint::kFields), out(Fingerprint::kFields * size());
  mine.to_fields(in.data());
  BufferView vin, vout;
  vin.ptr = in.data();
  vin.count = in.size();
  vout.ptr = out.data();
  vout.count = out.size();
  vin.dtype = vout.dtype = DType::Int64;
  run_collective(OpKind::AllGather, vin, vout, ReduceOp::Sum, 0, false, mine.exchange())->wait(info_.timeout);
  std::vector<Fingerprint> all(size());
  for (int k = 0; k < size(); ++k) all[k] = Fingerprint::from_fields(out.data() + Fingerprint::kFields * k);
  return all;
}

std::string Communicator::compare_notes(Store* store, const Fingerprint& mine, std::chrono::milliseconds window) const {
  if (!store) return "";
  const std::string key = "gw_notes/" + info_.session + "/";
  auto encode = [](const Fingerprint& f) { return std::to_string(f.hash()) + "|" + f.str(); };
  const auto deadline = std::chrono::steady_clock::now() + window;  // the set's and the gets' together
  try {
    const std::string me = encode(mine);
    store->set_within(key + std::to_string(rank()), std::vector<char>(me.begin(), me.end()), window);
  } catch (const std::exception&) {
    return "";  // the store is gone or behind the failing link too: nothing to compare
  }
  std::ostringstream os;
  bool differ = false;
  for (int k = 0; k < size(); ++k) {
    os << (k ? "; " : "") << "rank " << info_.members[k];
    if (k == rank()) {
      os << " passed " << mine.str();
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      std::vector<char> v = store->get(key + std::to_string(k), std::max(left, std::chrono::milliseconds(1)));
      std::string s(v.begin(), v.end());
      const auto bar = s.find('|');
      differ = differ || s.substr(0, bar) != std::to_string(mine.hash());
      os << " passed " << s.substr(bar + 1);
    } catch (const std::exception&) {
      os << " is in no op on this axis (it skipped this one, finished or died)";
    }
  }
  return differ ? "ranks disagree on " + describe(mine.op) + ": " + os.str() : "";
}

void Communicator::check_usable(OpKind op) const {
  if (info_.watchdog) info_.watchdog->check();  // the failure that aborted the grid, by name
  if (broken_) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(why_mutex_);
      why = broken_why_;
    }
    throw Error(ErrorKind::Comm, "gridweave: " + describe(op) + " refused: this communicator failed earlier (" +
                                     (why.empty() ? "a peer died, timed out or skipped a collective" : why) +
                                     "); build a new grid");
  }
}

void Communicator::check_buffer(const BufferView& b, const char* what, OpKind op) const {
  GW_CHECK(b.ptr != nullptr || b.count == 0, describe(op) << ": " << what << " buffer is null");
  GW_CHECK(b.device == device(), describe(op) << ": " << what << " is on "
                                              << (b.device == Device::CPU ? "cpu" : "cuda") << " but the "
                                              << backend() << " transport needs "
                                              << (device() == Device::CPU ? "cpu" : "cuda") << " memory");
}

void Communicator::check_root(int root, OpKind op) const {
  GW_CHECK(root >= 0 && root < size(), describe(op) << ": root/peer " << root << " is outside [0, " << size() << ")");
}

void Communicator::count(OpKind op, const BufferView& buf, int root) const {
  if (!info_.counters) return;
  info_.counters->record(info_.axis, schedule(op, size(), rank(), buf.nbytes(), root, static_cast<int>(dtype_size(buf.dtype))),
                         peer_is_intra_);
}

std::shared_ptr<Work> Communicator::issue_collective(OpKind op, const BufferView& in, const BufferView& out,
                                                     ReduceOp rop, int root, bool async_op, const BufferView& same,
                                                     const BufferView& counted) {
  FlightOp rec = flight_issue(op, same, root, -1, -1);
  const Fingerprint fp = agree(op, same, root);
  const int at = root < 0 ? 0 : root;  // the transports' and the counters' root of an unrooted op
  count(op, counted, at);
  return flown(rec, run_collective(op, in, out, rop, at, async_op, fp));
}

std::shared_ptr<Work> Communicator::all_gather(const BufferView& in, const BufferView& out, bool async_op) {
  const OpKind op = OpKind::AllGather;
  check_usable(op);
  check_buffer(in, "input", op);
  check_buffer(out, "output", op);
  GW_CHECK(in.dtype == out.dtype, describe(op) << ": input is " << dtype_name(in.dtype) << ", output "
                                               << dtype_name(out.dtype));
  GW_CHECK(out.count == in.count * size(), describe(op) << ": output holds " << out.count << " elements, needs "
                                                        << size() << " x " << in.count);
  return issue_collective(op, in, out, ReduceOp::Sum, -1, async_op, in, in);
}

void Communicator::check_reducible(const BufferView& b, OpKind op) const {
  GW_CHECK(b.dtype != DType::UInt8, describe(op) << ": uint8 (float8's bytes) is moved, not reduced");
}

std::shared_ptr<Work> Communicator::reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp rop, bool async_op) {
  const OpKind op = OpKind::ReduceScatter;
  check_usable(op);
  check_buffer(in, "input", op);
  check_reducible(in, op);
  check_buffer(out, "output", op);
  GW_CHECK(in.dtype == out.dtype, describe(op) << ": input is " << dtype_name(in.dtype) << ", output "
                                               << dtype_name(out.dtype));
  GW_CHECK(in.count == out.count * size(), describe(op) << ": input holds " << in.count << " elements, must be "
                                                        << size() << " x output (" << out.count << ")");
  return issue_collective(op, in, out, rop, -1, async_op, out, in);
}

std::shared_ptr<Work> Communicator::all_reduce(const BufferView& buf, ReduceOp rop, bool async_op) {
  const OpKind op = OpKind::AllReduce;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  check_reducible(buf, op);
  return issue_collective(op, buf, buf, rop, -1, async_op, buf, buf);
}

std::shared_ptr<Work> Communicator::broadcast(const BufferView& buf, int root, bool async_op) {
  const OpKind op = OpKind::Broadcast;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  check_root(root, op);
  return issue_collective(op, buf, buf, ReduceOp::Sum, root, async_op, buf, buf);
}

std::shared_ptr<Work> Communicator::reduce(const BufferView& buf, ReduceOp rop, int root, bool async_op) {
  const OpKind op = OpKind::Reduce;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  check_reducible(buf, op);
  check_root(root, op);
  return issue_collective(op, buf, buf, rop, root, async_op, buf, buf);
}

std::shared_ptr<Work> Communicator::scatter(const BufferView& in, const BufferView& out, int root, bool async_op) {
  const OpKind op = OpKind::Scatter;
  check_usable(op);
  check_root(root, op);
  check_buffer(out, "output", op);
  if (rank() == root) {
    check_buffer(in, "input", op);
    GW_CHECK(in.dtype == out.dtype, describe(op) << ": input and output dtypes differ");
    GW_CHECK(in.count == out.count * size(), describe(op) << ": root input holds " << in.count
                                                          << " elements, needs " << size() << " x " << out.count);
  }
  return issue_collective(op, in, out, ReduceOp::Sum, root, async_op, out, out);
}

std::shared_ptr<Work> Communicator::gather(const BufferView& in, const BufferView& out, int root, bool async_op) {
  const OpKind op = OpKind::Gather;
  check_usable(op);
  check_root(root, op);
  check_buffer(in, "input", op);
  if (rank() == root) {
    check_buffer(out, "output", op);
    GW_CHECK(in.dtype == out.dtype, describe(op) << ": input and output dtypes differ");
    GW_CHECK(out.count == in.count * size(), describe(op) << ": root output holds " << out.count
                                                          << " elements, needs " << size() << " x " << in.count);
  }
  return issue_collective(op, in, out, ReduceOp::Sum, root, async_op, in, in);
}

std::shared_ptr<Work> Communicator::all_to_all(const BufferView& in, const BufferView& out, bool async_op) {
  const OpKind op = OpKind::AllToAll;
  check_usable(op);
  check_buffer(in, "input", op);
  check_buffer(out, "output", op);
  GW_CHECK(in.dtype == out.dtype && in.count == out.count,
           describe(op) << ": input and output must have the same dtype and count");
  GW_CHECK(in.count % size() == 0, describe(op) << ": " << in.count << " elements do not split into " << size()
                                                << " equal chunks");
  return issue_collective(op, in, out, ReduceOp::Sum, -1, async_op, in, in);
}

namespace {
// A send and its receive agree on the tag, the dtype and the element count; as the Gloo
// slot, a receive never takes a message of another size (which would abort Gloo's loop).
Fingerprint p2p_fingerprint(OpKind op, const BufferView& buf, int tag) {
  return Fingerprint::of(op, buf, -1, static_cast<std::uint64_t>(tag));
}
}  // namespace

namespace {

// A p2p op whose other side answers (see Communicator::acknowledged). Sender: waits for the
// data and the answer, then compares. Receiver: once the data is in (or failed), answers
// with what it passed.
class AckedWork : public Work {
 public:
  AckedWork(std::string what, std::shared_ptr<Work> data, std::weak_ptr<Communicator> comm, Fingerprint mine,
            int peer, std::function<std::shared_ptr<Work>(const BufferView&, int)> post,
            std::chrono::milliseconds timeout)
      : Work(std::move(what)), data_(std::move(data)), comm_(std::move(comm)), mine_(mine), peer_(peer),
        post_(std::move(post)), timeout_(timeout), answer_(Fingerprint::kFields) {
    if (mine_.op == OpKind::Send) ack_ = post_(view(), peer_);  // the answer's receive, posted at once
  }
  bool test() override {
    if (!data_->test()) return false;
    if (mine_.op == OpKind::Send) return ack_->test();
    answer();
    return true;
  }
  void wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto left = [&] {
      return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                        deadline - std::chrono::steady_clock::now()));
    };
    if (mine_.op == OpKind::Recv) {
      try {
        data_->wait(timeout);
      } catch (const Error& e) {
        if (e.kind() == ErrorKind::Comm) answer();  // a mismatch MPI saw: the sender must learn of it too
        throw;
      }
      answer();
      return;
    }
    data_->wait(left());
    ack_->wait(left());
    const Fingerprint theirs = Fingerprint::from_fields(answer_.data());
    if (theirs.count != mine_.count || theirs.dtype != mine_.dtype)
      throw Error(ErrorKind::Comm, "gridweave: ranks disagree on " + what_ + ": this rank passed " + mine_.str() +
                                       "; the receiving rank passed " + theirs.str());
  }
  int source() const override { return data_->source(); }
  void attach_flight(const std::shared_ptr<FlightRecorder>& rec, std::uint64_t id) override {
    data_->attach_flight(rec, id);  // the message's own Work stamps it
  }

 private:
  BufferView view() {
    BufferView v;
    v.ptr = answer_.data();
    v.count = answer_.size();
    v.dtype = DType::Int64;
    return v;
  }
  void answer() {
    if (answered_) return;
    answered_ = true;
    const int to = peer_ >= 0 ? peer_ : data_->source();
    if (to < 0) return;
    mine_.to_fields(answer_.data());
    if (auto c = comm_.lock()) {
      try {
        post_(view(), to)->wait(timeout_);
      } catch (const std::exception&) {
        // the sender is gone or gave up: this side's own outcome stands
      }
    }
  }
  std::shared_ptr<Work> data_, ack_;
  std::weak_ptr<Communicator> comm_;
  Fingerprint mine_;
  int peer_;
  std::function<std::shared_ptr<Work>(const BufferView&, int)> post_;
  std::chrono::milliseconds timeout_;
  std::vector<std::int64_t> answer_;
  bool answered_ = false;
};

}  // namespace

std::shared_ptr<Work> Communicator::acknowledged(std::shared_ptr<Work> data, const Fingerprint& fp, int peer) {
  // The answer is a message of its own, told apart by its tag: only where tags match messages.
  if (info_.check != CheckLevel::Detail || device() != Device::CPU || !matches_tags()) return data;
  const int tag = static_cast<int>(fp.seq) | kAnswerTagBit;
  std::weak_ptr<Communicator> self = weak_from_this();
  const OpKind ack_op = fp.op == OpKind::Send ? OpKind::Recv : OpKind::Send;
  auto post = [self, ack_op, tag](const BufferView& v, int to) -> std::shared_ptr<Work> {
    auto c = self.lock();
    if (!c) throw Error(ErrorKind::Comm, "gridweave: the communicator was shut down");
    return c->run_p2p(ack_op, v, {to}, tag, Fingerprint::of(ack_op, v, -1, static_cast<std::uint64_t>(tag)));
  };
  return std::make_shared<AckedWork>(data->what(), std::move(data), self, fp, peer, post, info_.timeout);
}

void Communicator::check_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag) const {
  check_usable(op);
  check_buffer(buf, "buffer", op);
  GW_CHECK(!peers.empty(), describe(op) << ": no peers to receive from");
  GW_CHECK(peers.size() == 1 || can_recv_any(),
           describe(op) << ": the " << backend() << " transport cannot receive from any of several peers (NCCL has "
                           "no receive-from-any); receive from one peer, or announce messages on a control channel");
  for (int p : peers) {
    check_root(p, op);
    GW_CHECK(p != rank(), describe(op, p) << (op == OpKind::Send ? ": cannot send to itself" : ": cannot receive from itself"));
  }
  GW_CHECK(tag >= 0, describe(op, peers[0]) << ": tag must be >= 0");
  GW_CHECK(info_.check != CheckLevel::Detail || tag < kAnswerTagBit,
           describe(op, peers[0]) << ": tags from 2^29 up carry the Detail check's answers");
}

std::shared_ptr<Work> Communicator::send(const BufferView& buf, int peer, int tag) {
  const OpKind op = OpKind::Send;
  check_p2p(op, buf, {peer}, tag);
  FlightOp rec = flight_issue(op, buf, -1, peer, tag);
  count(op, buf, peer);
  const Fingerprint fp = p2p_fingerprint(op, buf, tag);
  return flown(rec, acknowledged(run_p2p(op, buf, {peer}, tag, fp), fp, peer));
}

std::shared_ptr<Work> Communicator::recv(const BufferView& buf, int peer, int tag) {
  return recv_any(buf, {peer}, tag);
}

std::shared_ptr<Work> Communicator::recv_any(const BufferView& buf, const std::vector<int>& peers, int tag) {
  const OpKind op = OpKind::Recv;
  check_p2p(op, buf, peers, tag);
  FlightOp rec = flight_issue(op, buf, -1, peers.size() == 1 ? peers[0] : -1, tag);
  // Counted on completion, when the sender is known (see the transports).
  const Fingerprint fp = p2p_fingerprint(op, buf, tag);
  return flown(rec, acknowledged(run_p2p(op, buf, peers, tag, fp), fp, peers.size() == 1 ? peers[0] : -1));
}

std::vector<std::shared_ptr<Work>> Communicator::batch(const std::vector<P2P>& ops) {
  std::vector<Fingerprint> fps;
  for (const P2P& o : ops) {
    GW_CHECK(o.op == OpKind::Send || o.op == OpKind::Recv,
             describe(o.op) << ": a batch holds sends and receives only");
    check_p2p(o.op, o.buf, {o.peer}, o.tag);
    fps.push_back(p2p_fingerprint(o.op, o.buf, o.tag));
  }
  // one guard an op; a batch is short (a pipeline's neighbours, an all-to-all's members)
  std::vector<FlightOp> recs(info_.flight ? ops.size() : 0);
  for (std::size_t k = 0; k < recs.size(); ++k) recs[k] = flight_issue(ops[k].op, ops[k].buf, -1, ops[k].peer, ops[k].tag);
  for (const P2P& o : ops)
    if (o.op == OpKind::Send) count(o.op, o.buf, o.peer);
  std::vector<std::shared_ptr<Work>> works = run_batch(ops, fps);
  for (std::size_t k = 0; k < ops.size(); ++k) {
    works[k] = acknowledged(works[k], fps[k], ops[k].peer);
    if (k < recs.size()) flown(recs[k], works[k]);
  }
  return works;
}

std::vector<std::shared_ptr<Work>> Communicator::run_batch(const std::vector<P2P>& ops,
                                                           const std::vector<Fingerprint>& fps) {
  std::vector<std::shared_ptr<Work>> works;
  for (std::size_t k = 0; k < ops.size(); ++k)
    works.push_back(run_p2p(ops[k].op, ops[k].buf, {ops[k].peer}, ops[k].tag, fps[k]));
  return works;
}

std::shared_ptr<Work> Communicator::barrier(bool async_op) {
  check_usable(OpKind::Barrier);
  BufferView none;
  none.device = device();
  FlightOp rec = flight_issue(OpKind::Barrier, none, -1, -1, -1);
  const Fingerprint fp = agree(OpKind::Barrier, none, -1);
  return flown(rec, run_collective(OpKind::Barrier, none, none, ReduceOp::Sum, 0, async_op, fp));
}

}  // namespace gridweave
