#include "communicator.h"

#include <sstream>

#include "error.h"

namespace gridweave {

Communicator::Communicator(CommInfo info) : info_(std::move(info)) {
  GW_CHECK(!info_.members.empty(), "communicator for axis '" << info_.axis << "' has no members");
  GW_CHECK(info_.rank >= 0 && info_.rank < size(),
           "rank " << info_.rank << " is not a member of the " << size() << "-rank communicator '" << info_.axis << "'");
  if (info_.member_nodes.empty()) info_.member_nodes.assign(info_.members.size(), 0);
  GW_CHECK(info_.member_nodes.size() == info_.members.size(), "member_nodes must list one node per member");
}

std::string Communicator::describe(OpKind op, int peer) const {
  std::ostringstream os;
  os << op_name(op) << " on axis '" << info_.axis << "' (rank " << info_.members[info_.rank] << ", peers ";
  if (peer >= 0) os << "[" << info_.members.at(peer) << "]";
  else os << join_ranks(info_.members);
  os << ")";
  return os.str();
}

void Communicator::check_usable(OpKind op) const {
  if (broken_)
    throw Error(ErrorKind::Comm, "gridweave: " + describe(op) +
                                     " refused: this communicator failed earlier (a peer died, timed out or skipped "
                                     "a collective); build a new grid");
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
  std::vector<bool> intra(info_.members.size());
  for (std::size_t k = 0; k < intra.size(); ++k) intra[k] = info_.member_nodes[k] == info_.member_nodes[info_.rank];
  info_.counters->record(info_.axis, schedule(op, size(), rank(), buf.nbytes(), root, static_cast<int>(dtype_size(buf.dtype))), intra);
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
  count(op, in, 0);
  return run_collective(op, in, out, ReduceOp::Sum, 0, async_op);
}

std::shared_ptr<Work> Communicator::reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp rop, bool async_op) {
  const OpKind op = OpKind::ReduceScatter;
  check_usable(op);
  check_buffer(in, "input", op);
  check_buffer(out, "output", op);
  GW_CHECK(in.dtype == out.dtype, describe(op) << ": input is " << dtype_name(in.dtype) << ", output "
                                               << dtype_name(out.dtype));
  GW_CHECK(in.count == out.count * size(), describe(op) << ": input holds " << in.count << " elements, must be "
                                                        << size() << " x output (" << out.count << ")");
  count(op, in, 0);
  return run_collective(op, in, out, rop, 0, async_op);
}

std::shared_ptr<Work> Communicator::all_reduce(const BufferView& buf, ReduceOp rop, bool async_op) {
  const OpKind op = OpKind::AllReduce;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  count(op, buf, 0);
  return run_collective(op, buf, buf, rop, 0, async_op);
}

std::shared_ptr<Work> Communicator::broadcast(const BufferView& buf, int root, bool async_op) {
  const OpKind op = OpKind::Broadcast;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  check_root(root, op);
  count(op, buf, root);
  return run_collective(op, buf, buf, ReduceOp::Sum, root, async_op);
}

std::shared_ptr<Work> Communicator::reduce(const BufferView& buf, ReduceOp rop, int root, bool async_op) {
  const OpKind op = OpKind::Reduce;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  check_root(root, op);
  count(op, buf, root);
  return run_collective(op, buf, buf, rop, root, async_op);
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
  count(op, out, root);
  return run_collective(op, in, out, ReduceOp::Sum, root, async_op);
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
  count(op, in, root);
  return run_collective(op, in, out, ReduceOp::Sum, root, async_op);
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
  count(op, in, 0);
  return run_collective(op, in, out, ReduceOp::Sum, 0, async_op);
}

std::shared_ptr<Work> Communicator::send(const BufferView& buf, int peer, int tag) {
  const OpKind op = OpKind::Send;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  check_root(peer, op);
  GW_CHECK(peer != rank(), describe(op, peer) << ": cannot send to itself");
  GW_CHECK(tag >= 0, describe(op, peer) << ": tag must be >= 0");
  count(op, buf, peer);
  return run_p2p(op, buf, {peer}, tag);
}

std::shared_ptr<Work> Communicator::recv(const BufferView& buf, int peer, int tag) {
  return recv_any(buf, {peer}, tag);
}

std::shared_ptr<Work> Communicator::recv_any(const BufferView& buf, const std::vector<int>& peers, int tag) {
  const OpKind op = OpKind::Recv;
  check_usable(op);
  check_buffer(buf, "buffer", op);
  GW_CHECK(!peers.empty(), describe(op) << ": no peers to receive from");
  for (int p : peers) {
    check_root(p, op);
    GW_CHECK(p != rank(), describe(op, p) << ": cannot receive from itself");
  }
  GW_CHECK(tag >= 0, describe(op) << ": tag must be >= 0");
  // Counted on completion, when the sender is known (see the transports).
  return run_p2p(op, buf, peers, tag);
}

std::shared_ptr<Work> Communicator::barrier(bool async_op) {
  check_usable(OpKind::Barrier);
  BufferView none;
  none.device = device();
  return run_collective(OpKind::Barrier, none, none, ReduceOp::Sum, 0, async_op);
}

}  // namespace gridweave
