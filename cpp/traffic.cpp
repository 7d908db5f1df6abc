#include "traffic.h"

#include <algorithm>

#include "error.h"

namespace gridweave {

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::AllGather: return "all_gather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::Reduce: return "reduce";
    case OpKind::Scatter: return "scatter";
    case OpKind::Gather: return "gather";
    case OpKind::AllToAll: return "all_to_all";
    case OpKind::Send: return "send";
    case OpKind::Recv: return "recv";
    case OpKind::Barrier: return "barrier";
  }
  return "unknown";
}

OpKind op_from_name(const std::string& name) {
  for (int k = 0; k <= static_cast<int>(OpKind::Barrier); ++k) {
    if (name == op_name(static_cast<OpKind>(k))) return static_cast<OpKind>(k);
  }
  GW_CHECK(false, "unknown collective '" << name << "'");
}

namespace {

// Bytes of chunk c when `total` bytes of `elem`-byte elements are cut into `n`
// chunks of whole elements (the first ones one element larger).
std::uint64_t chunk_bytes(std::uint64_t total, int n, int c, int elem) {
  std::uint64_t count = total / elem, base = count / n, extra = count % n;
  return (base + (static_cast<std::uint64_t>(c) < extra ? 1 : 0)) * elem;
}

int mod(int a, int n) { return ((a % n) + n) % n; }

// Ring reduce-scatter of `total` bytes: at step s member i sends chunk i-s-1 to i+1
// and receives chunk i-s-2 from i-1.
void ring_reduce_scatter(std::vector<Message>& out, int g, int i, std::uint64_t total, int dir, int elem) {
  for (int s = 0; s < g - 1; ++s) {
    out.push_back({mod(i + dir, g), chunk_bytes(total, g, mod(i - s - 1, g), elem), true});
    out.push_back({mod(i - dir, g), chunk_bytes(total, g, mod(i - s - 2, g), elem), false});
  }
}

}  // namespace

std::vector<Message> schedule(OpKind op, int g, int i, std::uint64_t nbytes, int root, int elem) {
  if (elem < 1) elem = 1;
  std::vector<Message> out;
  if (g <= 1 && op != OpKind::Send && op != OpKind::Recv) return out;
  switch (op) {
    case OpKind::AllGather:  // ring: g-1 steps, each forwards one member's block
      for (int s = 0; s < g - 1; ++s) {
        out.push_back({mod(i + 1, g), nbytes, true});
        out.push_back({mod(i - 1, g), nbytes, false});
      }
      break;
    case OpKind::ReduceScatter:
      ring_reduce_scatter(out, g, i, nbytes, +1, elem);
      break;
    case OpKind::AllReduce:  // ring reduce-scatter then ring all-gather of the reduced chunks
      ring_reduce_scatter(out, g, i, nbytes, +1, elem);
      for (int s = 0; s < g - 1; ++s) {
        out.push_back({mod(i + 1, g), chunk_bytes(nbytes, g, mod(i - s, g), elem), true});
        out.push_back({mod(i - 1, g), chunk_bytes(nbytes, g, mod(i - s - 1, g), elem), false});
      }
      break;
    case OpKind::Broadcast: {  // binomial tree rooted at `root`
      int v = mod(i - root, g);
      for (int bit = 1; bit < g; bit <<= 1) {
        if (v < bit && v + bit < g) out.push_back({mod(v + bit + root, g), nbytes, true});
        else if (v >= bit && v < 2 * bit) out.push_back({mod(v - bit + root, g), nbytes, false});
      }
      break;
    }
    case OpKind::Reduce:  // ring reduce-scatter towards i-1, then each chunk to the root
      ring_reduce_scatter(out, g, i, nbytes, -1, elem);
      if (i == root) {
        for (int p = 0; p < g; ++p)
          if (p != root) out.push_back({p, chunk_bytes(nbytes, g, p, elem), false});
      } else {
        out.push_back({root, chunk_bytes(nbytes, g, i, elem), true});
      }
      break;
    case OpKind::Gather:
      if (i == root) {
        for (int p = 0; p < g; ++p)
          if (p != root) out.push_back({p, nbytes, false});
      } else {
        out.push_back({root, nbytes, true});
      }
      break;
    case OpKind::Scatter:
      if (i == root) {
        for (int p = 0; p < g; ++p)
          if (p != root) out.push_back({p, nbytes, true});
      } else {
        out.push_back({root, nbytes, false});
      }
      break;
    case OpKind::AllToAll:
      for (int p = 0; p < g; ++p) {
        if (p == i) continue;
        out.push_back({p, nbytes / g, true});
        out.push_back({p, nbytes / g, false});
      }
      break;
    case OpKind::Send:
      out.push_back({root, nbytes, true});
      break;
    case OpKind::Recv:
      out.push_back({root, nbytes, false});
      break;
    case OpKind::Barrier:
      break;
  }
  return out;
}

void TrafficCounters::record(const std::string& axis, const std::vector<Message>& messages,
                             const std::vector<bool>& peer_is_intra) {
  std::lock_guard<std::mutex> lock(mu_);
  AxisCounters& c = by_axis_[axis];
  c.ops += 1;
  for (const Message& m : messages) {
    bool intra = peer_is_intra.at(m.peer);
    Tally& t = m.send ? (intra ? c.sent_intra : c.sent_inter) : (intra ? c.recv_intra : c.recv_inter);
    t.messages += 1;
    t.bytes += m.bytes;
  }
}

std::map<std::string, AxisCounters> TrafficCounters::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_axis_;
}

void TrafficCounters::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  by_axis_.clear();
}

}  // namespace gridweave
