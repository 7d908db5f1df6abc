// The CPU transport: a Gloo context per communicator, collectives on a worker
// thread (so they overlap with compute), point-to-point on unbound buffers.
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>

#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "communicator.h"
#include "store.h"

namespace gloo {
class Context;
}

namespace gridweave {

// One TCP device per process, shared by all its Gloo contexts. `hostname` is the
// address peers connect to ("127.0.0.1" when every rank is on this machine).
std::shared_ptr<gloo::transport::Device> make_gloo_device(const std::string& hostname);

class GlooCommunicator : public Communicator {
 public:
  // Collective over `store` (already prefixed for this group): every member calls it.
  GlooCommunicator(CommInfo info, std::shared_ptr<Store> store, std::shared_ptr<gloo::transport::Device> device);
  ~GlooCommunicator() override;
  Device device() const override { return Device::CPU; }
  const char* backend() const override { return "gloo"; }
  bool can_recv_any() const override { return true; }
  bool matches_fingerprints() const override { return true; }
  void close() override;

 protected:
  std::shared_ptr<Work> run_collective(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop,
                                       int root, bool async_op, const Fingerprint& fp) override;
  std::shared_ptr<Work> run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers, int tag,
                                const Fingerprint& fp) override;

 private:
  void run_on_worker(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop, int root,
                     const Fingerprint& fp);
  // The rings run on unbound buffers so the whole op, not each of its waits, ends within the
  // timeout (Gloo's own collectives time out per wait), and close() aborts them mid-flight.
  void ring_reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp rop, uint32_t tag,
                           std::chrono::steady_clock::time_point deadline);
  void ring_all_reduce(const BufferView& in, const BufferView& out, ReduceOp rop, uint32_t tag,
                       std::chrono::steady_clock::time_point deadline);
  // Registers a buffer whose waits close() aborts.
  void track(const std::shared_ptr<gloo::transport::UnboundBuffer>& ub);
  // A transport error as a CommError (CommTimeout); after a timeout the members compare
  // notes over the store, so a disagreement names what each passed.
  [[noreturn]] void rethrow(const Fingerprint& fp, const std::exception& e, int peer = -1);

  std::shared_ptr<gloo::Context> context_;
  std::shared_ptr<Store> store_;  // the rendezvous store, kept to compare notes after a timeout
  std::unique_ptr<Worker> worker_;
  std::mutex pending_mu_;
  std::vector<std::weak_ptr<gloo::transport::UnboundBuffer>> pending_;  // posted p2p and ring buffers
};

}  // namespace gridweave
