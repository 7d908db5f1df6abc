// The GPU transport: one NCCL communicator per grid line, ops on the engine's
// stream, ordered against the caller's stream with events.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include "communicator.h"
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

 protected:
  std::shared_ptr<Work> run_collective(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop,
                                       int root, bool async_op, const Fingerprint& fp) override;
  std::shared_ptr<Work> run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag,
                                const Fingerprint& fp) override;
  // Detail level: the fingerprints travel through device memory (NCCL reads no host buffers).
  std::vector<Fingerprint> exchange_fingerprints(const Fingerprint& mine) override;

 private:
  std::shared_ptr<Work> finish(OpKind op, cudaStream_t caller, int peer = -1, cudaStream_t on = nullptr);
  std::string async_error();
  cudaStream_t peer_stream(int peer, bool send);
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaStream_t> peer_streams_;  // p2p: a receive stream and a send stream per peer,
                                            // so no p2p op ever queues behind another peer's
                                            // or behind the opposite direction's
  int device_index_ = 0;
  void* scratch_ = nullptr;  // one int for the barrier
};

}  // namespace gridweave
