#include "mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <functional>
#include <mutex>
#include <thread>

#include "error.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // OpenMPI's extensions: MPIX_CUDA_AWARE_SUPPORT
#endif

namespace gridweave {

namespace {

using Clock = std::chrono::steady_clock;

// gridweave's MPI calls are serialised (MPI_THREAD_SERIALIZED suffices): async ops are
// tested from the caller's thread and from waiters.
std::recursive_mutex& mpi_mutex() {
  static std::recursive_mutex m;
  return m;
}

bool& initialised_here() {
  static bool b = false;
  return b;
}

void check_mpi(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char s[MPI_MAX_ERROR_STRING];
  int n = 0;
  MPI_Error_string(rc, s, &n);
  throw Error(ErrorKind::Comm, "gridweave: " + what + " failed: " + std::string(s, n));
}

// fp16 and bf16 have no MPI type: two committed 2-byte types tell them apart in the
// user-defined reductions, which do the arithmetic in float (cpp/dtype.h reduce_into).
MPI_Datatype half_type(DType d) {
  static MPI_Datatype f16 = MPI_DATATYPE_NULL, b16 = MPI_DATATYPE_NULL;
  MPI_Datatype& t = d == DType::Float16 ? f16 : b16;
  if (t == MPI_DATATYPE_NULL) {
    check_mpi(MPI_Type_contiguous(2, MPI_BYTE, &t), "MPI_Type_contiguous");
    check_mpi(MPI_Type_commit(&t), "MPI_Type_commit");
  }
  return t;
}

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int32: return MPI_INT32_T;
    case DType::Int64: return MPI_INT64_T;
    case DType::Float16:
    case DType::BFloat16: return half_type(d);
  }
  return MPI_DATATYPE_NULL;
}

template <ReduceOp R>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype* dt) {
  const DType d = *dt == half_type(DType::Float16) ? DType::Float16 : DType::BFloat16;
  reduce_into(inout, in, inout, static_cast<std::size_t>(*len), d, R);
}

MPI_Op mpi_op(ReduceOp op, DType d) {
  if (d != DType::Float16 && d != DType::BFloat16) return op == ReduceOp::Sum ? MPI_SUM : op == ReduceOp::Max ? MPI_MAX : MPI_MIN;
  static MPI_Op ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op& o = ops[static_cast<int>(op)];
  if (o == MPI_OP_NULL) {
    MPI_User_function* f = op == ReduceOp::Sum ? &half_reduce<ReduceOp::Sum>
                           : op == ReduceOp::Max ? &half_reduce<ReduceOp::Max> : &half_reduce<ReduceOp::Min>;
    check_mpi(MPI_Op_create(f, 1, &o), "MPI_Op_create");
  }
  return o;
}

int as_int(std::size_t n, const std::string& what) {
  GW_CHECK(n <= static_cast<std::size_t>(INT_MAX), what << ": " << n << " elements exceed MPI's int count");
  return static_cast<int>(n);
}

// An op's MPI request, tested against the deadline: wait() never blocks in MPI.
class MpiWork : public Work {
 public:
  MpiWork(std::string what, std::function<void(const MPI_Status&)> on_done)
      : Work(std::move(what)), on_done_(std::move(on_done)) {}
  // An unfinished request is left to MPI (a nonblocking collective's request may be
  // neither freed nor cancelled); its buffers belong to the caller, as with every transport.
  MPI_Request* request() { return &request_; }
  bool test() override {
    std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
    if (done_) return true;
    int flag = 0;
    MPI_Status st;
    check_mpi(MPI_Test(&request_, &flag, &st), what_);
    if (!flag) return false;
    done_ = true;
    int cancelled = 0;
    MPI_Test_cancelled(&st, &cancelled);
    if (cancelled) {
      error_ = "gridweave: " + what_ + " cancelled: the grid was shut down";
      return true;
    }
    source_ = st.MPI_SOURCE;
    if (on_done_) {
      try {
        on_done_(st);
      } catch (const std::exception& e) {
        error_ = e.what();
      }
    }
    return true;
  }
  void wait(std::chrono::milliseconds timeout) override {
    const auto start = Clock::now();
    const auto deadline = start + timeout;
    while (!test()) {
      const auto now = Clock::now();
      if (now > deadline)
        throw Error(ErrorKind::Timeout, "gridweave: " + what_ + " timed out after " +
                                            std::to_string(timeout.count() / 1000.0) +
                                            " s: a peer is slow, skipped this op or died");
      // Poll as MPI's own blocking calls do (yielding the core, which matters with more ranks
      // than cores); after 10 ms of waiting, sleep between polls instead.
      if (now - start < std::chrono::milliseconds(10)) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (!error_.empty()) throw Error(ErrorKind::Comm, error_);
  }
  int source() const override { return source_; }
  void cancel() {
    std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
    if (!done_ && request_ != MPI_REQUEST_NULL) MPI_Cancel(&request_);
  }

 private:
  std::function<void(const MPI_Status&)> on_done_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool done_ = false;
  int source_ = -1;
  std::string error_;
};

}  // namespace

std::pair<int, int> mpi_world() {
  std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    initialised_here() = true;
    GW_CHECK(provided >= MPI_THREAD_SERIALIZED,
             "the MPI library offers thread level " << provided << "; gridweave's async ops need "
                                                    "MPI_THREAD_SERIALIZED or better (rebuild MPI with threads)");
  } else {
    int provided = 0;
    MPI_Query_thread(&provided);
    GW_CHECK(provided >= MPI_THREAD_SERIALIZED,
             "MPI was initialised with thread level " << provided << "; gridweave's async ops need "
                                                      "MPI_THREAD_SERIALIZED or better (MPI_Init_thread)");
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return {rank, size};
}

void mpi_finalize() {
  std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
  int ready = 0, done = 0;
  MPI_Initialized(&ready);
  MPI_Finalized(&done);
  if (ready && !done && initialised_here()) MPI_Finalize();
}

bool mpi_cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;  // compiled in, and enabled at run time
#else
  return false;
#endif
}

MpiCommunicator::MpiCommunicator(CommInfo info, int device_index)
    : Communicator(std::move(info)), device_(device_index >= 0 && mpi_cuda_aware() ? Device::CUDA : Device::CPU) {
  mpi_world();
  const std::uint64_t token = std::hash<std::string>{}(info_.session.empty() ? info_.axis : info_.session);
  // Tags 16384..32767 of MPI_COMM_WORLD (MPI guarantees tag_ub >= 32767), one per line.
  const int tag = 16384 + static_cast<int>(token % 16384);
  try {
    handshake(token, tag);
  } catch (const Error& e) {
    throw Error(e.kind(), "gridweave: connecting axis '" + info_.axis + "' (rank " +
                              std::to_string(info_.members[info_.rank]) + ", peers " + join_ranks(info_.members) +
                              ") failed within " + std::to_string(info_.timeout.count() / 1000.0) +
                              " s; a peer skipped this op or died: " + e.what());
  }
  std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
  MPI_Group world_group, line;
  check_mpi(MPI_Comm_group(MPI_COMM_WORLD, &world_group), "MPI_Comm_group");
  check_mpi(MPI_Group_incl(world_group, size(), info_.members.data(), &line), "MPI_Group_incl");
  // Only the line's members call this (lines connect lazily), all of them now (handshake).
  check_mpi(MPI_Comm_create_group(MPI_COMM_WORLD, line, tag, &comm_), "MPI_Comm_create_group on " + info_.axis);
  // A truncated message (members that disagree on a count) is a CommError, not the job's end.
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  MPI_Group_free(&line);
  MPI_Group_free(&world_group);
}

// MPI_Comm_create_group blocks, with no timeout, until every member calls it. So the members
// first meet through non-blocking messages to the line's first member, tested against the
// deadline: one that never comes is a CommTimeout, not a hang. The token names this line of
// this grid (info.session); one left by a failed attempt of another grid is read and dropped
// (a failed attempt of the same name can stand in for its sender once: name grids apart).
void MpiCommunicator::handshake(std::uint64_t token, int tag) {
  if (size() == 1) return;
  const auto deadline = Clock::now() + info_.timeout;
  // A message still in flight at a timeout (and its buffer) must outlive this call.
  static std::mutex orphans_mu;
  static std::vector<std::pair<std::shared_ptr<MpiWork>, std::unique_ptr<std::uint64_t>>> orphans;
  // One token to or from `peer`, waited for like every op (MpiWork::wait) until the deadline.
  auto exchange = [&](bool receive, int peer) {
    auto buf = std::make_unique<std::uint64_t>(token);
    auto work = std::make_shared<MpiWork>("handshake on " + info_.axis, nullptr);
    {
      std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
      if (receive) check_mpi(MPI_Irecv(buf.get(), 1, MPI_UINT64_T, peer, tag, MPI_COMM_WORLD, work->request()), "handshake");
      else check_mpi(MPI_Isend(buf.get(), 1, MPI_UINT64_T, peer, tag, MPI_COMM_WORLD, work->request()), "handshake");
    }
    try {
      work->wait(std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                          std::chrono::milliseconds(0)));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Timeout) throw;
      if (receive) work->cancel();  // a cancelled receive matches nothing later
      std::lock_guard<std::mutex> keep(orphans_mu);
      orphans.emplace_back(work, std::move(buf));
      throw Error(ErrorKind::Timeout, "member " + std::to_string(peer) + " never came");
    }
    return *buf;
  };
  auto receive = [&](int peer) {
    while (exchange(true, peer) != token) {  // a stale token: read and dropped
    }
  };
  const int leader = info_.members[0];
  if (rank() == 0) {
    for (int k = 1; k < size(); ++k) receive(info_.members[k]);
    for (int k = 1; k < size(); ++k) exchange(false, info_.members[k]);
  } else {
    exchange(false, leader);
    receive(leader);
  }
}

MpiCommunicator::~MpiCommunicator() {
  std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
  int done = 0;
  MPI_Finalized(&done);
  if (!done && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::close() {
  Communicator::close();
  std::lock_guard<std::mutex> lock(pending_mu_);
  for (auto& w : pending_)
    if (auto p = w.lock()) static_cast<MpiWork*>(p.get())->cancel();
  pending_.clear();
}

std::shared_ptr<Work> MpiCommunicator::run_collective(OpKind op, const BufferView& in, const BufferView& out,
                                                      ReduceOp rop, int root, bool /*async_op*/,
                                                      const Fingerprint& /*fp*/) {
  const std::string what = describe(op);  // once: it is an ostringstream per call
  auto work = std::make_shared<MpiWork>(what, nullptr);
  std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
  MPI_Request* r = work->request();
  const MPI_Datatype t = mpi_type(op == OpKind::Scatter ? out.dtype : in.dtype);
  switch (op) {
    case OpKind::AllGather:
      check_mpi(MPI_Iallgather(in.ptr, as_int(in.count, what), t, out.ptr, as_int(in.count, what), t, comm_, r), what);
      break;
    case OpKind::ReduceScatter:
      check_mpi(MPI_Ireduce_scatter_block(in.ptr, out.ptr, as_int(out.count, what), t, mpi_op(rop, in.dtype), comm_, r),
                what);
      break;
    case OpKind::AllReduce:
      check_mpi(MPI_Iallreduce(in.ptr == out.ptr ? MPI_IN_PLACE : in.ptr, out.ptr, as_int(out.count, what), t,
                               mpi_op(rop, in.dtype), comm_, r), what);
      break;
    case OpKind::Broadcast:
      check_mpi(MPI_Ibcast(out.ptr, as_int(out.count, what), t, root, comm_, r), what);
      break;
    case OpKind::Reduce:  // in place on the root; the others' buffers stay as they are
      check_mpi(MPI_Ireduce(rank() == root ? MPI_IN_PLACE : in.ptr, rank() == root ? out.ptr : nullptr,
                            as_int(out.count, what), t, mpi_op(rop, in.dtype), root, comm_, r), what);
      break;
    case OpKind::Scatter:
      check_mpi(MPI_Iscatter(rank() == root ? in.ptr : nullptr, as_int(out.count, what), t, out.ptr,
                             as_int(out.count, what), t, root, comm_, r), what);
      break;
    case OpKind::Gather:
      check_mpi(MPI_Igather(in.ptr, as_int(in.count, what), t, rank() == root ? out.ptr : nullptr,
                            as_int(in.count, what), t, root, comm_, r), what);
      break;
    case OpKind::AllToAll: {
      const int chunk = as_int(in.count / size(), what);
      check_mpi(MPI_Ialltoall(in.ptr, chunk, t, out.ptr, chunk, t, comm_, r), what);
      break;
    }
    case OpKind::Barrier:
      check_mpi(MPI_Ibarrier(comm_, r), what);
      break;
    default:
      GW_CHECK(false, what << " is not a collective");
  }
  return work;
}

std::shared_ptr<Work> MpiCommunicator::run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers,
                                               int tag, const Fingerprint& /*fp*/) {
  const std::string what = describe(op, peers.size() == 1 ? peers[0] : -1);
  std::function<void(const MPI_Status&)> on_done;
  if (op == OpKind::Recv) {
    // MPI_ANY_SOURCE takes any member; on a pipeline line only the listed neighbours send
    // with this tag, and a message from anyone else is an error, not a silent mix-up.
    on_done = [this, peers, view = buf, what](const MPI_Status& st) {
      bool listed = false;
      for (int p : peers) listed = listed || p == st.MPI_SOURCE;
      GW_CHECK(listed, what << ": a message came from member " << st.MPI_SOURCE << ", not one of the peers");
      int got = 0;  // MPI takes a shorter message into a longer receive without a word
      MPI_Get_count(&st, mpi_type(view.dtype), &got);
      if (got != static_cast<int>(view.count))
        throw Error(ErrorKind::Comm, "gridweave: ranks disagree on " + what + ": member " +
                                         std::to_string(st.MPI_SOURCE) + " sent " + std::to_string(got) +
                                         " elements, this receive passed " + std::to_string(view.count) + " x " +
                                         dtype_name(view.dtype));
      count(OpKind::Recv, view, st.MPI_SOURCE);
    };
  }
  auto work = std::make_shared<MpiWork>(what, on_done);
  if (op == OpKind::Recv) {  // close() cancels the receives still pending
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](auto& w) { return w.expired(); }),
                   pending_.end());
    pending_.push_back(work);
  }
  std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
  const MPI_Datatype t = mpi_type(buf.dtype);
  const int n = as_int(buf.count, what);
  if (op == OpKind::Send) check_mpi(MPI_Isend(buf.ptr, n, t, peers[0], tag, comm_, work->request()), what);
  else check_mpi(MPI_Irecv(buf.ptr, n, t, peers.size() == 1 ? peers[0] : MPI_ANY_SOURCE, tag, comm_,
                           work->request()), what);
  return work;
}

}  // namespace gridweave
