#include "mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <functional>
#include <mutex>
#include <thread>

#include <sched.h>

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
    case DType::UInt8: return MPI_UINT8_T;
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

// How a waiting rank polls its requests: as MPI's own blocking calls do (OpenMPI yields only
// when mpirun oversubscribes the node): it spins where every rank of the node has a processor
// of its own, and yields the processor between tests where they share them (a spinning rank
// would hold up the peer it waits for). A rank bound to one processor is taken to have it to
// itself (launchers bind ranks only when each gets its own: mpirun's default up to one rank a
// core); otherwise the node's ranks are compared with the processors this one may run on (a
// cgroup's cpuset, not the machine's). Measured on 2 ranks of 2 cores: a 64 KiB all_gather
// took 6.6 us yielding, 5.8 us spinning (OpenMPI's blocking call 5.0 us).
Poll poll_for(int ranks_on_node) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return Poll::Yield;
  const int processors = CPU_COUNT(&set);
  return processors == 1 || ranks_on_node <= processors ? Poll::Spin : Poll::Yield;
}

// An op's MPI requests, tested against the deadline: wait() never blocks in MPI. An op of
// several rounds (SplitReduction below) has `next`: once every request of a round completes it
// does the round's local work and posts the next round's requests (false: none is left).
class MpiWork : public Work {
 public:
  using Next = std::function<bool(MpiWork&)>;
  MpiWork(std::string what, Poll poll, std::function<void(const MPI_Status&)> on_done, Next next = nullptr)
      : Work(std::move(what)), poll_(poll), on_done_(std::move(on_done)), next_(std::move(next)) {}
  // An unfinished request is left to MPI (a nonblocking collective's request may be
  // neither freed nor cancelled); its buffers belong to the caller, as with every transport.
  MPI_Request* request() { return post(1); }
  // The next round's n requests.
  MPI_Request* post(int n) {
    requests_.assign(n, MPI_REQUEST_NULL);
    statuses_.resize(n);
    return requests_.data();
  }
  bool test() override {
    std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
    if (done_) return true;
    try {
      if (!settle()) return false;
    } catch (...) {  // MPI itself failed (check_mpi): the op ends failed
      flight_ended(false);
      throw;
    }
    flight_ended(error_.empty());  // the flight recorder's end: the first test that saw it
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
      // Poll as MPI's own blocking calls do (Poll); after 10 ms of waiting, sleep between polls.
      if (now - start >= std::chrono::milliseconds(10)) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else if (poll_ == Poll::Yield) std::this_thread::yield();
    }
    if (!error_.empty()) throw Error(ErrorKind::Comm, error_);
  }
  int source() const override { return source_; }
  void cancel() {  // point-to-point requests only (a collective's may not be cancelled)
    std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
    if (done_) return;
    for (MPI_Request& r : requests_)
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
  }

 private:
  // test()'s body, under mpi_mutex(): true once every request (and round) is done, error_ set on
  // a failure.
  bool settle() {
    for (;;) {
      int flag = 0;
      check_mpi(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, statuses_.data()), what_);
      if (!flag) return false;
      if (!next_) break;
      bool more = false;
      try {
        more = next_(*this);
      } catch (const std::exception& e) {
        error_ = e.what();
        done_ = true;
        return true;
      }
      if (!more) break;
    }
    done_ = true;
    if (requests_.size() != 1) return true;
    const MPI_Status& st = statuses_[0];
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
  Poll poll_;
  std::function<void(const MPI_Status&)> on_done_;
  Next next_;
  std::vector<MPI_Request> requests_;
  std::vector<MPI_Status> statuses_;
  bool done_ = false;
  int source_ = -1;
  std::string error_;
};

// MPI advances a nonblocking op only inside MPI calls, and a reduction of several rounds
// (SplitReduction) posts each round from test(): an async op started in the backward
// (overlap_grad_reduce's chunks, ZeRO's buckets) would otherwise move only once waited for,
// after the backward. While any is in flight this thread tests them every kProgressEvery; it
// sleeps otherwise. Its tests take mpi_mutex() like every MPI call (MPI_THREAD_SERIALIZED).
constexpr std::chrono::microseconds kProgressEvery{200};

class Progress {
 public:
  static Progress& get() {
    static Progress p;
    return p;
  }
  void add(const std::shared_ptr<MpiWork>& w) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;  // after mpi_finalize: its waiter drives it
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    works_.push_back(w);
    cv_.notify_one();
  }
  void stop() {  // before MPI_Finalize, and at exit
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      works_.clear();
    }
    cv_.notify_one();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }
  ~Progress() { stop(); }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopped_) {
      if (works_.empty()) {
        cv_.wait(lock, [this] { return stopped_ || !works_.empty(); });
        continue;
      }
      std::vector<std::weak_ptr<MpiWork>> now;
      now.swap(works_);
      lock.unlock();
      std::vector<std::weak_ptr<MpiWork>> left;
      for (auto& w : now) {
        auto p = w.lock();
        if (!p) continue;  // its owner is done with it
        bool done = true;
        try {
          done = p->test();
        } catch (const std::exception&) {
          done = true;  // its waiter's own test() reports the error
        }
        if (!done) left.push_back(w);
      }
      std::this_thread::sleep_for(kProgressEvery);
      lock.lock();
      works_.insert(works_.end(), left.begin(), left.end());
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<MpiWork>> works_;
  std::thread thread_;
  bool stopped_ = false;
};

// From chunks (a member's share) of this many bytes the reductions run on gridweave's
// schedules of point-to-point messages instead of libnbc's nonblocking collectives, which
// reduce the whole buffer along a binomial tree (MPI_Ireduce_scatter_block always;
// MPI_Iallreduce below 4 ranks or in place): log2(p) full-buffer hops against (p-1)/p of it
// each way. Smaller, the tree's rounds of whole messages cost less than more rounds of small
// ones (measured on 2, 4 and 8 ranks: the crossing lies between 16 and 64 KiB chunks).
constexpr std::size_t kSplitChunkBytes = 32 << 10;

// A reduce-scatter of `in` into `out` (chunk i of g, i = this member), and for an all-reduce
// (buf: out is chunk i of buf) then the all-gather of the reduced chunks in place in buf, as
// rounds of point-to-point messages on the line's own communicator; `tag` keeps ops in flight
// at once apart. Each chunk is reduced on one member only, so every member ends with the same
// bits. Both algorithms move (g-1)/g of the buffer each way; halving-doubling needs 2 log2(g)
// rounds, the ring 2 (g-1), and where ranks share cores every round waits for its peers to get
// one (measured on 4 and 8 ranks of 2 cores: the ring up to 1.5x slower; sending every chunk at
// once, 2 rounds in all, slower still: its g-1 messages a round each wait for their peer).

class SplitReduction {
 public:
  SplitReduction(MPI_Comm comm, int tag, int g, int i, DType dtype, ReduceOp rop, std::size_t chunk, const char* in,
                 char* out, char* buf)
      : comm_(comm), tag_(tag), type_(mpi_type(dtype)), dtype_(dtype), rop_(rop), chunk_(chunk) {
    const std::size_t cb = chunk * dtype_size(dtype);
    if ((g & (g - 1)) == 0) halving_doubling(g, i, cb, in, out, buf);
    else ring(g, i, cb, in, out, buf);
  }
  // Reduces what the last round received, then posts the next round; false once all are done.
  bool advance(MpiWork& w) {
    if (next_ > 0)
      for (const Reduction& r : rounds_[next_ - 1].reductions) reduce_into(r.into, r.a, r.b, r.count, dtype_, rop_);
    if (next_ == rounds_.size()) return false;
    const Round& r = rounds_[next_++];
    MPI_Request* req = w.post(static_cast<int>(r.recvs.size() + r.sends.size()));
    for (const auto& [peer, ptr, n] : r.recvs)
      check_mpi(MPI_Irecv(ptr, static_cast<int>(n), type_, peer, tag_, comm_, req++), w.what());
    for (const auto& [peer, ptr, n] : r.sends)
      check_mpi(MPI_Isend(ptr, static_cast<int>(n), type_, peer, tag_, comm_, req++), w.what());
    return true;
  }

 private:
  struct Message {
    int peer;
    char* ptr;
    std::size_t count;
  };
  struct Reduction {  // into = a (op) b, count elements
    char* into;
    const char* a;
    const char* b;
    std::size_t count;
  };
  // A round's messages, all posted at once; its reductions once they all arrived.
  struct Round {
    std::vector<Message> recvs, sends;
    std::vector<Reduction> reductions;
  };

  char* scratch(std::size_t bytes) {
    scratch_.reset(new char[bytes]);  // not zeroed: every byte is received before it is read
    return scratch_.get();
  }
  static char* mut(const char* p) { return const_cast<char*>(p); }  // a send buffer, only read

  // Recursive halving then doubling (Rabenseifner; Thakur, Rabenseifner & Gropp 2005), g a power
  // of two: log2(g) rounds each. Halving: the segment [lo, lo + half) of chunks this member
  // reduces halves each round; it keeps the half on its side of bit `mask` (ending with chunk i)
  // and gets the partner's part of it. Partial sums accumulate in buf (in place) or in a scratch
  // indexed like the input. Doubling: the segment of reduced chunks doubles with the partner's.
  void halving_doubling(int g, int i, std::size_t cb, const char* in, char* out, char* buf) {
    char* tmp = scratch((buf ? 1 : 3) * (g / 2) * cb);  // the received half, then the accumulator
    char* acc = buf ? buf : tmp + (g / 2) * cb;
    const char* src = in;
    int lo = 0, span = g;
    for (int mask = g / 2; mask >= 1; mask /= 2) {
      const int half = span / 2;
      const int keep = (i & mask) ? lo + half : lo, give = (i & mask) ? lo : lo + half;
      const int partner = i ^ mask;
      const std::size_t n = half * chunk_;
      rounds_.push_back(Round{{{partner, tmp, n}}, {{partner, mut(src + give * cb), n}},
                              {{mask == 1 && !buf ? out : acc + keep * cb, src + keep * cb, tmp, n}}});
      src = acc;
      lo = keep;
      span = half;
    }
    if (!buf) return;
    for (int mask = 1; mask < g; mask *= 2) {
      const int partner = i ^ mask, partner_lo = (i & mask) ? lo - mask : lo + mask;
      rounds_.push_back(
          Round{{{partner, buf + partner_lo * cb, mask * chunk_}}, {{partner, buf + lo * cb, mask * chunk_}}, {}});
      lo = std::min(lo, partner_lo);
    }
  }

  // Other g: the ring of traffic.cpp's schedule, g-1 rounds each. Reduce-scatter: at step s
  // member i sends chunk i-s-1 to i+1 and adds chunk i-s-2 from i-1 into a partial sum (two
  // alternate); the last sum lands in out. All-gather: at step s member i sends chunk i-s and
  // receives i-s-1.
  void ring(int g, int i, std::size_t cb, const char* in, char* out, char* buf) {
    char* tmp = scratch(3 * cb);
    char* partial[2] = {tmp + cb, tmp + 2 * cb};
    auto idx = [g](int c) { return ((c % g) + g) % g; };
    const int right = (i + 1) % g, left = (i + g - 1) % g;
    for (int s = 0; s < g - 1; ++s)
      rounds_.push_back(Round{{{left, tmp, chunk_}},
                              {{right, s == 0 ? mut(in + idx(i - 1) * cb) : partial[(s - 1) % 2], chunk_}},
                              {{s == g - 2 ? out : partial[s % 2], in + idx(i - s - 2) * cb, tmp, chunk_}}});
    if (!buf) return;
    for (int s = 0; s < g - 1; ++s)
      rounds_.push_back(
          Round{{{left, buf + idx(i - s - 1) * cb, chunk_}}, {{right, buf + idx(i - s) * cb, chunk_}}, {}});
  }

  MPI_Comm comm_;
  int tag_;
  MPI_Datatype type_;
  DType dtype_;
  ReduceOp rop_;
  std::size_t chunk_;
  std::unique_ptr<char[]> scratch_;
  std::vector<Round> rounds_;
  std::size_t next_ = 0;
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
  Progress::get().stop();
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
    : Communicator(std::move(info)),
      device_(device_index >= 0 && mpi_cuda_aware() ? Device::CUDA : Device::CPU),
      poll_(poll_for(info_.ranks_on_node)) {
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
  // SplitReduction's messages go on a communicator of their own, apart from the caller's
  // point-to-point ones (MPI_Comm_idup, waited for against the deadline like every op).
  auto dup = std::make_shared<MpiWork>("duplicating axis '" + info_.axis + "'", poll_, nullptr);
  {
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
    check_mpi(MPI_Comm_idup(comm_, &p2p_comm_, dup->request()), "MPI_Comm_idup on " + info_.axis);
  }
  dup->wait(info_.timeout);
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
    auto work = std::make_shared<MpiWork>("handshake on " + info_.axis, poll_, nullptr);
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
  if (!done && p2p_comm_ != MPI_COMM_NULL) MPI_Comm_free(&p2p_comm_);
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
                                                      ReduceOp rop, int root, bool async_op, const Fingerprint& fp) {
  auto work = post_collective(op, in, out, rop, root, fp);
  work->flight_started();  // posted: MPI moves it from now on
  if (async_op) Progress::get().add(std::static_pointer_cast<MpiWork>(work));  // moves while the caller computes
  return work;
}

std::shared_ptr<Work> MpiCommunicator::post_collective(OpKind op, const BufferView& in, const BufferView& out,
                                                       ReduceOp rop, int root, const Fingerprint& fp) {
  const std::string what = describe(op);
  // Reductions of large chunks are gridweave's own schedules (kSplitChunkBytes)
  const std::size_t esize = dtype_size(in.dtype);
  if (op == OpKind::ReduceScatter && size() > 1 && out.count * esize >= kSplitChunkBytes)
    return split(in, static_cast<char*>(out.ptr), nullptr, out.count, rop, fp, what);
  if (op == OpKind::AllReduce && size() > 1 && in.count % size() == 0 &&
      in.count / size() * esize >= kSplitChunkBytes) {
    const std::size_t chunk = in.count / size();
    char* buf = static_cast<char*>(out.ptr);
    if (in.ptr != out.ptr) std::memcpy(buf, in.ptr, in.nbytes());
    return split(out, buf + rank() * chunk * esize, buf, chunk, rop, fp, what);
  }
  auto work = std::make_shared<MpiWork>(what, poll_, nullptr);
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

// SplitReduction on the line's point-to-point communicator; the collective's sequence number
// (the same on every member) is the tag.
std::shared_ptr<Work> MpiCommunicator::split(const BufferView& in, char* out, char* buf, std::size_t chunk,
                                             ReduceOp rop, const Fingerprint& fp, const std::string& what) {
  as_int(chunk * size(), what);
  auto op = std::make_shared<SplitReduction>(p2p_comm_, static_cast<int>(fp.seq % 32768),  // MPI's tags reach 32767
                                             size(), rank(), in.dtype, rop, chunk, static_cast<const char*>(in.ptr),
                                             out, buf);
  auto work = std::make_shared<MpiWork>(what, poll_, nullptr, [op](MpiWork& w) { return op->advance(w); });
  std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
  op->advance(*work);  // posts the first round
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
  auto work = std::make_shared<MpiWork>(what, poll_, on_done);
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
  work->flight_started();
  return work;
}

}  // namespace gridweave
