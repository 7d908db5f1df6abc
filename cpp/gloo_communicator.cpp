#include "gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "error.h"

namespace gridweave {

namespace {

constexpr uint8_t kP2PSlotPrefix = 0x40;
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;
constexpr uint8_t kAllReduceSlotPrefix = 0x42;

// Elements [first, first + size) of chunk c when `count` elements are cut into n chunks, the
// first count % n one element larger (traffic.cpp's chunk_bytes).
std::pair<std::size_t, std::size_t> ring_chunk(std::size_t count, int n, int c) {
  const std::size_t base = count / n, extra = count % n, k = static_cast<std::size_t>(c);
  return {k * base + std::min(k, extra), base + (k < extra ? 1 : 0)};
}

// A wait's share of the op's deadline (at least 1 ms, so an expired deadline still polls once).
std::chrono::milliseconds time_left(std::chrono::steady_clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return std::max(ms, std::chrono::milliseconds(1));
}

// An unbound buffer's wait within the op's deadline; false: close() aborted it.
void wait_or_abort(gloo::transport::UnboundBuffer& ub, bool recv, std::chrono::steady_clock::time_point deadline) {
  const bool done = recv ? ub.waitRecv(time_left(deadline)) : ub.waitSend(time_left(deadline));
  if (!done) throw std::runtime_error("aborted: the communicator was closed (the grid shut down)");
}

// Gloo's typed option setters only use sizeof(T); reductions go through our own
// dtype-aware function, so any type of the right width will do.
template <typename F>
void with_width(DType dtype, F&& f) {
  switch (dtype_size(dtype)) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
  }
  GW_CHECK(false, "unsupported element width for " << dtype_name(dtype));
}

template <typename T>
T* as(const BufferView& b) {
  return static_cast<T*>(b.ptr);
}

}  // namespace

std::shared_ptr<gloo::transport::Device> make_gloo_device(const std::string& hostname) {
  gloo::transport::tcp::attr attr;
  attr.hostname = hostname;
  return gloo::transport::tcp::CreateDevice(attr);
}

GlooCommunicator::GlooCommunicator(CommInfo info, std::shared_ptr<Store> store,
                                   std::shared_ptr<gloo::transport::Device> device)
    : Communicator(std::move(info)), store_(store) {
  if (size() > 1) {
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank(), size());
    ctx->setTimeout(info_.timeout);
    GlooStore gloo_store(store, info_.timeout);
    try {
      ctx->connectFullMesh(gloo_store, device);
    } catch (const std::exception& e) {
      // A member that never arrives (skipped its first op on this axis, or died) shows
      // up here as a store timeout: keep the kind, name the axis and the peers.
      const auto* ge = dynamic_cast<const Error*>(&e);
      throw Error(ge ? ge->kind() : ErrorKind::Comm,
                  "gridweave: connecting axis '" + info_.axis + "' (rank " + std::to_string(info_.members[info_.rank]) +
                      ", peers " + join_ranks(info_.members) + ") failed within " +
                      std::to_string(info_.timeout.count() / 1000.0) + " s; a peer skipped this op or died: " + e.what());
    }
    context_ = ctx;
  }
  worker_ = std::make_unique<Worker>();
}

GlooCommunicator::~GlooCommunicator() {
  worker_.reset();  // drain queued ops before the context goes
}

void GlooCommunicator::close() {
  Communicator::close();
  std::lock_guard<std::mutex> lock(pending_mu_);
  for (auto& w : pending_) {
    if (auto ub = w.lock()) {
      ub->abortWaitRecv();
      ub->abortWaitSend();
    }
  }
  pending_.clear();
}

void GlooCommunicator::rethrow(const Fingerprint& fp, const std::exception& e, int peer) {
  if (const auto* ge = dynamic_cast<const Error*>(&e)) throw *ge;
  const bool p2p = fp.op == OpKind::Send || fp.op == OpKind::Recv;
  if (p2p && info_.check == CheckLevel::Detail && (fp.seq & kAnswerTagBit))  // an answer: the message speaks
    throw Error(ErrorKind::Comm, "gridweave: " + describe(fp.op, peer) + ": the answer was lost: " + e.what());
  const bool first = mark_broken();
  const OpKind op = fp.op;
  std::string msg = e.what();
  bool timeout = msg.find("Timed out") != std::string::npos || msg.find("timed out") != std::string::npos ||
                 msg.find("Application timeout") != std::string::npos;
  // Members that disagree never exchange data (the fingerprint is the tag): they time out,
  // about together give or take their skew, so wait a while for the others' notes: 5 s whatever
  // the timeout, so a failed rank still ends within its timeout plus 10 s. A peer that closed
  // the connection wrote its note before it did.
  using std::chrono::milliseconds;
  const milliseconds window = timeout ? milliseconds(5000) : milliseconds(1000);
  // Only the failure that broke the communicator publishes a note: a later op's (the Detail
  // level's answer to a failed receive) must not overwrite what this member passed.
  const std::string notes = first ? compare_notes(store_.get(), fp, window) : "";
  if (!notes.empty()) throw Error(ErrorKind::Comm, "gridweave: " + notes);
  throw Error(timeout ? ErrorKind::Timeout : ErrorKind::Comm,
              "gridweave: " + describe(op, peer) + (timeout ? " timed out after " : " failed (timeout ") +
                  std::to_string(info_.timeout.count() / 1000.0) + " s" + (timeout ? "" : ")") +
                  (timeout ? ": a peer is slow, skipped this op or died: " : ": a peer died or closed the connection: ") +
                  msg);
}

std::shared_ptr<Work> GlooCommunicator::run_collective(OpKind op, const BufferView& in, const BufferView& out,
                                                       ReduceOp rop, int root, bool async_op,
                                                       const Fingerprint& fp) {
  auto work = std::make_shared<TaskWork>(describe(op));
  if (!async_op) {
    int ran = worker_->run_inline([&]() {
      work->flight_started();
      run_on_worker(op, in, out, rop, root, fp);
    });
    if (ran) {
      work->complete();
      return work;
    }
  }
  // Raw `this`: the destructor drains the worker before the communicator goes, and a
  // task must not own the communicator (its last release would join the worker from itself).
  worker_->submit(work, [this, op, in, out, rop, root, fp]() {
    run_on_worker(op, in, out, rop, root, fp);
    return -1;
  });
  return work;
}

void GlooCommunicator::run_on_worker(OpKind op, const BufferView& in, const BufferView& out, ReduceOp rop, int root,
                                     const Fingerprint& fp) {
  if (!context_) {  // one member: every op is a local copy
    if (op != OpKind::Barrier && in.ptr != out.ptr && out.ptr && in.ptr)
      std::memcpy(out.ptr, in.ptr, std::min(in.nbytes(), out.nbytes()));
    return;
  }
  // An op queued behind one that failed: the watchdog closed the grid, so it fails now rather
  // than wait out its own timeout on a peer that is gone (a step's queued gradient chunks would
  // otherwise keep a failed rank alive one timeout each)
  check_usable(op);
  const auto timeout = info_.timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;  // the whole op's (the rings keep it)
  const uint32_t tag = fp.hash();  // members that passed different ops never match a message
  auto reduce_fn = [dtype = in.dtype, rop](void* o, const void* a, const void* b, size_t n) {
    reduce_into(o, a, b, n, dtype, rop);
  };
  try {
    switch (op) {
      case OpKind::AllGather:
        with_width(in.dtype, [&](auto t) {
          using T = decltype(t);
          gloo::AllgatherOptions opts(context_);
          opts.setInput(as<T>(in), in.count);
          opts.setOutput(as<T>(out), out.count);
          opts.setTag(tag);
          opts.setTimeout(timeout);
          gloo::allgather(opts);
        });
        break;
      case OpKind::ReduceScatter:
        ring_reduce_scatter(in, out, rop, tag, deadline);
        break;
      case OpKind::AllReduce:
        ring_all_reduce(in, out, rop, tag, deadline);
        break;
      case OpKind::Broadcast:
        with_width(in.dtype, [&](auto t) {
          using T = decltype(t);
          gloo::BroadcastOptions opts(context_);
          opts.setOutput(as<T>(out), out.count);
          opts.setRoot(root);
          opts.setTag(tag);
          opts.setTimeout(timeout);
          gloo::broadcast(opts);
        });
        break;
      case OpKind::Reduce:
        with_width(in.dtype, [&](auto t) {
          using T = decltype(t);
          // Gloo's ring reduce writes partial sums into its output on every member:
          // reduce from a copy so non-root buffers stay untouched.
          std::vector<T> scratch(out.count);
          gloo::ReduceOptions opts(context_);
          opts.setInput(as<T>(in), in.count);
          opts.setOutput(rank() == root ? as<T>(out) : scratch.data(), out.count);
          opts.setRoot(root);
          opts.setReduceFunction(reduce_fn);
          opts.setTag(tag);
          opts.setTimeout(timeout);
          gloo::reduce(opts);
        });
        break;
      case OpKind::Gather:
        with_width(in.dtype, [&](auto t) {
          using T = decltype(t);
          gloo::GatherOptions opts(context_);
          opts.setInput(as<T>(in), in.count);
          if (rank() == root) opts.setOutput(as<T>(out), out.count);
          opts.setRoot(root);
          opts.setTag(tag);
          opts.setTimeout(timeout);
          gloo::gather(opts);
        });
        break;
      case OpKind::Scatter:
        with_width(out.dtype, [&](auto t) {
          using T = decltype(t);
          gloo::ScatterOptions opts(context_);
          if (rank() == root) {
            std::vector<T*> chunks(size());
            for (int k = 0; k < size(); ++k) chunks[k] = as<T>(in) + k * out.count;
            opts.setInputs(chunks, out.count);
          }
          opts.setOutput(as<T>(out), out.count);
          opts.setRoot(root);
          opts.setTag(tag);
          opts.setTimeout(timeout);
          gloo::scatter(opts);
        });
        break;
      case OpKind::AllToAll:
        with_width(in.dtype, [&](auto t) {
          using T = decltype(t);
          gloo::AlltoallOptions opts(context_);
          opts.setInput(as<T>(in), in.count);
          opts.setOutput(as<T>(out), out.count);
          opts.setTag(tag);
          opts.setTimeout(timeout);
          gloo::alltoall(opts);
        });
        break;
      case OpKind::Barrier: {
        gloo::BarrierOptions opts(context_);
        opts.setTag(tag);
        opts.setTimeout(timeout);
        gloo::barrier(opts);
        break;
      }
      default:
        GW_CHECK(false, describe(op) << " is not a collective");
    }
  } catch (const std::exception& e) {
    rethrow(fp, e);
  }
}

void GlooCommunicator::track(const std::shared_ptr<gloo::transport::UnboundBuffer>& ub) {
  std::lock_guard<std::mutex> lock(pending_mu_);
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](auto& w) { return w.expired(); }),
                 pending_.end());
  pending_.push_back(ub);
}

// Gloo has no reduce-scatter that leaves chunk k on member k, so it is a ring here:
// at step s member i sends chunk i-s-1 to i+1 and adds chunk i-s-2 from i-1
// (the schedule in traffic.cpp). Step 0 sends straight from the input; partial sums
// alternate between two chunk buffers; the last one lands in `out`.
void GlooCommunicator::ring_reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp rop, uint32_t tag,
                                           std::chrono::steady_clock::time_point deadline) {
  const int g = size(), i = rank();
  const std::size_t chunk = out.count, cb = out.nbytes();
  const char* src = static_cast<const char*>(in.ptr);
  std::vector<char> scratch(3 * cb);  // partial sums [0, cb) and [cb, 2cb); received chunk [2cb, 3cb)
  char* partial[2] = {scratch.data(), scratch.data() + cb};
  char* tmp = scratch.data() + 2 * cb;
  // Gloo sends from registered buffers: the input for step 0, the scratch after.
  std::shared_ptr<gloo::transport::UnboundBuffer> in_buf =
      context_->createUnboundBuffer(const_cast<char*>(src), in.nbytes());
  std::shared_ptr<gloo::transport::UnboundBuffer> scratch_buf =
      context_->createUnboundBuffer(scratch.data(), scratch.size());
  track(in_buf);
  track(scratch_buf);
  const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
  const int right = (i + 1) % g, left = (i + g - 1) % g;
  auto idx = [g](int c) { return ((c % g) + g) % g; };
  for (int s = 0; s < g - 1; ++s) {
    if (s == 0) in_buf->send(right, slot, idx(i - 1) * cb, cb);
    else scratch_buf->send(right, slot, ((s - 1) % 2) * cb, cb);
    scratch_buf->recv(left, slot, 2 * cb, cb);
    wait_or_abort(*scratch_buf, true, deadline);
    wait_or_abort(s == 0 ? *in_buf : *scratch_buf, false, deadline);
    char* dst = s == g - 2 ? static_cast<char*>(out.ptr) : partial[s % 2];
    reduce_into(dst, src + idx(i - s - 2) * cb, tmp, chunk, in.dtype, rop);
  }
}

// Ring all-reduce in place (traffic.cpp's schedule): chunk c is count / g elements, the first
// count % g one larger. Reduce-scatter: at step s member i sends chunk i-s-1 to i+1 and adds
// chunk i-s-2 from i-1, ending with chunk i reduced; all-gather: at step s it sends chunk i-s
// and takes chunk i-s-1. Empty chunks are not sent (a scalar is one message a step).
void GlooCommunicator::ring_all_reduce(const BufferView& in, const BufferView& out, ReduceOp rop, uint32_t tag,
                                       std::chrono::steady_clock::time_point deadline) {
  if (in.ptr != out.ptr && in.nbytes()) std::memcpy(out.ptr, in.ptr, out.nbytes());
  const int g = size(), i = rank();
  if (g == 1 || out.count == 0) return;
  const std::size_t es = dtype_size(out.dtype);
  std::vector<char> received(ring_chunk(out.count, g, 0).second * es);  // the largest chunk
  char* data = static_cast<char*>(out.ptr);
  std::shared_ptr<gloo::transport::UnboundBuffer> data_buf = context_->createUnboundBuffer(data, out.nbytes());
  std::shared_ptr<gloo::transport::UnboundBuffer> recv_buf =
      context_->createUnboundBuffer(received.data(), std::max<std::size_t>(received.size(), 1));
  track(data_buf);
  track(recv_buf);
  const uint64_t slot = gloo::Slot::build(kAllReduceSlotPrefix, tag);
  const int right = (i + 1) % g, left = (i + g - 1) % g;
  auto idx = [g](int c) { return ((c % g) + g) % g; };
  for (int s = 0; s < 2 * (g - 1); ++s) {
    const bool reducing = s < g - 1;
    const int t = reducing ? s : s - (g - 1);
    const auto [send_at, send_n] = ring_chunk(out.count, g, idx(reducing ? i - t - 1 : i - t));
    const auto [recv_at, recv_n] = ring_chunk(out.count, g, idx(reducing ? i - t - 2 : i - t - 1));
    if (send_n) data_buf->send(right, slot, send_at * es, send_n * es);
    if (recv_n) {
      if (reducing) recv_buf->recv(left, slot, 0, recv_n * es);
      else data_buf->recv(left, slot, recv_at * es, recv_n * es);
      wait_or_abort(reducing ? *recv_buf : *data_buf, true, deadline);
    }
    if (send_n) wait_or_abort(*data_buf, false, deadline);
    if (reducing && recv_n)
      reduce_into(data + recv_at * es, data + recv_at * es, received.data(), recv_n, out.dtype, rop);
  }
}

std::shared_ptr<Work> GlooCommunicator::run_p2p(OpKind op, const BufferView& buf, const std::vector<int>& peers,
                                                int /*tag*/, const Fingerprint& fp) {
  auto work = std::make_shared<TaskWork>(describe(op, peers.size() == 1 ? peers[0] : -1));
  GW_CHECK(context_, describe(op) << ": point-to-point needs at least two members");
  // The slot carries tag, dtype and count: a receive never takes a message of another
  // size (Gloo would abort its loop thread); the two sides time out and compare notes.
  const uint64_t slot = gloo::Slot::build(kP2PSlotPrefix, fp.hash());
  std::shared_ptr<gloo::transport::UnboundBuffer> ub;
  try {
    ub = context_->createUnboundBuffer(buf.ptr, buf.nbytes());
    if (op == OpKind::Send) ub->send(peers[0], slot);
    else if (peers.size() == 1) ub->recv(peers[0], slot);
    else ub->recv(peers, slot);
  } catch (const std::exception& e) {
    rethrow(fp, e, peers.size() == 1 ? peers[0] : -1);
  }
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](auto& w) { return w.expired(); }),
                   pending_.end());
    pending_.push_back(ub);
  }
  work->flight_started();  // posted: the transport moves it from now on
  // Posting never blocks; a waiter thread observes completion so test() can poll
  // and several p2p ops can be outstanding at once (the message-driven pipeline).
  auto self = std::static_pointer_cast<GlooCommunicator>(shared_from_this());
  std::thread([self, work, ub, op, fp, view = buf]() {
    try {
      int peer = -1;
      bool done = op == OpKind::Send ? ub->waitSend(&peer, self->info_.timeout)
                                     : ub->waitRecv(&peer, self->info_.timeout);
      if (!done) {
        work->fail(std::make_exception_ptr(
            Error(ErrorKind::Comm, "gridweave: " + work->what() + " cancelled: the grid was shut down")));
        return;
      }
      if (op == OpKind::Recv) self->count(OpKind::Recv, view, peer);
      work->complete(peer);
    } catch (const std::exception& e) {
      try {
        self->rethrow(fp, e);
      } catch (...) {
        work->fail(std::current_exception());
      }
    }
  }).detach();
  return work;
}

}  // namespace gridweave
