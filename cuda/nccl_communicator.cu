#include "nccl_communicator.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "error.h"
#include "stream.h"
#include "watchdog.h"

namespace gridweave {

namespace {

void check_nccl(ncclResult_t status, const std::string& what) {
  if (status != ncclSuccess && status != ncclInProgress)
    throw Error(ErrorKind::Comm, "gridweave: NCCL error in " + what + ": " + ncclGetErrorString(status));
}

// ncclResult_t in the state machine's terms (cpp/nonblocking.h): ncclInProgress is a call on a
// non-blocking communicator that has not reached its stream yet.
CallStatus call_status(ncclResult_t r) {
  if (r == ncclSuccess) return {CallState::Success, ""};
  if (r == ncclInProgress) return {CallState::InProgress, ""};
  return {CallState::Error, ncclGetErrorString(r)};
}

// Runs `body(check)` between ncclGroupStart and ncclGroupEnd. Calls inside a group only queue
// work, so they are only error-checked (check keeps the first error); ncclGroupEnd is what may
// return ncclInProgress (NCCL hands a non-blocking group to a background thread: src/group.cc,
// ncclGroupEndInternal). The group is always closed: NCCL's group depth is per thread.
template <class Body>
ncclResult_t in_group(Body body) {
  const ncclResult_t start = ncclGroupStart();
  if (start != ncclSuccess) return start;
  ncclResult_t first = ncclSuccess;
  body([&first](ncclResult_t r) {
    if (r != ncclSuccess && r != ncclInProgress && first == ncclSuccess) first = r;
  });
  const ncclResult_t end = ncclGroupEnd();
  return first != ncclSuccess ? first : end;
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::Float16: return ncclFloat16;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Int32: return ncclInt32;
    case DType::Int64: return ncclInt64;
    case DType::UInt8: return ncclUint8;
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
    : Communicator(std::move(info)), device_index_(device_index < 0 ? 0 : device_index),
      calls_(
          "NCCL",
          [this]() -> CallStatus {
            std::lock_guard<std::mutex> lock(abort_mu_);  // close() may abort it meanwhile
            if (!comm_) return {CallState::Error, "the communicator was aborted"};
            ncclResult_t state = ncclInProgress;
            const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
            return call_status(r != ncclSuccess ? r : state);
          },
          [this](const Error& e) {  // as the watchdog does for a watched op: the grid goes down
            mark_broken(e.what());
            if (info_.watchdog) info_.watchdog->abort(e);
            close();
          }) {
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
  // Non-blocking initialisation, polled against the grid's timeout: a member that never comes
  // is a CommTimeout, never a hang (ncclCommInitRank blocks with no timeout).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const std::string what = "ncclCommInitRankConfig for axis '" + info_.axis + "'";
  check_nccl(ncclCommInitRankConfig(&comm_, size(), id, rank(), &config), what);
  const auto deadline = std::chrono::steady_clock::now() + info_.timeout;
  for (ncclResult_t state = ncclInProgress;;) {
    check_nccl(ncclCommGetAsyncError(comm_, &state), what);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      throw Error(ErrorKind::Comm, "gridweave: " + what + " failed: " + ncclGetErrorString(state));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      throw Error(ErrorKind::Timeout, "gridweave: " + what + " (rank " + std::to_string(info_.members[info_.rank]) +
                                          ", peers " + join_ranks(info_.members) + ") timed out after " +
                                          std::to_string(info_.timeout.count() / 1000.0) +
                                          " s: a member never came (it skipped this line or died)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  stream_ = acquire_stream(device_index_);
  check_cuda(cudaMalloc(&scratch_, sizeof(int)), "cudaMalloc");
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_) ncclCommDestroy(comm_);
  if (stream_) release_stream(device_index_, stream_);
  if (scratch_) cudaFree(scratch_);
}

std::string NcclCommunicator::async_error() {
  ncclResult_t state = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return "ncclCommGetAsyncError failed";
  if (state == ncclSuccess || state == ncclInProgress) return "";
  mark_broken();
  return ncclGetErrorString(state);
}

void NcclCommunicator::close() {
  Communicator::close();
  std::lock_guard<std::mutex> lock(abort_mu_);
  if (comm_) ncclCommAbort(comm_);  // unblocks the kernels of a peer that will never come
  comm_ = nullptr;
}

void NcclCommunicator::settle(const std::string& what, ncclResult_t issued, Clock::time_point deadline) {
  calls_.settle(what, call_status(issued), deadline);
}

std::shared_ptr<Work> NcclCommunicator::finish(OpKind op, cudaStream_t caller, Clock::time_point deadline, int peer) {
  auto self = std::weak_ptr<Communicator>(weak_from_this());
  auto poll = [self, this]() -> std::string {
    auto c = self.lock();  // the watchdog may poll after the communicator went
    if (!c) return "";
    std::lock_guard<std::mutex> lock(abort_mu_);
    return comm_ ? async_error() : "";
  };
  auto work = std::make_shared<EventWork>(describe(op, peer), device_index_, stream_, caller, poll, [self] {
    if (auto c = self.lock()) c->close();
  });
  // wait() returns at once (stream-ordered): the watchdog owns the timeout and the errors. An op
  // captured into a CUDA graph is not watched: querying a captured event is illegal, and the
  // graph's replays are the caller's to wait for.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(caller, &capture), "cudaStreamIsCapturing");
  if (info_.watchdog && capture == cudaStreamCaptureStatusNone)
    info_.watchdog->watch(work, deadline, poll);
  return work;
}

std::shared_ptr<Work> NcclCommunicator::run_collective(OpKind op, const BufferView& in, const BufferView& out,
                                                       ReduceOp rop, int root, bool /*async_op*/,
                                                       const Fingerprint& /*fp*/) {
  const auto deadline = Clock::now() + info_.timeout;  // the op's: its settle and its watch
  cudaStream_t caller = static_cast<cudaStream_t>(op == OpKind::Barrier ? nullptr : (in.ptr ? in.stream : out.stream));
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  order_after(stream_, caller);
  const std::string what = describe(op);
  const ncclDataType_t t = nccl_type(in.ptr ? in.dtype : out.dtype);
  ncclResult_t issued = ncclSuccess;
  switch (op) {
    case OpKind::AllGather:
      issued = ncclAllGather(in.ptr, out.ptr, in.count, t, comm_, stream_);
      break;
    case OpKind::ReduceScatter:
      issued = ncclReduceScatter(in.ptr, out.ptr, out.count, t, nccl_op(rop), comm_, stream_);
      break;
    case OpKind::AllReduce:
      issued = ncclAllReduce(in.ptr, out.ptr, in.count, t, nccl_op(rop), comm_, stream_);
      break;
    case OpKind::Broadcast:
      issued = ncclBroadcast(in.ptr, out.ptr, in.count, t, root, comm_, stream_);
      break;
    case OpKind::Reduce:
      issued = ncclReduce(in.ptr, out.ptr, in.count, t, nccl_op(rop), root, comm_, stream_);
      break;
    case OpKind::Gather:  // direct: every member sends to root (grouped p2p)
      issued = in_group([&](auto check) {
        if (rank() == root)
          for (int p = 0; p < size(); ++p) check(ncclRecv(at(out, p * in.count), in.count, t, p, comm_, stream_));
        check(ncclSend(in.ptr, in.count, t, root, comm_, stream_));
      });
      break;
    case OpKind::Scatter:
      issued = in_group([&](auto check) {
        if (rank() == root)
          for (int p = 0; p < size(); ++p) check(ncclSend(at(in, p * out.count), out.count, t, p, comm_, stream_));
        check(ncclRecv(out.ptr, out.count, t, root, comm_, stream_));
      });
      break;
    case OpKind::AllToAll: {
      const std::size_t chunk = in.count / size();
      issued = in_group([&](auto check) {
        for (int p = 0; p < size(); ++p) {
          check(ncclSend(at(in, p * chunk), chunk, t, p, comm_, stream_));
          check(ncclRecv(at(out, p * chunk), chunk, t, p, comm_, stream_));
        }
      });
      break;
    }
    case OpKind::Barrier:
      issued = ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_);
      break;
    default:
      GW_CHECK(false, what << " is not a collective");
  }
  settle(what, issued, deadline);  // before the event is recorded: the kernel must be on stream_
  return finish(op, caller, deadline);
}

std::shared_ptr<Work> NcclCommunicator::run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers,
                                                int tag, const Fingerprint& fp) {
  P2P p;
  p.op = op;
  p.buf = buf;
  p.peer = peers.front();  // check_p2p refused several peers: NCCL has no receive-from-any
  p.tag = tag;
  return run_batch({p}, {fp}).front();
}

std::vector<std::shared_ptr<Work>> NcclCommunicator::run_batch(const std::vector<P2P>& ops,
                                                               const std::vector<Fingerprint>& /*fps*/) {
  if (ops.empty()) return {};
  const auto deadline = Clock::now() + info_.timeout;
  // NCCL matches a pair's messages in issue order; tags are not sent (matches_tags() is false)
  cudaStream_t caller = static_cast<cudaStream_t>(ops.front().buf.stream);
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  order_after(stream_, caller);
  for (const P2P& o : ops)  // every buffer of the group is ordered after its producer
    if (o.buf.stream != ops.front().buf.stream) order_after(stream_, static_cast<cudaStream_t>(o.buf.stream));
  const std::string what = ops.size() > 1 ? "group of " + std::to_string(ops.size()) + " p2p ops on axis '" +
                                                info_.axis + "'"
                                          : describe(ops.front().op, ops.front().peer);
  const ncclResult_t issued = in_group([&](auto check) {
    for (const P2P& o : ops) {
      const ncclDataType_t t = nccl_type(o.buf.dtype);
      if (o.op == OpKind::Send) check(ncclSend(o.buf.ptr, o.buf.count, t, o.peer, comm_, stream_));
      else check(ncclRecv(o.buf.ptr, o.buf.count, t, o.peer, comm_, stream_));
    }
  });
  settle(what, issued, deadline);
  std::vector<std::shared_ptr<Work>> works;
  for (const P2P& o : ops) {
    if (o.op == OpKind::Recv) count(OpKind::Recv, o.buf, o.peer);
    works.push_back(finish(o.op, caller, deadline, o.peer));
  }
  return works;
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
  run_collective(OpKind::AllGather, in, out, ReduceOp::Sum, 0, false, mine.exchange())->wait_host(info_.timeout);
  check_cuda(cudaMemcpy(host.data() + kFields, out.ptr, sizeof(std::int64_t) * out.count, cudaMemcpyDeviceToHost),
             "cudaMemcpy");
  std::vector<Fingerprint> all(size());
  for (int k = 0; k < size(); ++k) all[k] = Fingerprint::from_fields(host.data() + kFields * (k + 1));
  return all;
}

}  // namespace gridweave
