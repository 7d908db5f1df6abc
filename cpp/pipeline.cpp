#include "pipeline.h"

#include <chrono>
#include <cstring>
#include <deque>

#include "error.h"

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
  GW_CHECK(c.payload_bytes > 0 && c.payload_bytes % 8 == 0, "pipeline: payload of " << c.payload_bytes
                                                                                     << " bytes must be a positive multiple of 8");
}

// A pipeline message viewed as int64 words: [kind, microbatch, payload...].
struct StageMessage {
  std::vector<std::int64_t> words;
  explicit StageMessage(std::size_t payload_bytes) : words(2 + payload_bytes / 8) {}
  BufferView view() { return {words.data(), words.size(), DType::Int64}; }
  void* payload() { return words.data() + 2; }
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
    auto m = std::make_shared<StageMessage>(payload_);
    m->words[0] = kind;
    m->words[1] = mb;
    std::memcpy(m->payload(), data, payload_);
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
  StageMessage bufs[2] = {StageMessage(cfg.payload_bytes), StageMessage(cfg.payload_bytes)};
  int cur = 0;
  std::shared_ptr<Work> posted;
  if (expected > 0) posted = pp.recv_any(bufs[cur].view(), peers, kTag);
  while (expected > 0) {
    {
      Timer t(st.wait_s);
      posted->wait(pp.info().timeout);
    }
    StageMessage& msg = bufs[cur];
    --expected;
    ++st.messages;
    cur ^= 1;  // keep a receive posted while this message is computed on
    if (expected > 0) posted = pp.recv_any(bufs[cur].view(), peers, kTag);
    const std::int64_t kind = msg.words[0];
    const int mb = static_cast<int>(msg.words[1]);
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
  StageMessage in(cfg.payload_bytes);
  auto receive = [&](int peer, std::int64_t kind, int mb) -> const void* {
    {
      Timer t(st.wait_s);
      pp.recv(in.view(), peer, kTag)->wait(pp.info().timeout);
    }
    ++st.messages;
    GW_CHECK(in.words[0] == kind && in.words[1] == mb,
             "1F1B stage " << s << " expected " << (kind == kActivation ? "activation" : "gradient") << " of microbatch "
                           << mb << ", got kind " << in.words[0] << " of microbatch " << in.words[1]);
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
