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

constexpr int kTag = 7001;  // every pipeline message shares one slot; the header says what it is
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
      : mem(allocate(dev, 16 + payload_bytes)), words(2 + payload_bytes / 8), device(dev) {}
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

// Outgoing messages stay alive until their send completes.
class Outbox {
 public:
  Outbox(Communicator& pp, std::size_t payload) : pp_(pp), payload_(payload) {}
  void send(int peer, std::int64_t kind, int mb, const void* data) {
    auto m = std::make_shared<StageMessage>(payload_, pp_.device());
    m->set(kind, mb, data, payload_);
    pending_.push_back({m, pp_.send(m->view(), peer, kTag)});
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
  std::deque<std::pair<std::shared_ptr<StageMessage>, std::shared_ptr<Work>>> pending_;
};

}  // namespace

PipelineStats run_message_driven(Communicator& pp, const PipelineConfig& cfg, const StageForward& forward,
                                 const StageBackward& backward) {
  check(cfg, pp);
  PipelineStats st;
  const int s = cfg.stage, last = cfg.stages - 1;
  Outbox out(pp, cfg.payload_bytes);
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
  // Gloo: one receive-from-any on both neighbours, double-buffered. Transports without
  // receive-from-any (NCCL): one receive posted per neighbour (each on its own stream
  // there), polled by events; whichever completes first is processed and re-posted.
  GW_CHECK(cfg.receive != ReceiveStrategy::Any || pp.can_recv_any(),
           "the " << pp.backend() << " transport cannot receive from any peer; use the per-peer strategy");
  const bool any = cfg.receive == ReceiveStrategy::Any || (cfg.receive == ReceiveStrategy::Auto && pp.can_recv_any());
  std::vector<StageMessage> bufs;
  for (std::size_t k = 0; k < (any ? 2 : 2 * peers.size()); ++k) bufs.emplace_back(cfg.payload_bytes, pp.device());
  std::vector<std::shared_ptr<Work>> posted(any ? 1 : peers.size());
  std::vector<int> cur(posted.size(), 0);
  auto post = [&](std::size_t k) {
    StageMessage& b = bufs[2 * (any ? 0 : k) + cur[k]];
    posted[k] = any ? pp.recv_any(b.view(), peers, kTag) : pp.recv(b.view(), peers[k], kTag);
  };
  // Messages still to come per receive slot (a neighbour sends m of them).
  std::vector<int> left(posted.size(), any ? expected : cfg.microbatches);
  for (std::size_t k = 0; k < posted.size() && expected > 0; ++k) post(k);
  while (expected > 0) {
    std::size_t k = 0;
    {
      Timer t(st.wait_s);
      if (any) {
        posted[0]->wait(pp.info().timeout);
      } else {
        const auto deadline = Clock::now() + pp.info().timeout;
        for (bool done = false; !done;) {
          for (k = 0; k < posted.size(); ++k)
            if (left[k] > 0 && posted[k]->test()) {
              done = true;
              break;
            }
          if (!done) {
            if (Clock::now() > deadline)
              throw Error(ErrorKind::Timeout, "gridweave: pipeline stage " + std::to_string(s) +
                                                  " waited past its timeout for a neighbour's message");
            std::this_thread::sleep_for(std::chrono::microseconds(50));
          }
        }
        posted[k]->wait(pp.info().timeout);  // rethrows a transport error
      }
    }
    StageMessage& msg = bufs[2 * (any ? 0 : k) + cur[k]];
    --expected;
    --left[k];
    ++st.messages;
    cur[k] ^= 1;  // keep a receive posted while this message is computed on
    if (left[k] > 0) post(k);
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

}  // namespace gridweave
