// Per-axis traffic counters, and the message schedule of each collective: the
// messages one member of a communicator sends and receives when it runs the op.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace gridweave {

enum class OpKind : int {
  AllGather = 0, ReduceScatter, AllReduce, Broadcast, Reduce, Scatter, Gather, AllToAll, Send, Recv, Barrier
};
const char* op_name(OpKind op);
OpKind op_from_name(const std::string& name);

// One message in a schedule: to (send) or from (recv) the member `peer`.
struct Message {
  int peer;
  std::uint64_t bytes;
  bool send;
};

// The messages member `me` of a `size`-member communicator exchanges in `op`.
// `nbytes` is this member's input bytes (for Scatter: its output bytes); chunks of
// the ring ops are cut on `elem_size`-byte element boundaries.
// Algorithms: ring all-gather and reduce-scatter; ring reduce-scatter + all-gather
// for all-reduce; binomial tree broadcast; ring reduce-scatter + gather to root for
// reduce; direct gather, scatter and all-to-all (the algorithms the Gloo and NCCL
// transports run for these ops).
std::vector<Message> schedule(OpKind op, int size, int me, std::uint64_t nbytes, int root, int elem_size = 1);

struct Tally {
  std::uint64_t messages = 0;
  std::uint64_t bytes = 0;
};

struct AxisCounters {
  std::uint64_t ops = 0;
  Tally sent_intra, sent_inter, recv_intra, recv_inter;
};

// Counters keyed by axis label ("y", "x,y", "world"); thread-safe.
class TrafficCounters {
 public:
  void record(const std::string& axis, const std::vector<Message>& messages, const std::vector<bool>& peer_is_intra);
  std::map<std::string, AxisCounters> snapshot() const;
  void reset();

 private:
  mutable std::mutex mu_;
  std::map<std::string, AxisCounters> by_axis_;
};

}  // namespace gridweave
