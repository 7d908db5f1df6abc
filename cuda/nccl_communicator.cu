#include "nccl_communicator.h"

#include <cstring>

#include "error.h"
#include "stream.h"

namespace gridweave {

namespace {

void check_nccl(ncclResult_t status, const std::string& what) {
  if (status != ncclSuccess && status != ncclInProgress)
    throw Error(ErrorKind::Comm, "gridweave: NCCL error in " + what + ": " + ncclGetErrorString(status));
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::Float16: return ncclFloat16;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Int32: return ncclInt32;
    case DType::Int64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

char* at(const BufferView& b, std::size_t elements) {
  return static_cast<char*>(b.ptr) + elements * dtype_size(b.dtype);
}

}  // namespace

NcclCommunicator::NcclCommunicator(CommInfo info, std::shared_ptr<Store> store, int device_index)
    : Communicator(std::move(info)), device_index_(device_index < 0 ? 0 : device_index) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw Error(ErrorKind::Config, "gridweave: backend 'nccl' needs a CUDA GPU, and this process sees none");
  GW_CHECK(device_index_ < devices, "CUDA device " << device_index_ << " requested, " << devices << " visible");
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  ncclUniqueId id;
  if (rank() == 0) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    store->set("nccl_id", std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
  } else {
    auto bytes = store->get("nccl_id", info_.timeout);
    GW_CHECK(bytes.size() == sizeof(id.internal), "malformed NCCL unique id in the store");
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }
  check_nccl(ncclCommInitRank(&comm_, size(), id, rank()), "ncclCommInitRank for axis '" + info_.axis + "'");
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaMalloc(&scratch_, sizeof(int)), "cudaMalloc");
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_) ncclCommDestroy(comm_);
  if (stream_) cudaStreamDestroy(stream_);
  for (cudaStream_t ps : peer_streams_)
    if (ps) cudaStreamDestroy(ps);
  if (scratch_) cudaFree(scratch_);
}

std::string NcclCommunicator::async_error() {
  ncclResult_t state = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return "ncclCommGetAsyncError failed";
  if (state == ncclSuccess || state == ncclInProgress) return "";
  mark_broken();
  return ncclGetErrorString(state);
}

cudaStream_t NcclCommunicator::peer_stream(int peer, bool send) {
  // Sends and receives of one peer on separate streams: a receive never waits behind a send
  // to the same peer, nor a send behind a receive (each side's send needs the other's receive).
  if (peer_streams_.empty()) peer_streams_.assign(2 * size(), nullptr);
  cudaStream_t& st = peer_streams_[2 * peer + (send ? 1 : 0)];
  if (!st) check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  return st;
}

std::shared_ptr<Work> NcclCommunicator::finish(OpKind op, cudaStream_t caller, int peer, cudaStream_t on) {
  return std::make_shared<EventWork>(
      describe(op, peer), on ? on : stream_, caller, [this] { return async_error(); },
      [this] {
        mark_broken();
        ncclCommAbort(comm_);  // unblocks the kernels of a peer that will never come
        comm_ = nullptr;
      });
}

std::shared_ptr<Work> NcclCommunicator::run_collective(OpKind op, const BufferView& in, const BufferView& out,
                                                       ReduceOp rop, int root, bool /*async_op*/,
                                                       const Fingerprint& /*fp*/) {
  cudaStream_t caller = static_cast<cudaStream_t>(op == OpKind::Barrier ? nullptr : (in.ptr ? in.stream : out.stream));
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  order_after(stream_, caller);
  const std::string what = describe(op);
  const ncclDataType_t t = nccl_type(in.ptr ? in.dtype : out.dtype);
  switch (op) {
    case OpKind::AllGather:
      check_nccl(ncclAllGather(in.ptr, out.ptr, in.count, t, comm_, stream_), what);
      break;
    case OpKind::ReduceScatter:
      check_nccl(ncclReduceScatter(in.ptr, out.ptr, out.count, t, nccl_op(rop), comm_, stream_), what);
      break;
    case OpKind::AllReduce:
      check_nccl(ncclAllReduce(in.ptr, out.ptr, in.count, t, nccl_op(rop), comm_, stream_), what);
      break;
    case OpKind::Broadcast:
      check_nccl(ncclBroadcast(in.ptr, out.ptr, in.count, t, root, comm_, stream_), what);
      break;
    case OpKind::Reduce:
      check_nccl(ncclReduce(in.ptr, out.ptr, in.count, t, nccl_op(rop), root, comm_, stream_), what);
      break;
    case OpKind::Gather:  // direct: every member sends to root (grouped p2p)
      check_nccl(ncclGroupStart(), what);
      if (rank() == root)
        for (int p = 0; p < size(); ++p) check_nccl(ncclRecv(at(out, p * in.count), in.count, t, p, comm_, stream_), what);
      check_nccl(ncclSend(in.ptr, in.count, t, root, comm_, stream_), what);
      check_nccl(ncclGroupEnd(), what);
      break;
    case OpKind::Scatter:
      check_nccl(ncclGroupStart(), what);
      if (rank() == root)
        for (int p = 0; p < size(); ++p) check_nccl(ncclSend(at(in, p * out.count), out.count, t, p, comm_, stream_), what);
      check_nccl(ncclRecv(out.ptr, out.count, t, root, comm_, stream_), what);
      check_nccl(ncclGroupEnd(), what);
      break;
    case OpKind::AllToAll: {
      const std::size_t chunk = in.count / size();
      check_nccl(ncclGroupStart(), what);
      for (int p = 0; p < size(); ++p) {
        check_nccl(ncclSend(at(in, p * chunk), chunk, t, p, comm_, stream_), what);
        check_nccl(ncclRecv(at(out, p * chunk), chunk, t, p, comm_, stream_), what);
      }
      check_nccl(ncclGroupEnd(), what);
      break;
    }
    case OpKind::Barrier:
      check_nccl(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_), what);
      break;
    default:
      GW_CHECK(false, what << " is not a collective");
  }
  return finish(op, caller);
}

std::shared_ptr<Work> NcclCommunicator::run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers,
                                                int tag, const Fingerprint& /*fp*/) {
  (void)tag;  // NCCL matches p2p by order between a pair, not by tag
  GW_CHECK(peers.size() == 1, describe(op) << ": NCCL has no receive-from-any; post one receive per peer and "
                                             "poll them (the message-driven pipeline does)");
  cudaStream_t caller = static_cast<cudaStream_t>(buf.stream);
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  cudaStream_t on = peer_stream(peers[0], op == OpKind::Send);
  order_after(on, caller);
  const std::string what = describe(op, peers[0]);
  if (op == OpKind::Send) check_nccl(ncclSend(buf.ptr, buf.count, nccl_type(buf.dtype), peers[0], comm_, on), what);
  else check_nccl(ncclRecv(buf.ptr, buf.count, nccl_type(buf.dtype), peers[0], comm_, on), what);
  if (op == OpKind::Recv) count(OpKind::Recv, buf, peers[0]);
  return finish(op, caller, peers[0], on);
}

}  // namespace gridweave

namespace gridweave {

std::vector<Fingerprint> NcclCommunicator::exchange_fingerprints(const Fingerprint& mine) {
  constexpr std::size_t kFields = Fingerprint::kFields;
  std::vector<std::int64_t> host(kFields * (size() + 1));  // [mine | everyone's]
  mine.to_fields(host.data());
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  void* dev = nullptr;  // a debug-level cost, so allocated per call
  check_cuda(cudaMalloc(&dev, sizeof(std::int64_t) * host.size()), "cudaMalloc");
  struct Free {
    void* p;
    ~Free() { cudaFree(p); }
  } free_dev{dev};
  check_cuda(cudaMemcpy(dev, host.data(), sizeof(std::int64_t) * kFields, cudaMemcpyHostToDevice), "cudaMemcpy");
  BufferView in, out;
  in.ptr = dev;
  in.count = kFields;
  out.ptr = static_cast<std::int64_t*>(dev) + kFields;
  out.count = kFields * size();
  in.dtype = out.dtype = DType::Int64;
  in.device = out.device = Device::CUDA;
  in.device_index = out.device_index = device_index_;
  run_collective(OpKind::AllGather, in, out, ReduceOp::Sum, 0, false, mine.exchange())->wait(info_.timeout);
  check_cuda(cudaMemcpy(host.data() + kFields, out.ptr, sizeof(std::int64_t) * out.count, cudaMemcpyDeviceToHost),
             "cudaMemcpy");
  std::vector<Fingerprint> all(size());
  for (int k = 0; k < size(); ++k) all[k] = Fingerprint::from_fields(host.data() + kFields * (k + 1));
  return all;
}

}  // namespace gridweave
