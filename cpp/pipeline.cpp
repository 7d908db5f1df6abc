#include "pipeline.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <string>
#include <thread>

#include "error.h"
#include "memory.h"

namespace gridweave {

namespace {

constexpr int kTag = 7001;         // the message-driven schedule's: one slot, whichever neighbour and kind
constexpr int kControlTag = 7002;  // announcements of those messages on the control channel
constexpr int kOrderedTag = 8000;  // 1F1B and interleaved: one tag per message (ordered_tag)
enum : std::int64_t { kActivation = 1, kGradient = 2 };

// 1F1B's and interleaved's messages each have their own tag (below MPI's 32767): where tags
// match messages (Gloo, MPI) a receive never takes another message, and under NCCL's rules
// (matched in issue order) a message whose tag disagrees with its receive's is an error, so the
// two ends' orders are checked for free. `id`: the microbatch (interleaved: mb * chunks + chunk).
int ordered_tag(std::int64_t kind, int id) { return kOrderedTag + 4 * (id % 4096) + static_cast<int>(kind); }

const char* kind_name(std::int64_t kind) { return kind == kActivation ? "activation" : "gradient"; }

using Clock = std::chrono::steady_clock;

void check(const PipelineConfig& c, const Communicator& pp) {
  GW_CHECK(c.stages == pp.size(), "pipeline: " << c.stages << " stages but the pp axis has " << pp.size() << " ranks");
  GW_CHECK(c.stage == pp.rank(), "pipeline: stage " << c.stage << " is rank " << pp.rank() << " on pp");
  GW_CHECK(c.microbatches >= 1, "pipeline: needs at least one microbatch");
  GW_CHECK(c.pipeline_limit >= 1, "pipeline_limit must be >= 1, got " << c.pipeline_limit);
  // Zero-byte payloads happen (cSub's idle sub-grids carry empty shards): a one-word message still flows.
  GW_CHECK(c.payload_bytes % 8 == 0, "pipeline: payload of " << c.payload_bytes << " bytes must be a multiple of 8");
}

// Compute callbacks run so far: a receive posted before this number last grew was posted ahead.
int computed(const PipelineStats& st) { return st.forwards + st.backwards; }

// [kind, microbatch] in host memory: an announcement, or a stage leader's word.
struct Header {
  std::int64_t words[2] = {0, 0};
  Header() = default;
  Header(std::int64_t kind, int mb) : words{kind, mb} {}
  BufferView view() {
    BufferView v;
    v.ptr = words;
    v.count = 2;
    v.dtype = DType::Int64;
    return v;
  }
  std::int64_t kind() const { return words[0]; }
  int mb() const { return static_cast<int>(words[1]); }
};
static_assert(sizeof(Header::words) == kStageHeaderBytes, "an announcement is kStageHeaderBytes");

// One message's bytes (stage_message_bytes) at `data` on the communicator's device, as int64
// words, read and written in the order of the stage's stream.
BufferView message_view(const void* data, std::size_t payload, Device device, void* stream) {
  BufferView v;
  v.ptr = const_cast<void*>(data);
  v.count = stage_message_bytes(payload) / 8;
  v.dtype = DType::Int64;
  v.device = device;
  v.stream = device == Device::CPU ? nullptr : stream;
  return v;
}

// An engine-owned receive buffer of one message.
struct MessageBuffer {
  std::shared_ptr<DeviceMemory> mem;
  BufferView view;
  MessageBuffer(std::size_t payload, Device device, void* stream)
      : mem(allocate(device, stage_message_bytes(payload))), view(message_view(mem->data(), payload, device, stream)) {}
  const void* data() const { return mem->data(); }
};

// What a receiver delivers: the message's bytes, what it is, and when its receive was posted
// (computed() then).
struct Delivered {
  const void* data = nullptr;
  std::int64_t kind = 0;
  int mb = 0;
  int posted_at = 0;
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

// The end towards `stage` (-1: none): its two-member link, or the pp line itself (tags keep apart).
Endpoint end_towards(Communicator& pp, const std::shared_ptr<Communicator>& link, int stage) {
  if (stage < 0) return Endpoint{};
  if (!link) return Endpoint{&pp, stage};
  GW_CHECK(link->size() == 2, "pipeline: a link between two stages has 2 members, got " << link->size());
  return Endpoint{link.get(), 1 - link->rank()};
}

Ends ends_of(Communicator& pp, const StageLinks& links, int prev, int next) {
  Ends e{end_towards(pp, links.to_next, next), end_towards(pp, links.from_prev, prev),
         end_towards(pp, links.to_prev, prev), end_towards(pp, links.from_next, next)};
  e.prev = prev;
  e.next = next;
  return e;
}

// Outgoing messages, each sent in place from the bytes a callback returned (no copy); the
// caller keeps them alive until cfg.sent says the send is done. With a control channel, each
// message is first announced there (its header, host memory, to the stage's index on pp).
class Outbox {
 public:
  Outbox(Communicator& pp, const PipelineConfig& cfg, const Ends& ends, Communicator* control = nullptr)
      : pp_(pp), payload_(cfg.payload_bytes), stream_(cfg.stream), sent_(cfg.sent), ends_(ends), control_(control) {
    if (payload_ == 0) token_ = allocate(pp.device(), stage_message_bytes(0));  // what an empty payload sends
  }
  void send(std::int64_t kind, int mb, const void* data, int tag) {
    const bool forward = kind == kActivation;
    send_to(forward ? ends_.to_next : ends_.to_prev, forward ? ends_.next : ends_.prev, kind, mb, data, tag);
  }
  // To an end of the caller's choosing (a V's chunk 1 sends against the usual directions);
  // `stage`: the receiver's index on pp, which the control channel's announcement goes to.
  void send_to(const Endpoint& to, int stage, std::int64_t kind, int mb, const void* data, int tag) {
    const bool forward = kind == kActivation;
    GW_CHECK(data != nullptr || payload_ == 0, "pipeline: the " << (forward ? "forward" : "backward")
                                                                << " of microbatch " << mb
                                                                << " returned no bytes to send");
    GW_CHECK(to.comm != nullptr, "pipeline: no " << kind_name(kind) << " end towards stage " << stage);
    if (control_ != nullptr) {
      auto h = std::make_shared<Header>(kind, mb);
      announced_.push_back({h, control_->send(h->view(), stage, kControlTag)});
    }
    const void* bytes = payload_ > 0 ? data : token_->data();
    pending_.push_back({data, to.send(message_view(bytes, payload_, pp_.device(), stream_), tag)});
    reap(false);
  }
  // Releases the sends that are done (all: waits for every one).
  void reap(bool all) {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (!all && !it->second->test()) {
        ++it;
        continue;
      }
      it->second->wait_host(pp_.info().timeout);  // rethrows a transport error
      const void* data = it->first;
      it = pending_.erase(it);
      if (sent_) sent_(data);
    }
    while (!announced_.empty() && (all || announced_.front().second->test())) {
      announced_.front().second->wait_host(control_->info().timeout);
      announced_.pop_front();
    }
  }

 private:
  Communicator& pp_;
  std::size_t payload_;
  void* stream_;
  StageSent sent_;
  Ends ends_;
  Communicator* control_;
  std::unique_ptr<DeviceMemory> token_;
  std::list<std::pair<const void*, std::shared_ptr<Work>>> pending_;
  std::deque<std::pair<std::shared_ptr<Header>, std::shared_ptr<Work>>> announced_;
};

// The messages one link brings to a schedule that knows their order (1F1B, interleaved): `ids`
// in the order the stage uses them, all of one kind from one neighbour, so the one after the
// message taken is always the one that really comes next on that link (same size, same
// sender). Two buffers: taking message i first posts message i + 1 into the other one (whose
// message i - 1 the stage has copied out: on a stream-ordered transport the receive is ordered
// after the stage's stream as it stands, which holds that copy), then waits for message i, so
// the transfer of i + 1 overlaps the compute of i. On a line shared with other messages where
// the transport matches in issue order (NCCL's pp without links) a receive is posted only when
// its message is needed: one posted ahead there would hold up the ops queued behind it.
class Inbox {
 public:
  Inbox(Communicator& pp, const Endpoint& from, std::int64_t kind, std::vector<int> ids, const PipelineConfig& cfg,
        PipelineStats& st)
      : pp_(pp), from_(from), kind_(kind), ids_(std::move(ids)), st_(st),
        ahead_(from.comm != &pp || pp.matches_tags()) {
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(cfg.payload_bytes, pp.device(), cfg.stream);
    if (ahead_ && !ids_.empty()) post();  // the first one, before any compute
  }
  // The bytes of message `id`, which must be the next one (the schedule's own order).
  const void* take(int id) {
    const int n = static_cast<int>(ids_.size());
    GW_CHECK(taken_ < n && ids_[taken_] == id, "pipeline: " << kind_name(kind_) << " " << id
                                                              << " taken out of the order its link brings them");
    if (posted_ == taken_) post();                               // not posted ahead: now
    if (ahead_ && posted_ == taken_ + 1 && posted_ < n) post();  // the next, before this one's compute
    const int k = taken_ % 2;
    {
      Timer t(st_.wait_s);  // stream-ordered where the transport is: the stage's stream waits, the host goes on
      posted_work_[k]->wait(pp_.info().timeout);
    }
    if (posted_at_[k] < computed(st_)) ++st_.posted_ahead;
    ++st_.messages;
    ++taken_;
    return bufs_[k].data();
  }

 private:
  void post() {
    const int k = posted_ % 2;
    posted_work_[k] = from_.recv(bufs_[k].view, ordered_tag(kind_, ids_[posted_]));
    posted_at_[k] = computed(st_);
    ++posted_;
  }
  Communicator& pp_;
  Endpoint from_;
  std::int64_t kind_;
  std::vector<int> ids_;
  PipelineStats& st_;
  bool ahead_;
  std::vector<MessageBuffer> bufs_;
  std::shared_ptr<Work> posted_work_[2];
  int posted_at_[2] = {0, 0};
  int posted_ = 0, taken_ = 0;
};

// The message-driven schedule's messages carry no header either: stage 0 injects microbatches
// in order and every stage passes each kind on in the order it took it, so a neighbour's
// messages of one kind come in microbatch order, and who sent a message (prev: an activation,
// next: a gradient) and how many came from there before say what it is.
class Arrivals {
 public:
  Arrivals(int prev, int next) : prev_(prev), next_(next) {}
  std::pair<std::int64_t, int> of(int from) {
    GW_CHECK(from >= 0 && (from == prev_ || from == next_),
             "pipeline: a message came from stage " << from << ", not a neighbour of this stage");
    return from == prev_ ? std::make_pair(std::int64_t{kActivation}, from_prev_++)
                         : std::make_pair(std::int64_t{kGradient}, from_next_++);
  }
  // The same, checked against what the message was said to be (an announcement, a leader's word).
  void expect(int from, std::int64_t kind, int mb) {
    const auto [k, m] = of(from);
    GW_CHECK(k == kind && m == mb, "pipeline: stage " << from << " was said to send " << kind_name(kind)
                                                      << " of microbatch " << mb << ", but its next message is "
                                                      << kind_name(k) << " of microbatch " << m);
  }

 private:
  int prev_, next_;
  int from_prev_ = 0, from_next_ = 0;
};

// Receives the next message from stage `from` into buf and waits for it (stream-ordered where
// the transport is: its buffer is filled again only after that stream has used it).
void receive_from(const Communicator& pp, const Ends& ends, int from, const MessageBuffer& buf) {
  ends.from(from).recv(buf.view, kTag)->wait(pp.info().timeout);
}

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
  AnyReceiver(Communicator& pp, const PipelineConfig& cfg, std::vector<int> peers, int expected, const Ends& ends,
              const PipelineStats& st)
      : pp_(pp), peers_(std::move(peers)), left_(expected), order_(ends.prev, ends.next), st_(st) {
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(cfg.payload_bytes, pp.device(), cfg.stream);
    post();
  }
  Delivered next() override {
    posted_->wait_host(pp_.info().timeout);
    const int from = posted_->source();
    const MessageBuffer& msg = bufs_[cur_];
    const int posted_at = posted_at_;
    cur_ ^= 1;
    if (--left_ > 0) post();  // before this message's compute
    const auto [kind, mb] = order_.of(from);
    return {msg.data(), kind, mb, posted_at};
  }

 private:
  void post() {
    posted_ = pp_.recv_any(bufs_[cur_].view, peers_, kTag);
    posted_at_ = computed(st_);
  }
  Communicator& pp_;
  std::vector<int> peers_;
  int left_;
  Arrivals order_;
  const PipelineStats& st_;
  std::vector<MessageBuffer> bufs_;
  std::shared_ptr<Work> posted_;
  int posted_at_ = 0;
  int cur_ = 0;
};

// One receive posted per neighbour, polled; whichever completes first is taken and re-posted.
class PerPeerReceiver : public Receiver {
 public:
  PerPeerReceiver(Communicator& pp, const PipelineConfig& cfg, const Ends& ends, std::vector<int> peers,
                  const PipelineStats& st)
      : pp_(pp), peers_(std::move(peers)), left_(peers_.size(), cfg.microbatches), cur_(peers_.size(), 0),
        posted_(peers_.size()), posted_at_(peers_.size(), 0), order_(ends.prev, ends.next), ends_(ends),
        stage_(cfg.stage), st_(st) {
    for (std::size_t k = 0; k < 2 * peers_.size(); ++k) bufs_.emplace_back(cfg.payload_bytes, pp.device(), cfg.stream);
    for (std::size_t k = 0; k < peers_.size(); ++k)
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
    const MessageBuffer& msg = bufs_[2 * k + cur_[k]];
    const int posted_at = posted_at_[k];
    cur_[k] ^= 1;
    if (--left_[k] > 0) post(k);
    const auto [kind, mb] = order_.of(peers_[k]);
    return {msg.data(), kind, mb, posted_at};
  }

 private:
  void post(std::size_t k) {
    posted_[k] = ends_.from(peers_[k]).recv(bufs_[2 * k + cur_[k]].view, kTag);
    posted_at_[k] = computed(st_);
  }
  Communicator& pp_;
  std::vector<int> peers_;
  std::vector<int> left_, cur_;
  std::vector<std::shared_ptr<Work>> posted_;
  std::vector<int> posted_at_;
  Arrivals order_;
  Ends ends_;
  int stage_;
  const PipelineStats& st_;
  std::vector<MessageBuffer> bufs_;
};

// The transport's messages are announced on a host control channel that can receive from
// any peer: a receive-from-any on headers says which neighbour sends next, and the data
// receive is posted for exactly that message. No data receive is ever posted ahead of its
// send, so none can hold up a send queued behind it (NCCL has no receive-from-any).
class AnnouncedReceiver : public Receiver {
 public:
  AnnouncedReceiver(Communicator& pp, Communicator& control, const PipelineConfig& cfg, const Ends& ends,
                    std::vector<int> peers, int expected, const PipelineStats& st)
      : pp_(pp), control_(control), ends_(ends), peers_(std::move(peers)), left_(expected),
        order_(ends.prev, ends.next), st_(st), headers_(2) {
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(cfg.payload_bytes, pp.device(), cfg.stream);
    post();
  }
  Delivered next() override {
    announced_->wait_host(control_.info().timeout);
    const int from = announced_->source();
    const std::int64_t kind = headers_[cur_].kind();  // the announcement's: host memory
    const int mb = headers_[cur_].mb();
    const MessageBuffer& msg = bufs_[cur_];
    cur_ ^= 1;
    if (--left_ > 0) post();  // the next announcement is awaited while this message is used
    order_.expect(from, kind, mb);
    const int posted_at = computed(st_);
    receive_from(pp_, ends_, from, msg);
    return {msg.data(), kind, mb, posted_at};
  }

 private:
  void post() { announced_ = control_.recv_any(headers_[cur_].view(), peers_, kControlTag); }
  Communicator& pp_;
  Communicator& control_;
  Ends ends_;
  std::vector<int> peers_;
  int left_;
  Arrivals order_;
  const PipelineStats& st_;
  std::vector<Header> headers_;
  std::vector<MessageBuffer> bufs_;
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
  LeadReceiver(std::unique_ptr<Receiver> inner, Communicator& group) : inner_(std::move(inner)), group_(group) {}
  Delivered next() override {
    Delivered got = inner_->next();
    said_ = Header(got.kind, got.mb);
    group_.broadcast(said_.view(), 0, false)->wait_host(group_.info().timeout);
    return got;
  }

 private:
  std::unique_ptr<Receiver> inner_;
  Communicator& group_;
  Header said_;
};

class FollowReceiver : public Receiver {
 public:
  FollowReceiver(Communicator& group, Communicator& pp, Communicator* control, const PipelineConfig& cfg,
                 const Ends& ends, const PipelineStats& st)
      : group_(group), pp_(pp), control_(control), ends_(ends), order_(ends.prev, ends.next), st_(st) {
    for (int k = 0; k < 2; ++k) bufs_.emplace_back(cfg.payload_bytes, pp.device(), cfg.stream);
  }
  Delivered next() override {
    group_.broadcast(said_.view(), 0, false)->wait_host(group_.info().timeout);
    const std::int64_t kind = said_.kind();
    const int mb = said_.mb();
    const int from = kind == kActivation ? ends_.prev : ends_.next;
    GW_CHECK(from >= 0, "pipeline: the stage's leader took kind " << kind << " of microbatch " << mb
                                                                 << ", which no neighbour of this stage sends");
    if (control_ != nullptr) {  // the announcement the sender made of it, taken from that sender
      control_->recv(header_.view(), from, kControlTag)->wait_host(control_->info().timeout);
      GW_CHECK(header_.kind() == kind && header_.mb() == mb,
               "pipeline: the stage's leader took " << kind_name(kind) << " of microbatch " << mb << ", stage " << from
                                                    << " announced " << kind_name(header_.kind()) << " of microbatch "
                                                    << header_.mb() << " to this member");
    }
    order_.expect(from, kind, mb);
    const MessageBuffer& msg = bufs_[cur_];
    cur_ ^= 1;
    const int posted_at = computed(st_);
    receive_from(pp_, ends_, from, msg);
    return {msg.data(), kind, mb, posted_at};
  }

 private:
  Communicator& group_;
  Communicator& pp_;
  Communicator* control_;
  Ends ends_;
  Arrivals order_;
  const PipelineStats& st_;
  Header said_, header_;
  std::vector<MessageBuffer> bufs_;
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
  Outbox out(pp, cfg, ends, how == ReceiveStrategy::Announced ? control : nullptr);
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
    out.send(kActivation, mb, y, kTag);
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
    in = std::make_unique<FollowReceiver>(*stage_group, pp, how == ReceiveStrategy::Announced ? control : nullptr, cfg,
                                          ends, st);
  } else if (expected > 0) {
    if (how == ReceiveStrategy::Any) in = std::make_unique<AnyReceiver>(pp, cfg, peers, expected, ends, st);
    else if (how == ReceiveStrategy::Announced)
      in = std::make_unique<AnnouncedReceiver>(pp, *control, cfg, ends, peers, expected, st);
    else in = std::make_unique<PerPeerReceiver>(pp, cfg, ends, peers, st);
    if (agree) in = std::make_unique<LeadReceiver>(std::move(in), *stage_group);
  }
  while (expected > 0) {
    Delivered got;
    {
      Timer t(st.wait_s);
      got = in->next();
    }
    const int mb = got.mb;
    --expected;
    ++st.messages;
    if (got.posted_at < computed(st)) ++st.posted_ahead;
    if (got.kind == kActivation) {  // from s-1: forward
      const void* y;
      {
        Timer t(st.compute_s);
        y = forward(mb, got.data);
      }
      ++st.forwards;
      if (s == last) {
        const void* g;
        {
          Timer t(st.compute_s);
          g = backward(mb, nullptr);
        }
        ++st.backwards;
        out.send(kGradient, mb, g, kTag);
      } else {
        out.send(kActivation, mb, y, kTag);
      }
    } else {  // from s+1: backward
      const void* g;
      {
        Timer t(st.compute_s);
        g = backward(mb, got.data);
      }
      ++st.backwards;
      if (s == 0) {
        if (next_mb < cfg.microbatches) inject();
      } else {
        out.send(kGradient, mb, g, kTag);
      }
    }
    out.reap(false);
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
  Outbox out(pp, cfg, ends);
  std::vector<int> order(m);
  for (int mb = 0; mb < m; ++mb) order[mb] = mb;  // both kinds come in microbatch order
  // made (and their first receives posted) before any compute
  std::unique_ptr<Inbox> acts = s > 0 ? std::make_unique<Inbox>(pp, ends.from_prev, kActivation, order, cfg, st) : nullptr;
  std::unique_ptr<Inbox> grads =
      s < last ? std::make_unique<Inbox>(pp, ends.from_next, kGradient, order, cfg, st) : nullptr;
  auto do_forward = [&](int mb) {
    const void* x = acts ? acts->take(mb) : nullptr;
    const void* y;
    {
      Timer t(st.compute_s);
      y = forward(mb, x);
    }
    ++st.forwards;
    if (s < last) out.send(kActivation, mb, y, ordered_tag(kActivation, mb));
    out.reap(false);
  };
  auto do_backward = [&](int mb) {
    const void* g = grads ? grads->take(mb) : nullptr;
    const void* dx;
    {
      Timer t(st.compute_s);
      dx = backward(mb, g);
    }
    ++st.backwards;
    if (s > 0) out.send(kGradient, mb, dx, ordered_tag(kGradient, mb));
    out.reap(false);
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
  auto head = [&](int c) { return first_virtual && c == 0; };     // its input is the batch's
  auto tail = [&](int c) { return last_virtual && c == v - 1; };  // its output is the loss
  // activations to next / from prev, gradients to prev / from next; with two stages next and
  // prev are one rank, and the kinds stay apart by link (by tag where tags match messages)
  const Ends ends = ends_of(pp, links, prev, next);
  Outbox out(pp, cfg, ends);
  // what each link brings, in the order the stage takes it: the input of chunk c (from the
  // previous stage's chunk c, or on stage 0 the last stage's chunk c - 1), the gradient of its output
  std::vector<int> act_ids, grad_ids;
  for (int k = 0; k < total; ++k) {
    if (!head(chunk_f(k))) act_ids.push_back(mb_of(k) * v + chunk_f(k));
    if (!tail(chunk_b(k))) grad_ids.push_back(mb_of(k) * v + chunk_b(k));
  }
  Inbox acts(pp, ends.from_prev, kActivation, act_ids, cfg, st);
  Inbox grads(pp, ends.from_next, kGradient, grad_ids, cfg, st);
  auto send = [&](std::int64_t kind, int mb, int c, const void* data) {
    out.send(kind, mb * v + c, data, ordered_tag(kind, mb * v + c));
  };
  auto do_forward = [&](int k) {
    const int mb = mb_of(k), c = chunk_f(k);
    const void* x = head(c) ? nullptr : acts.take(mb * v + c);
    const void* y;
    {
      Timer t(st.compute_s);
      y = forward(mb, c, x);
    }
    ++st.forwards;
    if (!tail(c)) send(kActivation, mb, last_virtual ? c + 1 : c, y);
    out.reap(false);
  };
  auto do_backward = [&](int k) {
    const int mb = mb_of(k), c = chunk_b(k);
    const void* g = tail(c) ? nullptr : grads.take(mb * v + c);
    const void* dx;
    {
      Timer t(st.compute_s);
      dx = backward(mb, c, g);
    }
    ++st.backwards;
    if (!head(c)) send(kGradient, mb, first_virtual ? c - 1 : c, dx);
    out.reap(false);
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

PipelineStats run_table(Communicator& pp, const PipelineConfig& cfg, int chunks, ChunkPlacement placement,
                        const std::vector<StageOp>& ops, const ChunkForward& forward, const SplitBackward& backward,
                        const ChunkWeight& weight, const StageLinks& links) {
  check(cfg, pp);
  const int p = cfg.stages, s = cfg.stage, v = chunks;
  const bool vee = placement == ChunkPlacement::V;
  GW_CHECK(p >= 2, "pipeline table: needs at least 2 stages, got " << p);
  GW_CHECK(v >= 1 && (!vee || v == 2), "pipeline table: a V places 2 chunks a stage, got " << v);
  PipelineStats st;
  const int last_virtual = p * v - 1;
  auto virt = [&](int c) { return vee ? (c == 0 ? s : 2 * p - 1 - s) : c * p + s; };
  auto stage_of = [&](int u) { return vee ? (u < p ? u : 2 * p - 1 - u) : u % p; };
  auto chunk_of = [&](int u) { return vee ? (u < p ? 0 : 1) : u / p; };
  // Loop: every chunk's activations come from the previous stage and go to the next. V: chunk 0's
  // so too, chunk 1's the other way (act_* and grad_* ends); on the last stage neither leaves.
  const Ends ends = vee ? ends_of(pp, links, s > 0 ? s - 1 : -1, s < p - 1 ? s + 1 : -1)
                        : ends_of(pp, links, (s + p - 1) % p, (s + 1) % p);
  const Endpoint act_to_prev = end_towards(pp, links.act_to_prev, vee && s > 0 ? s - 1 : -1);
  const Endpoint act_from_next = end_towards(pp, links.act_from_next, vee && s < p - 1 ? s + 1 : -1);
  const Endpoint grad_to_next = end_towards(pp, links.grad_to_next, vee && s < p - 1 ? s + 1 : -1);
  const Endpoint grad_from_prev = end_towards(pp, links.grad_from_prev, vee && s > 0 ? s - 1 : -1);
  auto act_in = [&](int c) -> const Endpoint& { return vee && c == 1 ? act_from_next : ends.from_prev; };
  auto act_out = [&](int c) -> const Endpoint& { return vee && c == 1 ? act_to_prev : ends.to_next; };
  auto grad_in = [&](int c) -> const Endpoint& { return vee && c == 1 ? grad_from_prev : ends.from_next; };
  auto grad_out = [&](int c) -> const Endpoint& { return vee && c == 1 ? grad_to_next : ends.to_prev; };
  auto box = [&](int c) { return vee ? c : 0; };  // a Loop's link brings every chunk's messages
  // What each link brings, in the order the table takes it (message id: micro-batch * chunks +
  // the receiving chunk, as run_interleaved numbers them)
  std::vector<int> act_ids[2], grad_ids[2];
  for (const StageOp& op : ops) {
    GW_CHECK(op.chunk >= 0 && op.chunk < v && op.microbatch >= 0 && op.microbatch < cfg.microbatches,
             "pipeline table: op (chunk " << op.chunk << ", micro-batch " << op.microbatch << ") outside "
                                          << v << " chunks and " << cfg.microbatches << " micro-batches");
    const int u = virt(op.chunk), id = op.microbatch * v + op.chunk;
    if (op.kind == StageOpKind::F && u > 0 && stage_of(u - 1) != s) act_ids[box(op.chunk)].push_back(id);
    if ((op.kind == StageOpKind::B || op.kind == StageOpKind::BW) && u < last_virtual && stage_of(u + 1) != s)
      grad_ids[box(op.chunk)].push_back(id);
  }
  std::unique_ptr<Inbox> acts[2], grads[2];
  for (int k = 0; k < (vee ? 2 : 1); ++k) {
    if (!act_ids[k].empty()) acts[k] = std::make_unique<Inbox>(pp, act_in(k), kActivation, act_ids[k], cfg, st);
    if (!grad_ids[k].empty()) grads[k] = std::make_unique<Inbox>(pp, grad_in(k), kGradient, grad_ids[k], cfg, st);
  }
  Outbox out(pp, cfg, ends);
  std::map<int, const void*> local_act, local_grad;  // the V's turn on the last stage, by message id
  auto handed = [&](std::map<int, const void*>& local, int id) {
    auto it = local.find(id);
    GW_CHECK(it != local.end(), "pipeline table: message " << id << " is used before the op that makes it");
    const void* data = it->second;
    local.erase(it);
    return data;
  };
  auto release = [&](const void* data) {
    if (cfg.sent) cfg.sent(data);
  };
  for (const StageOp& op : ops) {
    const int c = op.chunk, mb = op.microbatch, u = virt(c), id = mb * v + c;
    if (op.kind == StageOpKind::F) {
      const bool local = u > 0 && stage_of(u - 1) == s;
      const void* x = u == 0 ? nullptr : local ? handed(local_act, id) : acts[box(c)]->take(id);
      const void* y;
      {
        Timer t(st.compute_s);
        y = forward(mb, c, x);
      }
      ++st.forwards;
      if (local) release(x);  // the callback copied it: the hand-off's bytes may go
      if (u < last_virtual) {
        const int to = mb * v + chunk_of(u + 1);
        if (stage_of(u + 1) == s) local_act[to] = y;
        else out.send_to(act_out(c), stage_of(u + 1), kActivation, to, y, ordered_tag(kActivation, to));
      }
    } else if (op.kind == StageOpKind::W) {
      {
        Timer t(st.compute_s);
        weight(mb, c);
      }
      ++st.weights;
    } else {
      const bool local = u < last_virtual && stage_of(u + 1) == s;
      const void* g = u == last_virtual ? nullptr : local ? handed(local_grad, id) : grads[box(c)]->take(id);
      const void* dx;
      {
        Timer t(st.compute_s);
        dx = backward(mb, c, g, op.kind == StageOpKind::B);
      }
      ++st.backwards;
      if (local) release(g);
      if (u > 0) {
        const int to = mb * v + chunk_of(u - 1);
        if (stage_of(u - 1) == s) local_grad[to] = dx;
        else out.send_to(grad_out(c), stage_of(u - 1), kGradient, to, dx, ordered_tag(kGradient, to));
      }
    }
    out.reap(false);
  }
  GW_CHECK(local_act.empty() && local_grad.empty(), "pipeline table: a hand-off on the last stage was never used");
  out.reap(true);
  return st;
}

}  // namespace gridweave
