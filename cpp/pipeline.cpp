#include "pipeline.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <string>
#include <thread>

#include "error.h"
#include "memory.h"

namespace gridweave {

namespace {

constexpr int kTag = 7001;         // every pipeline message shares one slot; the header says what it is
constexpr int kControlTag = 7002;  // announcements of those messages on the control channel
enum : std::int64_t { kActivation = 1, kGradient = 2 };

using Clock = std::chrono::steady_clock;

void check(const PipelineConfig& c, const Communicator& pp) {
  GW_CHECK(c.stages == pp.size(), "pipeline: " << c.stages << " stages but the pp axis has " << pp.size() << " ranks");
  GW_CHECK(c.stage == pp.rank(), "pipeline: stage " << c.stage << " is rank " << pp.rank() << " on pp");
  GW_CHECK(c.microbatches >= 1, "pipeline: needs at least one microbatch");
  GW_CHECK(c.pipeline_limit >= 1, "pipeline_limit must be >= 1, got " << c.pipeline_limit);
  // Zero-byte payloads happen (cSub's idle sub-grids carry empty shards): the header still flows.
  GW_CHECK(c.payload_bytes % 8 == 0, "pipeline: payload of " << c.payload_bytes << " bytes must be a multiple of 8");
}

// A pipeline message on the communicator's device, as int64 words: [kind, microbatch,
// payload...]. The header is read back to the host after the message arrives.
struct StageMessage {
  std::shared_ptr<DeviceMemory> mem;
  std::size_t words;
  Device device;
  StageMessage(std::size_t payload_bytes, Device dev)
      : mem(allocate(dev, kStageHeaderBytes + payload_bytes)), words((kStageHeaderBytes + payload_bytes) / 8), device(dev) {}
  BufferView view() const {
    BufferView v{mem->data(), words, DType::Int64};
    v.device = device;
    return v;
  }
  void* payload() const { return static_cast<std::int64_t*>(mem->data()) + 2; }
  std::pair<std::int64_t, int> header() const {
    std::int64_t h[2];
    copy_bytes(h, mem->data(), sizeof(h), device);
    return {h[0], static_cast<int>(h[1])};
  }
  void set(std::int64_t kind, int mb, const void* data, std::size_t payload_bytes) {
    std::int64_t h[2] = {kind, mb};
    copy_bytes(mem->data(), h, sizeof(h), device);
    if (payload_bytes > 0) copy_bytes(payload(), data, payload_bytes, device);
  }
};

class Timer {
 public:
  explicit Timer(double& acc) : acc_(acc), t0_(Clock::now()) {}
  ~Timer() { acc_ += std::chrono::duration<double>(Clock::now() - t0_).count(); }

 private:
  double& acc_;
  Clock::time_point t0_;
};

// Outgoing messages stay alive until their send completes. With a control channel, each
// message is first announced there (its 16-byte header, host memory), then sent on pp.
class Outbox {
 public:
  Outbox(Communicator& pp, std::size_t payload, Communicator* control = nullptr)
      : pp_(pp), payload_(payload), control_(control) {}
  void send(int peer, std::int64_t kind, int mb, const void* data) { send_tagged(peer, kind, mb, data, kTag); }
  void send_tagged(int peer, std::int64_t kind, int mb, const void* data, int tag) {
    auto m = std::make_shared<StageMessage>(payload_, pp_.device());
    m->set(kind, mb, data, payload_);
    if (control_ != nullptr) {
      auto h = std::make_shared<StageMessage>(0, Device::CPU);
      h->set(kind, mb, nullptr, 0);
      pending_.push_back({h, control_->send(h->view(), peer, kControlTag)});
    }
    pending_.push_back({m, pp_.send(m->view(), peer, tag)});
    reap(false);
  }
  void reap(bool all) {
    while (!pending_.empty() && (all || pending_.front().second->test())) {
      pending_.front().second->wait(pp_.info().timeout);
      pending_.pop_front();
    }
  }

 private:
  Communicator& pp_;
  std::size_t payload_;
  Communicator* control_;
  std::deque<std::pair<std::shared_ptr<StageMessage>, std::shared_ptr<Work>>> pending_;
};

// Where a stage's next message comes from (Algorithm 2 processes whichever arrives first).
// Every receive stays posted while the message before it is computed on (double buffers).
class Receiver {
 public:
  virtual ~Receiver() = default;
  // Blocks (up to the timeout) for the next message from either neighbour.
  virtual StageMessage& next() = 0;
};

// One receive-from-any over both neighbours (Gloo; AxoNN's MPI_ANY_SOURCE).
class AnyReceiver : public Receiver {
 public:
  AnyReceiver(Communicator& pp, std::size_t payload, std::vector<int> peers, int expected)
      : pp_(pp), peers_(std::move(peers)), left_(expected) {
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(payload, pp.device());
    post();
  }
  StageMessage& next() override {
    posted_->wait(pp_.info().timeout);
    StageMessage& msg = bufs_[cur_];
    cur_ ^= 1;
    if (--left_ > 0) post();
    return msg;
  }

 private:
  void post() { posted_ = pp_.recv_any(bufs_[cur_].view(), peers_, kTag); }
  Communicator& pp_;
  std::vector<int> peers_;
  int left_;
  std::vector<StageMessage> bufs_;
  std::shared_ptr<Work> posted_;
  int cur_ = 0;
};

// One receive posted per neighbour, polled; whichever completes first is taken and re-posted.
class PerPeerReceiver : public Receiver {
 public:
  PerPeerReceiver(Communicator& pp, std::size_t payload, std::vector<int> peers, int per_peer, int stage)
      : pp_(pp), peers_(std::move(peers)), left_(peers_.size(), per_peer), cur_(peers_.size(), 0),
        posted_(peers_.size()), stage_(stage) {
    for (std::size_t k = 0; k < 2 * peers_.size(); ++k) bufs_.emplace_back(payload, pp.device());
    for (std::size_t k = 0; k < peers_.size(); ++k)
      if (left_[k] > 0) post(k);
  }
  StageMessage& next() override {
    const auto deadline = Clock::now() + pp_.info().timeout;
    std::size_t k = 0;
    for (bool done = false; !done;) {
      for (k = 0; k < posted_.size(); ++k)
        if (left_[k] > 0 && posted_[k]->test()) {
          done = true;
          break;
        }
      if (!done) {
        if (Clock::now() > deadline)
          throw Error(ErrorKind::Timeout, "gridweave: pipeline stage " + std::to_string(stage_) +
                                              " waited past its timeout for a neighbour's message");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    posted_[k]->wait(pp_.info().timeout);  // rethrows a transport error
    StageMessage& msg = bufs_[2 * k + cur_[k]];
    cur_[k] ^= 1;
    if (--left_[k] > 0) post(k);
    return msg;
  }

 private:
  void post(std::size_t k) { posted_[k] = pp_.recv(bufs_[2 * k + cur_[k]].view(), peers_[k], kTag); }
  Communicator& pp_;
  std::vector<int> peers_;
  std::vector<int> left_, cur_;
  std::vector<std::shared_ptr<Work>> posted_;
  std::vector<StageMessage> bufs_;
  int stage_;
};

// The transport's messages are announced on a host control channel that can receive from
// any peer: a receive-from-any on headers says which neighbour sends next, and the data
// receive is posted for exactly that message. No data receive is ever posted ahead of its
// send, so none can hold up a send queued behind it (NCCL has no receive-from-any).
class AnnouncedReceiver : public Receiver {
 public:
  AnnouncedReceiver(Communicator& pp, Communicator& control, std::size_t payload, std::vector<int> peers,
                    int expected)
      : pp_(pp), control_(control), peers_(std::move(peers)), left_(expected) {
    for (int k = 0; k < 2; ++k) headers_.emplace_back(0, Device::CPU);
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(payload, pp.device());
    post();
  }
  StageMessage& next() override {
    announced_->wait(control_.info().timeout);
    const int from = announced_->source();
    const auto [kind, mb] = headers_[cur_].header();
    StageMessage& msg = bufs_[cur_];
    cur_ ^= 1;
    if (--left_ > 0) post();  // the next announcement is awaited while this message is used
    pp_.recv(msg.view(), from, kTag)->wait(pp_.info().timeout);
    const auto got = msg.header();
    GW_CHECK(got.first == kind && got.second == mb, "pipeline: neighbour " << from << " announced kind " << kind
                                                        << " of microbatch " << mb << " but sent kind " << got.first
                                                        << " of microbatch " << got.second);
    return msg;
  }

 private:
  void post() { announced_ = control_.recv_any(headers_[cur_].view(), peers_, kControlTag); }
  Communicator& pp_;
  Communicator& control_;
  std::vector<int> peers_;
  int left_;
  std::vector<StageMessage> headers_, bufs_;
  std::shared_ptr<Work> announced_;
  int cur_ = 0;
};

}  // namespace

PipelineStats run_message_driven(Communicator& pp, const PipelineConfig& cfg, const StageForward& forward,
                                 const StageBackward& backward, Communicator* control) {
  check(cfg, pp);
  ReceiveStrategy how = cfg.receive;
  if (how == ReceiveStrategy::Auto)
    how = pp.can_recv_any() ? ReceiveStrategy::Any
                            : (control != nullptr ? ReceiveStrategy::Announced : ReceiveStrategy::PerPeer);
  GW_CHECK(how != ReceiveStrategy::Any || pp.can_recv_any(),
           "the " << pp.backend() << " transport cannot receive from any peer; use the announced or per-peer strategy");
  GW_CHECK(how != ReceiveStrategy::Announced || (control != nullptr && control->can_recv_any() &&
                                                  control->size() == pp.size() && control->rank() == pp.rank()),
           "the announced strategy needs a control channel over the same ranks that can receive from any peer");
  PipelineStats st;
  const int s = cfg.stage, last = cfg.stages - 1;
  Outbox out(pp, cfg.payload_bytes, how == ReceiveStrategy::Announced ? control : nullptr);
  int next_mb = 0;
  auto inject = [&]() {  // stage 0: start the forward of the next microbatch
    const int mb = next_mb++;
    const void* y;
    {
      Timer t(st.compute_s);
      y = forward(mb, nullptr);
    }
    ++st.forwards;
    if (last == 0) {  // a one-stage pipeline turns around at once
      Timer t(st.compute_s);
      backward(mb, nullptr);
      ++st.backwards;
      return;
    }
    out.send(1, kActivation, mb, y);
  };
  if (s == 0) {
    const int first = last == 0 ? cfg.microbatches : std::min(cfg.pipeline_limit, cfg.microbatches);
    for (int k = 0; k < first; ++k) inject();
  }
  int expected = (s > 0 ? cfg.microbatches : 0) + (s < last ? cfg.microbatches : 0);
  std::vector<int> peers;
  if (s > 0) peers.push_back(s - 1);
  if (s < last) peers.push_back(s + 1);
  std::unique_ptr<Receiver> in;
  if (expected > 0) {
    if (how == ReceiveStrategy::Any) in = std::make_unique<AnyReceiver>(pp, cfg.payload_bytes, peers, expected);
    else if (how == ReceiveStrategy::Announced)
      in = std::make_unique<AnnouncedReceiver>(pp, *control, cfg.payload_bytes, peers, expected);
    else in = std::make_unique<PerPeerReceiver>(pp, cfg.payload_bytes, peers, cfg.microbatches, s);
  }
  while (expected > 0) {
    StageMessage* got;
    {
      Timer t(st.wait_s);
      got = &in->next();
    }
    StageMessage& msg = *got;
    --expected;
    ++st.messages;
    const auto [kind, mb] = msg.header();
    if (kind == kActivation) {  // from s-1: forward
      const void* y;
      {
        Timer t(st.compute_s);
        y = forward(mb, msg.payload());
      }
      ++st.forwards;
      if (s == last) {
        const void* g;
        {
          Timer t(st.compute_s);
          g = backward(mb, nullptr);
        }
        ++st.backwards;
        out.send(s - 1, kGradient, mb, g);
      } else {
        out.send(s + 1, kActivation, mb, y);
      }
    } else if (kind == kGradient) {  // from s+1: backward
      const void* g;
      {
        Timer t(st.compute_s);
        g = backward(mb, msg.payload());
      }
      ++st.backwards;
      if (s == 0) {
        if (next_mb < cfg.microbatches) inject();
      } else {
        out.send(s - 1, kGradient, mb, g);
      }
    } else {
      throw Error(ErrorKind::Comm, "gridweave: pipeline stage " + std::to_string(s) +
                                       " received a message of unknown kind " + std::to_string(kind));
    }
  }
  out.reap(true);
  return st;
}

PipelineStats run_one_f_one_b(Communicator& pp, const PipelineConfig& cfg, const StageForward& forward,
                              const StageBackward& backward) {
  check(cfg, pp);
  PipelineStats st;
  const int s = cfg.stage, last = cfg.stages - 1, m = cfg.microbatches;
  Outbox out(pp, cfg.payload_bytes);
  StageMessage in(cfg.payload_bytes, pp.device());
  auto receive = [&](int peer, std::int64_t kind, int mb) -> const void* {
    {
      Timer t(st.wait_s);
      pp.recv(in.view(), peer, kTag)->wait(pp.info().timeout);
    }
    ++st.messages;
    const auto [got_kind, got_mb] = in.header();
    GW_CHECK(got_kind == kind && got_mb == mb,
             "1F1B stage " << s << " expected " << (kind == kActivation ? "activation" : "gradient") << " of microbatch "
                           << mb << ", got kind " << got_kind << " of microbatch " << got_mb);
    return in.payload();
  };
  auto do_forward = [&](int mb) {
    const void* x = s > 0 ? receive(s - 1, kActivation, mb) : nullptr;
    const void* y;
    {
      Timer t(st.compute_s);
      y = forward(mb, x);
    }
    ++st.forwards;
    if (s < last) out.send(s + 1, kActivation, mb, y);
  };
  auto do_backward = [&](int mb) {
    const void* g = s < last ? receive(s + 1, kGradient, mb) : nullptr;
    const void* dx;
    {
      Timer t(st.compute_s);
      dx = backward(mb, g);
    }
    ++st.backwards;
    if (s > 0) out.send(s - 1, kGradient, mb, dx);
  };
  const int warmup = std::min(last - s, m);
  int f = 0, b = 0;
  for (; f < warmup; ++f) do_forward(f);
  for (; f < m; ++f, ++b) {  // steady state: one forward, one backward
    do_forward(f);
    do_backward(b);
  }
  for (; b < m; ++b) do_backward(b);  // cool-down (the flush)
  out.reap(true);
  return st;
}

PipelineStats run_interleaved(Communicator& pp, const PipelineConfig& cfg, int chunks, const ChunkForward& forward,
                              const ChunkBackward& backward) {
  check(cfg, pp);
  const int p = cfg.stages, s = cfg.stage, m = cfg.microbatches, v = chunks;
  GW_CHECK(v >= 1, "interleaved pipeline: chunks must be >= 1, got " << v);
  GW_CHECK(p >= 2, "interleaved pipeline: needs at least 2 stages, got " << p);
  GW_CHECK(m % p == 0, "interleaved pipeline: " << m << " microbatches are not a multiple of the " << p << " stages");
  PipelineStats st;
  const int prev = (s + p - 1) % p, next = (s + 1) % p;
  const int total = m * v;
  // Megatron's order of the k-th forward (backward: chunks in reverse) of a stage
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto chunk_f = [&](int k) { return (k / p) % v; };
  auto chunk_b = [&](int k) { return v - 1 - (k / p) % v; };
  const bool first_virtual = s == 0, last_virtual = s == p - 1;
  Outbox out(pp, cfg.payload_bytes);
  StageMessage in(cfg.payload_bytes, pp.device());
  auto receive = [&](int peer, std::int64_t kind, int mb, int c) -> const void* {
    {
      Timer t(st.wait_s);
      pp.recv(in.view(), peer, kTag + static_cast<int>(kind))->wait(pp.info().timeout);
    }
    ++st.messages;
    const auto [got_kind, got] = in.header();
    GW_CHECK(got_kind == kind && got == mb * v + c,
             "interleaved stage " << s << " expected " << (kind == kActivation ? "activation" : "gradient")
                                  << " of microbatch " << mb << " chunk " << c << ", got kind " << got_kind
                                  << " of microbatch " << got / v << " chunk " << got % v);
    return in.payload();
  };
  auto send = [&](int peer, std::int64_t kind, int mb, int c, const void* data) {
    out.send_tagged(peer, kind, mb * v + c, data, kTag + static_cast<int>(kind));
  };
  auto do_forward = [&](int k) {
    const int mb = mb_of(k), c = chunk_f(k);
    const bool head = first_virtual && c == 0, tail = last_virtual && c == v - 1;
    // the input of chunk c: from the previous stage's chunk c, or (stage 0) the last stage's chunk c - 1
    const void* x = head ? nullptr : receive(prev, kActivation, mb, c);
    const void* y;
    {
      Timer t(st.compute_s);
      y = forward(mb, c, x);
    }
    ++st.forwards;
    if (!tail) send(next, kActivation, mb, last_virtual ? c + 1 : c, y);
  };
  auto do_backward = [&](int k) {
    const int mb = mb_of(k), c = chunk_b(k);
    const bool head = first_virtual && c == 0, tail = last_virtual && c == v - 1;
    const void* g = tail ? nullptr : receive(next, kGradient, mb, c);
    const void* dx;
    {
      Timer t(st.compute_s);
      dx = backward(mb, c, g);
    }
    ++st.backwards;
    if (!head) send(prev, kGradient, mb, first_virtual ? c - 1 : c, dx);
  };
  const int warmup = std::min((p - s - 1) * 2 + (v - 1) * p, total);
  int f = 0, b = 0;
  for (; f < warmup; ++f) do_forward(f);
  for (; f < total; ++f, ++b) {  // steady state
    do_forward(f);
    do_backward(b);
  }
  for (; b < total; ++b) do_backward(b);  // cool-down
  out.reap(true);
  return st;
}

}  // namespace gridweave
