// NCCL's rules on a host transport (gw.init(emulate="nccl")): the bytes travel on an inner
// Gloo or MPI communicator, and what NCCL would do with them is enforced here, so code that
// would hang on GPUs hangs (times out, naming the op) in CPU CI instead:
//  - a communicator runs its ops, collective or point-to-point, one at a time in issue order
//    (NCCL's kernels of one communicator run one after another, whatever stream they were
//    issued on);
//  - a send completes only once its receive runs on the peer (rendezvous); a send of at most
//    eager_bytes completes at once, as NCCL's buffered sends (NCCL_BUFFSIZE);
//  - a pair's messages are matched in issue order, never by tag or from any peer; a tag that
//    disagrees with that order is a CommError (the code relied on tags NCCL ignores);
//  - the point-to-point ops of one batch (an NCCL group) progress together;
//  - an op is issued as on NCCL's non-blocking communicators (cpp/nonblocking.h): the call is
//    "in progress" until its launch is handed over (here: the worker took it, or it is queued
//    behind an op still running), and the issuing thread polls until then.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "communicator.h"
#include "error.h"
#include "nonblocking.h"
#include "work.h"

namespace gridweave {

class NcclRulesCommunicator : public Communicator {
 public:
  // `inner` carries the bytes: a host communicator over the same members, made without
  // counters (this one counts) and at the Cheap check level (this one checks).
  NcclRulesCommunicator(CommInfo info, std::shared_ptr<Communicator> inner, std::size_t eager_bytes);
  ~NcclRulesCommunicator() override;
  Device device() const override { return Device::CPU; }
  const char* backend() const override { return "nccl rules"; }
  bool can_recv_any() const override { return false; }
  bool survives_peer_failure() const override { return inner_->survives_peer_failure(); }
  bool matches_tags() const override { return false; }
  void close() override;
  // Polls that found an op still "in progress" (not yet taken by the worker), for tests.
  std::uint64_t in_progress_polls() const { return calls_.in_progress_polls(); }

  // One op the communicator runs: a collective, or a group of point-to-point ops.
  struct Item {
    OpKind op = OpKind::Barrier;
    BufferView in, out;
    ReduceOp rop = ReduceOp::Sum;
    int root = -1;  // collectives: the root; p2p: the peer
    int tag = 0;
    std::uint64_t order = 0;  // p2p: this pair's n-th message in this direction
    // What the user holds, kept by the item until the worker has run it: its flight recorder's
    // stamps (handed to the recorder once the issuing code attached the entry) are not lost
    // when the caller drops its Work before the op runs.
    std::shared_ptr<Work> flight;
  };

 protected:
  std::shared_ptr<Work> run_collective(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop,
                                       int root, bool async_op, const Fingerprint& fp) override;
  std::shared_ptr<Work> run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag,
                                const Fingerprint& fp) override;
  std::vector<std::shared_ptr<Work>> run_batch(const std::vector<P2P>& ops,
                                               const std::vector<Fingerprint>& fps) override;

 private:
  struct Eager;  // a buffered send still on its way
  // Queues `items` as one op; each gets a Work that completes when the op has run.
  std::vector<std::shared_ptr<Work>> enqueue(std::vector<Item> items, const std::string& what);
  void run_group(const std::vector<Item>& items);
  void run_group(const std::vector<Item>& items, std::vector<std::vector<std::int64_t>>& cts,
                 std::vector<std::shared_ptr<Work>>& posted, std::vector<std::shared_ptr<Work>>& ready,
                 std::vector<std::unique_ptr<Eager>>& buffered);
  void run_one_collective(const Item& item);
  void check_expected(const Item& it, const std::vector<std::int64_t>& want);
  void reap(bool all);  // buffered sends whose receive has run
  void drop_eager();    // after close(): buffered sends end, then their copies go
  std::string running() const;

  std::shared_ptr<Communicator> inner_;
  std::size_t eager_bytes_;
  std::vector<std::uint64_t> sent_, received_;  // per peer: messages issued to it, from it
  std::uint64_t issued_ops_ = 0;
  std::atomic<std::uint64_t> taken_{0}, finished_{0};  // ops the worker started, ended (FIFO)
  NonBlockingCalls calls_;  // the issue step's poll: see enqueue()
  mutable std::mutex mu_;
  std::string running_;  // the op the communicator is running now, for timeout messages
  ErrorKind abort_kind_ = ErrorKind::Comm;  // the first failure of a run op, which queued ops repeat
  std::string abort_what_;
  std::deque<std::unique_ptr<Eager>> eager_;  // the worker's only
  std::unique_ptr<Worker> worker_;
};

}  // namespace gridweave
