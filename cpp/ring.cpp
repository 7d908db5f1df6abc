#include "ring.h"

#include "error.h"

namespace gridweave {

bool MultiWork::test() {
  for (auto& p : parts_)
    if (!p->test()) return false;
  return true;
}

void MultiWork::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& p : parts_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    p->wait(std::max(left, std::chrono::milliseconds(1)));
  }
}

void MultiWork::wait_host(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& p : parts_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    p->wait_host(std::max(left, std::chrono::milliseconds(1)));
  }
}

Ring::Ring(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
  GW_CHECK(comm_ != nullptr, "a ring needs a communicator");
}

std::shared_ptr<Work> Ring::exchange(const std::vector<BufferView>& send, const std::vector<BufferView>& recv, int step) {
  GW_CHECK(step >= 0, "ring step must be >= 0, got " << step);
  GW_CHECK(send.size() == recv.size(), "ring exchange: " << send.size() << " blocks sent but " << recv.size()
                                                          << " received");
  std::vector<std::shared_ptr<Work>> parts;
  if (size() == 1) return std::make_shared<MultiWork>("ring exchange", parts);
  // One group per step: each rank's receive waits for its previous rank's send, which under
  // NCCL's rules (a communicator runs its ops in issue order, a send waits for its receive)
  // only progresses when the two are posted together (Li et al.'s ring, TE's context parallelism).
  std::vector<P2P> ops;
  for (std::size_t k = 0; k < send.size(); ++k) {
    GW_CHECK(send[k].nbytes() == recv[k].nbytes(), "ring exchange: block " << k << " sends " << send[k].nbytes()
                                                                           << " bytes but receives " << recv[k].nbytes());
    const int tag = step * 16 + static_cast<int>(k);  // where tags match messages, the blocks of a step stay apart
    ops.push_back(P2P{OpKind::Recv, recv[k], prev(), tag});
    ops.push_back(P2P{OpKind::Send, send[k], next(), tag});
  }
  parts = comm_->batch(ops);
  return std::make_shared<MultiWork>("ring exchange step " + std::to_string(step) + " on axis '" + comm_->info().axis + "'",
                                     parts);
}

}  // namespace gridweave
