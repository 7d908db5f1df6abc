// The ring schedule of sequence parallelism (Li et al. §3.1) on one axis: neighbours,
// which block a rank holds at each step, and a double-buffered exchange (send this
// step's blocks to the next rank while receiving the next step's from the previous
// one, overlapped with the caller's compute on this step's blocks).
#pragma once
#include <memory>
#include <vector>

#include "communicator.h"

namespace gridweave {

// Done when all of its parts are.
class MultiWork : public Work {
 public:
  MultiWork(std::string what, std::vector<std::shared_ptr<Work>> parts) : Work(std::move(what)), parts_(std::move(parts)) {}
  bool test() override;
  void wait(std::chrono::milliseconds timeout) override;
  void wait_host(std::chrono::milliseconds timeout) override;
  int source() const override { return -1; }

 private:
  std::vector<std::shared_ptr<Work>> parts_;
};

class Ring {
 public:
  explicit Ring(std::shared_ptr<Communicator> comm);
  int size() const { return comm_->size(); }
  int rank() const { return comm_->rank(); }
  int next() const { return (rank() + 1) % size(); }
  int prev() const { return (rank() + size() - 1) % size(); }
  // The rank whose block this rank holds after `step` exchanges: (rank - step) mod N.
  int source_at(int step) const { return ((rank() - step) % size() + size()) % size(); }
  // Posts the step's exchange: each `send[k]` goes to next(), each `recv[k]` comes from
  // prev(); returns at once. Tags keep the blocks of one step apart.
  std::shared_ptr<Work> exchange(const std::vector<BufferView>& send, const std::vector<BufferView>& recv, int step);

 private:
  std::shared_ptr<Communicator> comm_;
};

}  // namespace gridweave
