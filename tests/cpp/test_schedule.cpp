// Message schedules of the collectives: per-member bytes equal the textbook
// formulas, and every send has a matching receive.
#include <gtest/gtest.h>

#include <map>

#include "traffic.h"

using namespace gridweave;

namespace {
struct Totals {
  std::uint64_t sent = 0, recv = 0, sent_msgs = 0, recv_msgs = 0;
};
Totals totals(const std::vector<Message>& ms) {
  Totals t;
  for (auto& m : ms) (m.send ? t.sent : t.recv) += m.bytes, (m.send ? t.sent_msgs : t.recv_msgs) += 1;
  return t;
}
// Every (src -> dst, bytes) send appears as a (dst <- src, bytes) receive.
void expect_matched(OpKind op, int g, std::uint64_t nbytes, int root, int elem = 4) {
  std::map<std::tuple<int, int>, std::vector<std::uint64_t>> sends, recvs;
  for (int i = 0; i < g; ++i)
    for (auto& m : schedule(op, g, i, nbytes, root, elem)) {
      if (m.send) sends[{i, m.peer}].push_back(m.bytes);
      else recvs[{m.peer, i}].push_back(m.bytes);
    }
  for (auto& [k, v] : sends) std::sort(v.begin(), v.end());
  for (auto& [k, v] : recvs) std::sort(v.begin(), v.end());
  EXPECT_EQ(sends, recvs) << op_name(op) << " g=" << g;
}
}  // namespace

TEST(Schedule, RingAllGather) {
  for (int g : {2, 3, 4, 8}) {
    auto t = totals(schedule(OpKind::AllGather, g, 1 % g, 400, 0, 4));
    EXPECT_EQ(t.sent, (g - 1) * 400u);
    EXPECT_EQ(t.recv, (g - 1) * 400u);
    EXPECT_EQ(t.sent_msgs, static_cast<std::uint64_t>(g - 1));
  }
}

TEST(Schedule, RingReduceScatterAndAllReduce) {
  for (int g : {2, 4, 8}) {
    const std::uint64_t n = 4 * 8 * 10;  // divisible by g, 4-byte elements
    EXPECT_EQ(totals(schedule(OpKind::ReduceScatter, g, 0, n, 0, 4)).sent, (g - 1) * n / g);
    EXPECT_EQ(totals(schedule(OpKind::AllReduce, g, 0, n, 0, 4)).sent, 2 * (g - 1) * n / g);  // 2(g-1)/g * N
  }
}

TEST(Schedule, BinomialBroadcastSendsGMinus1Messages) {
  for (int g : {2, 3, 5, 8}) {
    std::uint64_t msgs = 0;
    for (int i = 0; i < g; ++i) {
      auto t = totals(schedule(OpKind::Broadcast, g, i, 100, 1 % g));
      msgs += t.sent_msgs;
      EXPECT_EQ(t.recv_msgs, i == 1 % g ? 0u : 1u);
    }
    EXPECT_EQ(msgs, static_cast<std::uint64_t>(g - 1));
  }
}

TEST(Schedule, EverySendIsReceived) {
  for (int g : {2, 3, 4, 7, 8})
    for (OpKind op : {OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce, OpKind::Broadcast, OpKind::Reduce,
                      OpKind::Gather, OpKind::Scatter, OpKind::AllToAll})
      expect_matched(op, g, 4 * g * 6, g - 1);
}

TEST(Schedule, UnevenAllReduceCutsWholeElements) {
  // 5 float32 elements over 8 members: chunks of 1 element or empty, never 2.5 bytes.
  for (auto& m : schedule(OpKind::AllReduce, 8, 3, 20, 0, 4)) EXPECT_TRUE(m.bytes == 0 || m.bytes == 4);
}
