// The Communicator interface: the ops of one group of ranks (a line of the grid)
// on raw buffers. Arguments are checked here, once, for every transport; traffic is
// counted here from the op's schedule. Transports (Gloo in cpp/, NCCL in cuda/)
// implement the run_* hooks.
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtype.h"
#include "flight.h"
#include "traffic.h"
#include "work.h"

namespace gridweave {

class Store;
class Watchdog;

// How much every op verifies that all members passed the same thing. Cheap (always on):
// local checks, and on transports that match messages by tag the op's fingerprint is the
// tag, so members that disagree never exchange data (they time out, then compare notes
// over the store). Detail (like TORCH_DISTRIBUTED_DEBUG=DETAIL): every collective first
// all-gathers the fingerprints, so a disagreement is a CommError on every member at once.
enum class CheckLevel : int { Cheap = 0, Detail = 1 };

// At the Detail level a receive answers its sender on the message's tag with this bit set
// (user tags stay below it).
constexpr int kAnswerTagBit = 1 << 29;

// What one member passed to one op: the same on every member, or they disagree.
// count is per member (all_gather's input, reduce_scatter's output); p2p ops use seq for
// the user's tag, since a send and its receive are matched by tag, not by call order.
struct Fingerprint {
  OpKind op = OpKind::Barrier;
  DType dtype = DType::Float32;
  std::int64_t count = 0;
  int root = -1;
  std::uint64_t seq = 0;
  bool operator==(const Fingerprint& o) const {
    return op == o.op && dtype == o.dtype && count == o.count && root == o.root && seq == o.seq;
  }
  bool operator!=(const Fingerprint& o) const { return !(*this == o); }
  static Fingerprint of(OpKind op, const BufferView& buf, int root, std::uint64_t seq) {
    return Fingerprint{op, buf.dtype, static_cast<std::int64_t>(buf.count), root, seq};
  }
  std::uint32_t hash() const;  // FNV-1a of the fields: the Gloo tag
  std::string str() const;     // "all_gather #3 of 4 x float32": the third collective here
  // As kFields int64s, for the Detail level's exchange.
  static constexpr std::size_t kFields = 5;
  void to_fields(std::int64_t* f) const;
  static Fingerprint from_fields(const std::int64_t* f);
  // The exchange's own fingerprint: an all_gather of kFields int64s at this position, so it
  // matches whatever each member passed.
  Fingerprint exchange() const;
};

// One point-to-point op of a batch (Communicator::batch): a send or a receive of `buf` with
// `peer` (an index in the communicator).
struct P2P {
  OpKind op = OpKind::Send;  // Send or Recv
  BufferView buf;
  int peer = 0;
  int tag = 0;
};

struct CommInfo {
  std::string axis;                // label: "y", "x,y", "world"
  std::vector<int> members;        // global ranks; index = rank in this communicator
  int rank = 0;                    // this process's index in members
  std::vector<int> member_nodes;   // node of each member (placement's ranks_per_node)
  int ranks_on_node = 1;           // the grid's ranks on this rank's node
  std::chrono::milliseconds timeout{300000};
  std::shared_ptr<TrafficCounters> counters;  // may be null
  std::string session;             // names this line of this grid alike on all its members
  CheckLevel check = CheckLevel::Cheap;
  std::shared_ptr<Watchdog> watchdog;  // the grid's, for ops that complete on their own (may be null)
  std::shared_ptr<FlightRecorder> flight;  // the grid's flight recorder (may be null: nothing recorded)
  int flight_line = -1;  // this line in the recorder, when the grid registered it (else the constructor does)
  std::string name;      // the line's name in the grid (a link's own), for the recorder; "" means axis
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  explicit Communicator(CommInfo info);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return info_.rank; }
  int size() const { return static_cast<int>(info_.members.size()); }
  const CommInfo& info() const { return info_; }
  virtual Device device() const = 0;
  virtual const char* backend() const = 0;  // for messages only: code branches on capabilities
  // Capability: recv_any completes from whichever peer sends first (Gloo: yes; NCCL has no
  // receive-from-any, so its recv_any can only post one receive per peer).
  virtual bool can_recv_any() const = 0;
  // Capability: when a member dies, the survivors' ops fail with CommError (Gloo, NCCL) rather
  // than the launcher ending every rank (MPI).
  virtual bool survives_peer_failure() const { return true; }
  // Capability: messages are matched by the op's fingerprint (Gloo's tags), so members that
  // passed different ops never exchange data even at the Cheap check level.
  virtual bool matches_fingerprints() const { return false; }
  // Capability: device buffers are read and written in the order of the current CUDA stream
  // (NCCL); otherwise a transport handed CUDA memory (a CUDA-aware MPI) reads it at once, so
  // the caller synchronises the stream first.
  virtual bool stream_ordered() const { return false; }
  // Capability: a receive takes the message sent with its tag (Gloo's slots, MPI's tags).
  // Without it (NCCL) a pair's messages are matched in issue order, whatever their tags.
  virtual bool matches_tags() const { return true; }

  // Every op returns a Work; wait on it. With async_op=false a transport may run the
  // op on the calling thread when nothing is queued before it (saves two thread
  // hand-offs per op); the Work is then already complete.
  // out = concat over members of in (member order).
  std::shared_ptr<Work> all_gather(const BufferView& in, const BufferView& out, bool async_op = true);
  // out = chunk `rank` of the reduction over members of in; in.count = size * out.count.
  std::shared_ptr<Work> reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp op, bool async_op = true);
  std::shared_ptr<Work> all_reduce(const BufferView& buf, ReduceOp op, bool async_op = true);
  std::shared_ptr<Work> broadcast(const BufferView& buf, int root, bool async_op = true);
  // In place: on root, buf becomes the reduction over members.
  std::shared_ptr<Work> reduce(const BufferView& buf, ReduceOp op, int root, bool async_op = true);
  // Root's in (size * out.count elements) is cut into size chunks; member k gets chunk k.
  std::shared_ptr<Work> scatter(const BufferView& in, const BufferView& out, int root, bool async_op = true);
  // Root's out (size * in.count elements) receives every member's in, in member order.
  std::shared_ptr<Work> gather(const BufferView& in, const BufferView& out, int root, bool async_op = true);
  // in and out hold size equal chunks; chunk k of in goes to member k.
  std::shared_ptr<Work> all_to_all(const BufferView& in, const BufferView& out, bool async_op = true);
  std::shared_ptr<Work> send(const BufferView& buf, int peer, int tag);
  std::shared_ptr<Work> recv(const BufferView& buf, int peer, int tag);
  // Receives from whichever of `peers` sends first; Work::source() tells which.
  std::shared_ptr<Work> recv_any(const BufferView& buf, const std::vector<int>& peers, int tag);
  std::shared_ptr<Work> barrier(bool async_op = true);
  // Point-to-point ops that progress together, as torch's batch_isend_irecv: one group on
  // NCCL (ncclGroupStart / ncclGroupEnd), so a send and a receive that wait on each other's
  // peers cannot deadlock. One Work per op, in order; every op is checked before any is posted.
  std::vector<std::shared_ptr<Work>> batch(const std::vector<P2P>& ops);
  // Collectives issued on this communicator so far (every member agrees, or an op failed).
  std::uint64_t issued() const { return seq_; }

  // Thrown by every op once the communicator has failed (a peer died or timed out).
  bool broken() const { return broken_; }
  // Cancels pending point-to-point waits (their Work fails with CommError) and refuses
  // new ops; ops already queued fail when their turn comes (Gloo; elsewhere they drain).
  // Called by Grid::shutdown and by the watchdog when an op fails.
  virtual void close() { broken_ = true; }

 protected:
  // Throws the failure that aborted the grid, or that this communicator failed earlier.
  void check_usable(OpKind op) const;
  std::string describe(OpKind op, int peer = -1) const;
  // After a failed op: publish what this member passed under `store` and read what the
  // others did, waiting up to `window` for them. Returns "" when no member reported a
  // different op, else the disagreement, naming what each member passed.
  std::string compare_notes(Store* store, const Fingerprint& mine, std::chrono::milliseconds window) const;
  // Detail level: all-gathers the fingerprints of every member (a fixed-size message, so
  // the exchange itself cannot disagree). The default runs an all_gather of int64s on CPU
  // memory through run_collective; transports on device memory override it.
  virtual std::vector<Fingerprint> exchange_fingerprints(const Fingerprint& mine);
  // True for the call that broke it (the first failure speaks; later ones are its echoes).
  // `why`: the first failure's message, which a later op's refusal repeats.
  bool mark_broken(const std::string& why = "") {
    const bool first = !broken_.exchange(true);
    if (first && !why.empty()) {
      std::lock_guard<std::mutex> lock(why_mutex_);
      broken_why_ = why;
    }
    return first;
  }
  void count(OpKind op, const BufferView& buf, int root) const;

  // Transport hooks; arguments already checked. `work` is completed by the transport.
  // `fp` is what this member passed (a transport that matches by tag uses fp.hash()).
  virtual std::shared_ptr<Work> run_collective(OpKind op, const BufferView& in, const BufferView& out,
                                               ReduceOp rop, int root, bool async_op, const Fingerprint& fp) = 0;
  virtual std::shared_ptr<Work> run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers,
                                        int tag, const Fingerprint& fp) = 0;
  // A checked batch. The default posts each op with run_p2p: on a transport whose posts never
  // block (Gloo, MPI) they progress together; NCCL and its rules override it.
  virtual std::vector<std::shared_ptr<Work>> run_batch(const std::vector<P2P>& ops,
                                                       const std::vector<Fingerprint>& fps);

  CommInfo info_;

 private:
  void check_buffer(const BufferView& b, const char* what, OpKind op) const;
  void check_reducible(const BufferView& b, OpKind op) const;
  void check_root(int root, OpKind op) const;

  // The checks of a send to / receive from `peers` with `tag`, before anything is posted.
  void check_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag) const;
  // Detail level, CPU memory: the receiver of a message answers with what it passed, and a
  // send completes only on that answer, so both sides of a mismatch fail (MPI lets a short
  // message into a longer receive, and a sender's eager message never learns of it).
  std::shared_ptr<Work> acknowledged(std::shared_ptr<Work> data, const Fingerprint& fp, int peer);
  // The next collective's fingerprint; at the Detail level, verified against every member's.
  Fingerprint agree(OpKind op, const BufferView& buf, int root);
  // A checked collective issued: recorded in the flight recorder, agreed on, counted, run.
  // `same`: what every member passes alike (the fingerprint's and the record's); `counted`: what
  // the traffic counters count; root -1 for an unrooted op.
  std::shared_ptr<Work> issue_collective(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop,
                                         int root, bool async_op, const BufferView& same, const BufferView& counted);
  // Records an op in the flight recorder as issued (before agree, so an op whose members
  // disagree is recorded too); the guard marks it failed unless a Work takes it over (flown).
  FlightOp flight_issue(OpKind op, const BufferView& buf, int root, int peer, int tag);
  std::shared_ptr<Work> flown(FlightOp& rec, std::shared_ptr<Work> work) const {
    if (rec.id()) work->attach_flight(info_.flight, rec.release());
    return work;
  }
  std::atomic<bool> broken_{false};  // set by waiter and worker threads too
  mutable std::mutex why_mutex_;
  std::string broken_why_;  // the failure that broke it, when its thread said
  // Made once: describe(op) names every op's Work, and an ostringstream per op costs more
  // than a small collective's own CPU time; peer_is_intra_ is what count() records against.
  std::vector<std::string> described_;  // describe(op) of each OpKind
  std::vector<bool> peer_is_intra_;     // member k shares this rank's node
  std::uint64_t seq_ = 0;
  std::atomic<std::uint64_t> p2p_seq_{0};  // p2p ops issued here (the flight recorder's sequence)
};

}  // namespace gridweave
