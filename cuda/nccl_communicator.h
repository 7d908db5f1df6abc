// The GPU transport: one NCCL communicator per grid line, ops on the engine's
// stream, ordered against the caller's stream with events.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <mutex>

#include "communicator.h"
#include "nonblocking.h"
#include "store.h"

namespace gridweave {

class NcclCommunicator : public Communicator {
 public:
  // Collective over `store` (prefixed for this line): member 0 publishes the unique id.
  NcclCommunicator(CommInfo info, std::shared_ptr<Store> store, int device_index);
  ~NcclCommunicator() override;
  Device device() const override { return Device::CUDA; }
  const char* backend() const override { return "nccl"; }
  bool can_recv_any() const override { return false; }
  bool stream_ordered() const override { return true; }
  bool matches_tags() const override { return false; }  // a pair's messages match in issue order
  // Aborts the NCCL communicator (its kernels stop waiting on peers), so nothing after can
  // hang, ncclCommDestroy included.
  void close() override;
  // Polls that found a call still in progress (ncclInProgress) so far, for tests and logs.
  std::uint64_t in_progress_polls() const { return calls_.in_progress_polls(); }

 protected:
  std::shared_ptr<Work> run_collective(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop,
                                       int root, bool async_op, const Fingerprint& fp) override;
  std::shared_ptr<Work> run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag,
                                const Fingerprint& fp) override;
  // One ncclGroupStart / ncclGroupEnd: the ops progress together.
  std::vector<std::shared_ptr<Work>> run_batch(const std::vector<P2P>& ops,
                                               const std::vector<Fingerprint>& fps) override;
  // Detail level: the fingerprints travel through device memory (NCCL reads no host buffers).
  std::vector<Fingerprint> exchange_fingerprints(const Fingerprint& mine) override;

 private:
  using Clock = std::chrono::steady_clock;
  // The communicator is non-blocking (its init is bounded by the grid's timeout): every call
  // on it settles (polls ncclCommGetAsyncError until ncclSuccess) before an event is recorded
  // after it or anything else is called on it; an error or the deadline aborts the grid.
  void settle(const std::string& what, ncclResult_t issued, Clock::time_point deadline);
  // Records the op's completion event (after settle) and hands it to the watchdog.
  std::shared_ptr<Work> finish(OpKind op, cudaStream_t caller, Clock::time_point deadline, int peer = -1);
  std::string async_error();
  ncclComm_t comm_ = nullptr;
  // One stream: NCCL runs a communicator's kernels in issue order whatever stream they are on
  // (a p2p op on a stream of its own never overtook anything); pipeline stages that must not
  // queue behind each other's messages talk over links (Grid::link), a communicator each.
  cudaStream_t stream_ = nullptr;
  int device_index_ = 0;
  std::mutex abort_mu_;  // close() (any thread: the watchdog's) against the watchdog's polls
  void* scratch_ = nullptr;  // one int for the barrier
  NonBlockingCalls calls_;
};

}  // namespace gridweave
