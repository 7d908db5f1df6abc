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
// payload...], filled in the order of the stage's stream. Only a receiver that cannot know
// what comes next (receive-from-any, one receive per neighbour) reads the header back; the
// announced strategy learns it from the announcement, 1F1B and interleaved from their order
// (and check it where it is host memory, for free).
struct StageMessage {
  std::shared_ptr<DeviceMemory> mem;
  std::size_t words;
  Device device;
  void* stream;
  StageMessage(std::size_t payload_bytes, Device dev, void* on = nullptr)
      : mem(allocate(dev, kStageHeaderBytes + payload_bytes)), words((kStageHeaderBytes + payload_bytes) / 8),
        device(dev), stream(dev == Device::CPU ? nullptr : on) {}
  BufferView view() const {
    BufferView v{mem->data(), words, DType::Int64};
    v.device = device;
    v.stream = stream;
    return v;
  }
  void* payload() const { return static_cast<std::int64_t*>(mem->data()) + 2; }
  std::pair<std::int64_t, int> header() const {
    std::int64_t h[2];
    copy_bytes(h, mem->data(), sizeof(h), device);
    return {h[0], static_cast<int>(h[1])};
  }
  void set(std::int64_t kind, int mb, const void* data, std::size_t payload_bytes) {
    const std::int64_t h[2] = {kind, mb};
    copy_bytes_async(mem->data(), h, sizeof(h), device, stream);
    if (payload_bytes > 0) copy_bytes_async(payload(), data, payload_bytes, device, stream);
  }
};

// What a receiver delivers: the message, and what it is.
struct Delivered {
  StageMessage* msg;
  std::int64_t kind;
  int mb;
};

class Timer {
 public:
  explicit Timer(double& acc) : acc_(acc), t0_(Clock::now()) {}
  ~Timer() { acc_ += std::chrono::duration<double>(Clock::now() - t0_).count(); }

 private:
  double& acc_;
  Clock::time_point t0_;
};

// Where one kind of message goes to or comes from: a communicator and the peer's index in it.
struct Endpoint {
  Communicator* comm = nullptr;
  int peer = -1;
  std::shared_ptr<Work> send(const BufferView& v, int tag) const { return comm->send(v, peer, tag); }
  std::shared_ptr<Work> recv(const BufferView& v, int tag) const { return comm->recv(v, peer, tag); }
};

// A stage's four ends: activations to the next stage and from the previous one, gradients to
// the previous stage and from the next one (prev / next: stage indices on pp, -1 for none).
struct Ends {
  Endpoint to_next, from_prev, to_prev, from_next;
  int prev = -1, next = -1;
  const Endpoint& from(int stage) const { return stage == prev ? from_prev : from_next; }
};

Ends ends_of(Communicator& pp, const StageLinks& links, int prev, int next) {
  auto pick = [&pp](const std::shared_ptr<Communicator>& link, int stage) {
    if (stage < 0) return Endpoint{};
    if (!link) return Endpoint{&pp, stage};
    GW_CHECK(link->size() == 2, "pipeline: a link between two stages has 2 members, got " << link->size());
    return Endpoint{link.get(), 1 - link->rank()};
  };
  Ends e{pick(links.to_next, next), pick(links.from_prev, prev), pick(links.to_prev, prev),
         pick(links.from_next, next)};
  e.prev = prev;
  e.next = next;
  return e;
}

// Receives the next message from stage `from` into msg, known to be kind `kind` of microbatch
// `mb` (announced, or agreed on by the stage), and checks it where the message is host memory
// (for free: a device message's header would cost a copy).
void receive_expected(const Communicator& pp, const Ends& ends, int from, StageMessage& msg, std::int64_t kind,
                      int mb) {
  ends.from(from).recv(msg.view(), kTag)->wait(pp.info().timeout);
  if (pp.device() == Device::CPU) {
    const auto got = msg.header();
    GW_CHECK(got.first == kind && got.second == mb, "pipeline: expected kind " << kind << " of microbatch " << mb
                                                        << " from neighbour " << from << ", it sent kind "
                                                        << got.first << " of microbatch " << got.second);
  }
}

// Outgoing messages stay alive until their send completes: activations to the next stage,
// gradients to the previous one. With a control channel, each message is first announced
// there (its 16-byte header, host memory, to the stage's index on pp), then sent.
class Outbox {
 public:
  Outbox(Communicator& pp, std::size_t payload, const Ends& ends, Communicator* control = nullptr,
         void* stream = nullptr)
      : pp_(pp), payload_(payload), ends_(ends), control_(control), stream_(stream) {}
  void send(std::int64_t kind, int mb, const void* data) { send_tagged(kind, mb, data, kTag); }
  void send_tagged(std::int64_t kind, int mb, const void* data, int tag) {
    const bool forward = kind == kActivation;
    const Endpoint& to = forward ? ends_.to_next : ends_.to_prev;
    std::shared_ptr<StageMessage> m;  // a sent message's memory again, once its send is done
    if (!free_.empty()) {
      m = free_.back();
      free_.pop_back();
    } else {
      m = std::make_shared<StageMessage>(payload_, pp_.device(), stream_);
    }
    m->set(kind, mb, data, payload_);
    if (control_ != nullptr) {
      auto h = std::make_shared<StageMessage>(0, Device::CPU);
      h->set(kind, mb, nullptr, 0);
      announced_.push_back({h, control_->send(h->view(), forward ? ends_.next : ends_.prev, kControlTag)});
    }
    pending_.push_back({m, to.send(m->view(), tag)});
    reap(false);
  }
  void reap(bool all) {
    while (!pending_.empty() && (all || pending_.front().second->test())) {
      pending_.front().second->wait_host(pp_.info().timeout);
      free_.push_back(pending_.front().first);
      pending_.pop_front();
    }
    while (!announced_.empty() && (all || announced_.front().second->test())) {
      announced_.front().second->wait_host(control_->info().timeout);
      announced_.pop_front();
    }
  }

 private:
  Communicator& pp_;
  std::size_t payload_;
  Ends ends_;
  Communicator* control_;
  void* stream_;
  std::deque<std::pair<std::shared_ptr<StageMessage>, std::shared_ptr<Work>>> pending_, announced_;
  std::vector<std::shared_ptr<StageMessage>> free_;  // no allocation per message past the first few
};

// Where a stage's next message comes from (Algorithm 2 processes whichever arrives first).
// Every receive stays posted while the message before it is computed on (double buffers).
class Receiver {
 public:
  virtual ~Receiver() = default;
  // Blocks (up to the timeout) for the next message from either neighbour.
  virtual Delivered next() = 0;
};

// One receive-from-any over both neighbours (Gloo; AxoNN's MPI_ANY_SOURCE).
class AnyReceiver : public Receiver {
 public:
  AnyReceiver(Communicator& pp, std::size_t payload, std::vector<int> peers, int expected, void* stream)
      : pp_(pp), peers_(std::move(peers)), left_(expected) {
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(payload, pp.device(), stream);
    post();
  }
  Delivered next() override {
    posted_->wait_host(pp_.info().timeout);
    StageMessage& msg = bufs_[cur_];
    cur_ ^= 1;
    if (--left_ > 0) post();
    const auto [kind, mb] = msg.header();
    return {&msg, kind, mb};
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
  PerPeerReceiver(Communicator& pp, std::size_t payload, std::vector<Endpoint> from, int per_peer, int stage,
                  void* stream)
      : pp_(pp), from_(std::move(from)), left_(from_.size(), per_peer), cur_(from_.size(), 0),
        posted_(from_.size()), stage_(stage) {
    for (std::size_t k = 0; k < 2 * from_.size(); ++k) bufs_.emplace_back(payload, pp.device(), stream);
    for (std::size_t k = 0; k < from_.size(); ++k)
      if (left_[k] > 0) post(k);
  }
  Delivered next() override {
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
    posted_[k]->wait_host(pp_.info().timeout);  // rethrows a transport error
    StageMessage& msg = bufs_[2 * k + cur_[k]];
    cur_[k] ^= 1;
    if (--left_[k] > 0) post(k);
    const auto [kind, mb] = msg.header();
    return {&msg, kind, mb};
  }

 private:
  void post(std::size_t k) { posted_[k] = from_[k].recv(bufs_[2 * k + cur_[k]].view(), kTag); }
  Communicator& pp_;
  std::vector<Endpoint> from_;
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
  AnnouncedReceiver(Communicator& pp, Communicator& control, std::size_t payload, const Ends& ends,
                    std::vector<int> peers, int expected, void* stream)
      : pp_(pp), control_(control), ends_(ends), peers_(std::move(peers)), left_(expected) {
    for (int k = 0; k < 2; ++k) headers_.emplace_back(0, Device::CPU);
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(payload, pp.device(), stream);
    post();
  }
  Delivered next() override {
    announced_->wait_host(control_.info().timeout);
    const int from = announced_->source();
    const auto [kind, mb] = headers_[cur_].header();  // the announcement's: host memory
    StageMessage& msg = bufs_[cur_];
    cur_ ^= 1;
    if (--left_ > 0) post();  // the next announcement is awaited while this message is used
    // stream-ordered where the transport is (the stage's stream waits for the message, the host
    // goes on); its buffer is filled again only after that stream has used it (two messages on)
    receive_expected(pp_, ends_, from, msg, kind, mb);
    return {&msg, kind, mb};
  }

 private:
  void post() { announced_ = control_.recv_any(headers_[cur_].view(), peers_, kControlTag); }
  Communicator& pp_;
  Communicator& control_;
  Ends ends_;
  std::vector<int> peers_;
  int left_;
  std::vector<StageMessage> headers_, bufs_;
  std::shared_ptr<Work> announced_;
  int cur_ = 0;
};

// A stage of several ranks (tensor or sequence parallel) runs collectives among them inside each
// forward and backward, so its members must handle their messages in one order, or their
// collectives pair up differently and hang (or sum the wrong tensors). The group's first member
// takes whichever message arrives first (Algorithm 2) and tells the others which it took, two
// words on a host channel over the stage's members; a follower then receives exactly that one
// from its own neighbour. Each sender's messages arrive in the order it sent them, and the
// neighbouring stages' members agreed on that order among themselves too, so the follower's next
// message from that neighbour is the one its leader took.
class LeadReceiver : public Receiver {
 public:
  LeadReceiver(std::unique_ptr<Receiver> inner, Communicator& group)
      : inner_(std::move(inner)), group_(group), said_(0, Device::CPU) {}
  Delivered next() override {
    Delivered got = inner_->next();
    said_.set(got.kind, got.mb, nullptr, 0);
    group_.broadcast(said_.view(), 0, false)->wait_host(group_.info().timeout);
    return got;
  }

 private:
  std::unique_ptr<Receiver> inner_;
  Communicator& group_;
  StageMessage said_;
};

class FollowReceiver : public Receiver {
 public:
  FollowReceiver(Communicator& group, Communicator& pp, Communicator* control, std::size_t payload, const Ends& ends,
                 void* stream)
      : group_(group), pp_(pp), control_(control), ends_(ends), said_(0, Device::CPU), header_(0, Device::CPU) {
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(payload, pp.device(), stream);
  }
  Delivered next() override {
    group_.broadcast(said_.view(), 0, false)->wait_host(group_.info().timeout);
    const auto [kind, mb] = said_.header();
    const int from = kind == kActivation ? ends_.prev : ends_.next;
    GW_CHECK(from >= 0, "pipeline: the stage's leader took kind " << kind << " of microbatch " << mb
                                                                 << ", which no neighbour of this stage sends");
    if (control_ != nullptr)  // the announcement the sender made of it, taken from that sender
      control_->recv(header_.view(), from, kControlTag)->wait_host(control_->info().timeout);
    StageMessage& msg = bufs_[cur_];
    cur_ ^= 1;
    receive_expected(pp_, ends_, from, msg, kind, mb);
    return {&msg, kind, mb};
  }

 private:
  Communicator& group_;
  Communicator& pp_;
  Communicator* control_;
  Ends ends_;
  StageMessage said_, header_;
  std::vector<StageMessage> bufs_;
  int cur_ = 0;
};

}  // namespace

PipelineStats run_message_driven(Communicator& pp, const PipelineConfig& cfg, const StageForward& forward,
                                 const StageBackward& backward, Communicator* control, const StageLinks& links,
                                 Communicator* stage_group) {
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
  // receive-from-any needs every message on pp itself; the other strategies use the links
  const Ends ends = ends_of(pp, how == ReceiveStrategy::Any ? StageLinks{} : links, s > 0 ? s - 1 : -1,
                            s < last ? s + 1 : -1);
  Outbox out(pp, cfg.payload_bytes, ends, how == ReceiveStrategy::Announced ? control : nullptr, cfg.stream);
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
    out.send(kActivation, mb, y);
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
  // only a stage between two others has two sources whose messages can arrive in either order
  const bool agree = stage_group != nullptr && stage_group->size() > 1 && s > 0 && s < last;
  if (agree && stage_group->rank() > 0) {
    in = std::make_unique<FollowReceiver>(*stage_group, pp, how == ReceiveStrategy::Announced ? control : nullptr,
                                          cfg.payload_bytes, ends, cfg.stream);
  } else if (expected > 0) {
    if (how == ReceiveStrategy::Any) in = std::make_unique<AnyReceiver>(pp, cfg.payload_bytes, peers, expected, cfg.stream);
    else if (how == ReceiveStrategy::Announced)
      in = std::make_unique<AnnouncedReceiver>(pp, *control, cfg.payload_bytes, ends, peers, expected, cfg.stream);
    else {
      std::vector<Endpoint> from;
      for (int p : peers) from.push_back(ends.from(p));
      in = std::make_unique<PerPeerReceiver>(pp, cfg.payload_bytes, from, cfg.microbatches, s, cfg.stream);
    }
    if (agree) in = std::make_unique<LeadReceiver>(std::move(in), *stage_group);
  }
  while (expected > 0) {
    Delivered got;
    {
      Timer t(st.wait_s);
      got = in->next();
    }
    StageMessage& msg = *got.msg;
    const std::int64_t kind = got.kind;
    const int mb = got.mb;
    --expected;
    ++st.messages;
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
        out.send(kGradient, mb, g);
      } else {
        out.send(kActivation, mb, y);
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
        out.send(kGradient, mb, g);
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
                              const StageBackward& backward, const StageLinks& links) {
  check(cfg, pp);
  PipelineStats st;
  const int s = cfg.stage, last = cfg.stages - 1, m = cfg.microbatches;
  const Ends ends = ends_of(pp, links, s > 0 ? s - 1 : -1, s < last ? s + 1 : -1);
  Outbox out(pp, cfg.payload_bytes, ends, nullptr, cfg.stream);
  StageMessage in(cfg.payload_bytes, pp.device(), cfg.stream);
  auto receive = [&](int peer, std::int64_t kind, int mb) -> const void* {
    {
      Timer t(st.wait_s);  // what comes next is known: the stage's stream waits for it, not the host
      ends.from(peer).recv(in.view(), kTag)->wait(pp.info().timeout);
    }
    ++st.messages;
    if (pp.device() == Device::CPU) {  // a free check where the message is host memory
      const auto [got_kind, got_mb] = in.header();
      GW_CHECK(got_kind == kind && got_mb == mb,
               "1F1B stage " << s << " expected " << (kind == kActivation ? "activation" : "gradient")
                             << " of microbatch " << mb << ", got kind " << got_kind << " of microbatch " << got_mb);
    }
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
    if (s < last) out.send(kActivation, mb, y);
  };
  auto do_backward = [&](int mb) {
    const void* g = s < last ? receive(s + 1, kGradient, mb) : nullptr;
    const void* dx;
    {
      Timer t(st.compute_s);
      dx = backward(mb, g);
    }
    ++st.backwards;
    if (s > 0) out.send(kGradient, mb, dx);
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
                              const ChunkBackward& backward, const StageLinks& links) {
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
  // activations to next / from prev, gradients to prev / from next; with two stages next and
  // prev are one rank, and the kinds stay apart by link (by tag where tags match messages)
  const Ends ends = ends_of(pp, links, prev, next);
  Outbox out(pp, cfg.payload_bytes, ends, nullptr, cfg.stream);
  StageMessage in(cfg.payload_bytes, pp.device(), cfg.stream);
  auto receive = [&](std::int64_t kind, int mb, int c) -> const void* {
    const Endpoint& from = kind == kActivation ? ends.from_prev : ends.from_next;
    {
      Timer t(st.wait_s);  // stream-ordered, as in 1F1B
      from.recv(in.view(), kTag + static_cast<int>(kind))->wait(pp.info().timeout);
    }
    ++st.messages;
    if (pp.device() == Device::CPU) {
      const auto [got_kind, got] = in.header();
      GW_CHECK(got_kind == kind && got == mb * v + c,
               "interleaved stage " << s << " expected " << (kind == kActivation ? "activation" : "gradient")
                                    << " of microbatch " << mb << " chunk " << c << ", got kind " << got_kind
                                    << " of microbatch " << got / v << " chunk " << got % v);
    }
    return in.payload();
  };
  auto send = [&](std::int64_t kind, int mb, int c, const void* data) {
    out.send_tagged(kind, mb * v + c, data, kTag + static_cast<int>(kind));
  };
  auto do_forward = [&](int k) {
    const int mb = mb_of(k), c = chunk_f(k);
    const bool head = first_virtual && c == 0, tail = last_virtual && c == v - 1;
    // the input of chunk c: from the previous stage's chunk c, or (stage 0) the last stage's chunk c - 1
    const void* x = head ? nullptr : receive(kActivation, mb, c);
    const void* y;
    {
      Timer t(st.compute_s);
      y = forward(mb, c, x);
    }
    ++st.forwards;
    if (!tail) send(kActivation, mb, last_virtual ? c + 1 : c, y);
  };
  auto do_backward = [&](int k) {
    const int mb = mb_of(k), c = chunk_b(k);
    const bool head = first_virtual && c == 0, tail = last_virtual && c == v - 1;
    const void* g = tail ? nullptr : receive(kGradient, mb, c);
    const void* dx;
    {
      Timer t(st.compute_s);
      dx = backward(mb, c, g);
    }
    ++st.backwards;
    if (!head) send(kGradient, mb, first_virtual ? c - 1 : c, dx);
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
