// Grid and placement math, and the traffic model against SUPER eqs. (4)-(7).
#include <gtest/gtest.h>

#include <set>

#include "error.h"
#include "placement.h"

using namespace gridweave;

TEST(Placement, NaiveIsRowMajorLastFastest) {
  Placement p({{"dp", 2}, {"z", 2}, {"y", 3}, {"x", 2}}, PlacementPolicy::Naive, 4);
  EXPECT_EQ(p.world_size(), 24);
  EXPECT_EQ(p.rank_of({0, 0, 0, 1}), 1);
  EXPECT_EQ(p.rank_of({0, 0, 1, 0}), 2);
  EXPECT_EQ(p.rank_of({1, 0, 0, 0}), 12);
  for (int r = 0; r < 24; ++r) EXPECT_EQ(p.rank_of(p.coords_of(r)), r);
  EXPECT_EQ(p.line(0, {"y"}), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(p.line(5, {"dp"}), (std::vector<int>{5, 17}));
  // Tuple lines are row-major over the tuple, first axis slowest.
  EXPECT_EQ(p.line(0, {"x", "y"}), (std::vector<int>{0, 2, 4, 1, 3, 5}));
  EXPECT_EQ(p.index_in_line(3, {"x", "y"}), 4);
}

TEST(Placement, LinesPartitionTheWorld) {
  Placement p({{"dp", 2}, {"pp", 3}, {"tp", 4}}, PlacementPolicy::Topology, 4);
  for (auto axes : std::vector<std::vector<std::string>>{{"dp"}, {"pp"}, {"tp"}, {"dp", "tp"}, {"tp", "pp", "dp"}}) {
    std::set<int> seen;
    int lines = 0;
    for (int r = 0; r < p.world_size(); ++r) {
      auto m = p.line(r, axes);
      EXPECT_EQ(m[p.index_in_line(r, axes)], r);
      if (p.line_id(r, axes) == r) {
        ++lines;
        for (int x : m) EXPECT_TRUE(seen.insert(x).second);
      }
    }
    EXPECT_EQ(static_cast<int>(seen.size()), p.world_size());
    int g = 1;
    for (auto& a : axes) g *= p.axis_size(a);
    EXPECT_EQ(lines, p.world_size() / g);
  }
}

TEST(Placement, TopologyPutsHeavyAxesInsideANode) {
  Placement p({{"sg", 4}, {"dp", 4}}, PlacementPolicy::Topology, 4);
  EXPECT_EQ(p.physical_order(), (std::vector<std::string>{"dp", "sg"}));
  auto m = p.line(6, {"sg"});
  for (int r : m) EXPECT_EQ(p.node_of(r), p.node_of(6));
  Placement n({{"sg", 4}, {"dp", 4}}, PlacementPolicy::Naive, 4);
  auto mn = n.line(6, {"sg"});
  std::set<int> nodes;
  for (int r : mn) nodes.insert(n.node_of(r));
  EXPECT_EQ(nodes.size(), 4u);  // naive: every member of a sub-communicator on its own node
}

TEST(Placement, BadInputIsAConfigError) {
  EXPECT_THROW(Placement({{"x", 0}}, PlacementPolicy::Naive, 1), Error);
  EXPECT_THROW(Placement({{"x", 2}, {"x", 2}}, PlacementPolicy::Naive, 1), Error);
  Placement p({{"x", 2}}, PlacementPolicy::Naive, 1);
  try {
    p.line(0, {"q"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("unknown axis 'q'"), std::string::npos);
  }
}

// SUPER §V. n processes, g sub-grids of n_g = n/g, n_node per node; a segmented
// all-to-all pattern: every process exchanges one message with each of the g
// members of its sub-communicator (Messages = n*g, eq. 3).
// The formulas assume one of n_g, n_node divides the other (and the same for g).
struct SuperCase {
  int n, n_node, g;
};

long long intra_naive(const SuperCase& c) {
  const int ng = c.n / c.g;
  // Eq. (4). As printed, its cases read "n_g <= n_node: n" and "n_g > n_node: n_node g";
  // counting messages in the naive layout (Fig. 11, sub-grids contiguous) gives those two
  // expressions with the conditions the other way round (they agree at n_g = n_node):
  // when a sub-grid spans whole nodes, the members of a sub-communicator sit on distinct
  // nodes and only the message to itself stays inside.
  return ng >= c.n_node ? c.n : static_cast<long long>(c.n_node) * c.g;
}
long long inter_naive(const SuperCase& c) {  // eq. (5), conditions as in intra_naive
  const int ng = c.n / c.g;
  return ng >= c.n_node ? static_cast<long long>(c.n) * (c.g - 1) : static_cast<long long>(c.n - c.n_node) * c.g;
}
long long intra_topo(const SuperCase& c) {  // eq. (6)
  return c.g <= c.n_node ? static_cast<long long>(c.n) * c.g : static_cast<long long>(c.n) * c.n_node;
}
long long inter_topo(const SuperCase& c) {  // eq. (7)
  return c.g <= c.n_node ? 0 : static_cast<long long>(c.n) * (c.g - c.n_node);
}

TEST(SuperTraffic, Equations4To7) {
  const std::vector<SuperCase> cases = {
      {8, 4, 2},  {8, 4, 4},  {8, 4, 8},   {8, 2, 4},    {16, 4, 2},   {16, 4, 4},   {16, 4, 8},   {16, 4, 16},
      {16, 8, 2}, {32, 4, 8}, {32, 8, 16}, {64, 4, 16},  {64, 8, 4},   {64, 8, 32},  {128, 4, 32}, {1024, 4, 4},
      {1024, 4, 256}, {1024, 8, 64}, {48, 6, 3}, {36, 6, 6}, {72, 6, 2}, {72, 6, 12}, {64, 16, 4}, {96, 12, 4},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("n=" + std::to_string(c.n) + " n_node=" + std::to_string(c.n_node) + " g=" + std::to_string(c.g));
    std::vector<Axis> axes = {{"sg", c.g}, {"dp", c.n / c.g}};
    const long long nbytes = 1 << 10;
    Placement naive(axes, PlacementPolicy::Naive, c.n_node);
    TrafficModel t = segmented_traffic(naive, {"sg"}, "all_to_all", nbytes);
    EXPECT_EQ(t.messages, static_cast<long long>(c.n) * c.g);  // eq. (3)
    EXPECT_EQ(t.intra_messages, intra_naive(c));
    EXPECT_EQ(t.inter_messages, inter_naive(c));
    EXPECT_EQ(t.intra_bytes + t.inter_bytes, t.messages * (nbytes / c.g));
    Placement topo(axes, PlacementPolicy::Topology, c.n_node);
    TrafficModel u = segmented_traffic(topo, {"sg"}, "all_gather", nbytes);
    EXPECT_EQ(u.messages, static_cast<long long>(c.n) * c.g);
    EXPECT_EQ(u.intra_messages, intra_topo(c));
    EXPECT_EQ(u.inter_messages, inter_topo(c));
    EXPECT_EQ(u.inter_bytes, u.inter_messages * nbytes);
  }
}

TEST(SuperTraffic, PrintedNaiveCasesAgreeAtTheBoundary) {
  // n_g == n_node: both readings of eqs. (4)-(5) give n intra and n(g-1) inter.
  for (SuperCase c : std::vector<SuperCase>{{16, 4, 4}, {64, 8, 8}, {32, 16, 2}}) {
    Placement naive({{"sg", c.g}, {"dp", c.n / c.g}}, PlacementPolicy::Naive, c.n_node);
    TrafficModel t = segmented_traffic(naive, {"sg"}, "all_gather", 64);
    EXPECT_EQ(t.intra_messages, c.n);
    EXPECT_EQ(t.intra_messages, static_cast<long long>(c.n_node) * c.g);
    EXPECT_EQ(t.inter_messages, static_cast<long long>(c.n) * (c.g - 1));
  }
}
