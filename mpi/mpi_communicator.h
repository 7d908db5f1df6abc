// The MPI transport (CPU clusters, and shared memory on one host): a communicator per grid
// line made with MPI_Comm_create_group (collective over the line's members only, so lines
// connect lazily like the other transports), every op a non-blocking MPI call whose
// request is tested against the deadline (no MPI call may block forever); reductions of
// chunks of 32 KiB a member and more as gridweave's schedules of point-to-point messages;
// receive-from-any by MPI_ANY_SOURCE (AxoNN's), fp16 / bf16 reductions by user-defined MPI ops.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "communicator.h"

namespace gridweave {

// MPI_Init_thread unless someone (mpi4py, a host application) already initialised MPI;
// needs MPI_THREAD_SERIALIZED or better (gridweave serialises its MPI calls). Returns the
// world's (rank, size). Safe to call again.
std::pair<int, int> mpi_world();
// MPI_Finalize if gridweave initialised MPI (and nobody finalised it).
void mpi_finalize();

// How a waiting op polls MPI: spinning, or yielding the processor between tests (poll_for).
enum class Poll { Spin, Yield };

class MpiCommunicator : public Communicator {
 public:
  // Collective over info.members (world ranks): each line of an axis at once.
  // device_index >= 0: the grid computes on that GPU; a CUDA-aware MPI then reads its buffers
  // directly, any other MPI carries host memory (the Python layer stages CUDA tensors).
  MpiCommunicator(CommInfo info, int device_index);
  ~MpiCommunicator() override;
  Device device() const override { return device_; }
  const char* backend() const override { return "mpi"; }
  bool can_recv_any() const override { return true; }
  // MPI's default error handler ends the job: mpirun stops every rank when one dies.
  bool survives_peer_failure() const override { return false; }
  void close() override;

 protected:
  std::shared_ptr<Work> run_collective(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop,
                                       int root, bool async_op, const Fingerprint& fp) override;
  std::shared_ptr<Work> run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag,
                                const Fingerprint& fp) override;

 private:
  void handshake(std::uint64_t token, int tag);
  std::shared_ptr<Work> post_collective(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop,
                                        int root, const Fingerprint& fp);
  std::shared_ptr<Work> split(const BufferView& in, char* out, char* buf, std::size_t chunk, ReduceOp rop,
                              const Fingerprint& fp, const std::string& what);
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm p2p_comm_ = MPI_COMM_NULL;  // SplitReduction's messages
  Device device_ = Device::CPU;
  Poll poll_;  // how its ops' waits poll (mpi_communicator.cpp)
  std::mutex pending_mu_;
  std::vector<std::weak_ptr<Work>> pending_;  // posted receives, cancelled by close()
};

}  // namespace gridweave
