#include "placement.h"

#include <algorithm>
#include <numeric>

#include "error.h"

namespace gridweave {

int axis_traffic_weight(const std::string& name) {
  if (name == "dp") return 0;
  if (name == "pp") return 1;
  if (name == "sp") return 2;
  // The cube's axes as its choreography loads them: z carries about 3x y's bytes and y 3-10x x's
  // (recorded by the planner at hidden 256-4096; measured on 2 nodes by bench_cluster), so z
  // fills a node first and x is the one that crosses.
  if (name == "y") return 4;
  if (name == "z") return 5;
  return 3;  // tp, r, c, x, sg
}

Placement::Placement(std::vector<Axis> axes, PlacementPolicy policy, int ranks_per_node)
    : axes_(std::move(axes)), policy_(policy), ranks_per_node_(ranks_per_node) {
  GW_CHECK(!axes_.empty(), "a grid needs at least one axis");
  for (std::size_t a = 0; a < axes_.size(); ++a) {
    GW_CHECK(axes_[a].size >= 1, "axis '" << axes_[a].name << "' has size " << axes_[a].size << "; sizes must be >= 1");
    for (std::size_t b = 0; b < a; ++b) GW_CHECK(axes_[a].name != axes_[b].name, "axis '" << axes_[a].name << "' given twice");
    world_size_ *= axes_[a].size;
  }
  GW_CHECK(ranks_per_node_ >= 1, "ranks_per_node must be >= 1, got " << ranks_per_node_);

  std::vector<int> order(axes_.size());
  std::iota(order.begin(), order.end(), 0);
  if (policy_ == PlacementPolicy::Topology) {
    // Heaviest axes fastest-varying, so their lines fill a node first (SUPER §V:
    // with "sg" fastest, sub-grids are spread round-robin over the nodes).
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return axis_traffic_weight(axes_[a].name) < axis_traffic_weight(axes_[b].name);
    });
  }
  stride_.assign(axes_.size(), 0);
  int stride = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    stride_[*it] = stride;
    stride *= axes_[*it].size;
  }
  for (int a : order) physical_order_.push_back(axes_[a].name);
}

int Placement::axis_index(const std::string& name) const {
  for (std::size_t a = 0; a < axes_.size(); ++a)
    if (axes_[a].name == name) return static_cast<int>(a);
  std::string known;
  for (const auto& ax : axes_) known += (known.empty() ? "" : ", ") + ax.name;
  GW_CHECK(false, "unknown axis '" << name << "'; this grid has axes: " << known);
}

std::vector<int> Placement::coords_of(int rank) const {
  GW_CHECK(rank >= 0 && rank < world_size_, "rank " << rank << " is outside the grid of " << world_size_);
  std::vector<int> c(axes_.size());
  for (std::size_t a = 0; a < axes_.size(); ++a) c[a] = (rank / stride_[a]) % axes_[a].size;
  return c;
}

int Placement::rank_of(const std::vector<int>& coords) const {
  GW_CHECK(coords.size() == axes_.size(), "expected " << axes_.size() << " coordinates, got " << coords.size());
  int r = 0;
  for (std::size_t a = 0; a < axes_.size(); ++a) {
    GW_CHECK(coords[a] >= 0 && coords[a] < axes_[a].size,
             "coordinate " << coords[a] << " is outside axis '" << axes_[a].name << "' of size " << axes_[a].size);
    r += coords[a] * stride_[a];
  }
  return r;
}

std::vector<int> Placement::line(int rank, const std::vector<std::string>& line_axes) const {
  std::vector<int> idx;
  int n = 1;
  for (const auto& name : line_axes) {
    int a = axis_index(name);
    GW_CHECK(std::find(idx.begin(), idx.end(), a) == idx.end(), "axis '" << name << "' repeated in a tuple");
    idx.push_back(a);
    n *= axes_[a].size;
  }
  std::vector<int> c = coords_of(rank);
  std::vector<int> members(n);
  for (int k = 0; k < n; ++k) {
    int rem = k;
    for (int j = static_cast<int>(idx.size()) - 1; j >= 0; --j) {
      c[idx[j]] = rem % axes_[idx[j]].size;
      rem /= axes_[idx[j]].size;
    }
    members[k] = rank_of(c);
  }
  return members;
}

int Placement::index_in_line(int rank, const std::vector<std::string>& line_axes) const {
  std::vector<int> c = coords_of(rank);
  int k = 0;
  for (const auto& name : line_axes) {
    int a = axis_index(name);
    k = k * axes_[a].size + c[a];
  }
  return k;
}

int Placement::line_id(int rank, const std::vector<std::string>& line_axes) const {
  auto m = line(rank, line_axes);
  return *std::min_element(m.begin(), m.end());
}

TrafficModel segmented_traffic(const Placement& p, const std::vector<std::string>& line_axes, const std::string& op,
                               long long nbytes) {
  GW_CHECK(nbytes >= 0, "nbytes must be >= 0");
  int g = 1;
  for (const auto& a : line_axes) g *= p.axis_size(a);
  // Messages per (rank, member) pair and bytes per message for each op (nbytes =
  // one rank's input; reduce_scatter / all_to_all send one g-th to each member).
  long long per_pair = 1, bytes_per_msg = nbytes;
  bool rooted = false;
  if (op == "all_gather" || op == "broadcast" || op == "gather") {
    bytes_per_msg = nbytes;
    rooted = op != "all_gather";
  } else if (op == "reduce_scatter" || op == "all_to_all" || op == "scatter") {
    bytes_per_msg = op == "scatter" ? nbytes : nbytes / g;
    rooted = op == "scatter";
  } else if (op == "all_reduce") {
    per_pair = 2;  // reduce-scatter then all-gather of the g-th chunks
    bytes_per_msg = nbytes / g;
  } else if (op == "reduce") {
    rooted = true;
  } else {
    GW_CHECK(false, "traffic model: unknown op '" << op << "'");
  }
  // Each line once, from its member of index 0: the pairs within it that share a node are
  // sum over nodes of (members there)^2 (every member talks with every member), or, rooted, the
  // members on member 0's node; O(world) rather than O(world x g).
  TrafficModel t;
  std::vector<long long> on_node(p.world_size(), 0);
  for (int r = 0; r < p.world_size(); ++r) {
    if (p.index_in_line(r, line_axes) != 0) continue;
    auto members = p.line(r, line_axes);
    long long n = static_cast<long long>(members.size()), pairs = rooted ? n : n * n, intra = 0;
    if (rooted) {
      for (int m : members) intra += p.node_of(m) == p.node_of(r);
    } else {
      for (int m : members) intra += 2 * on_node[p.node_of(m)]++ + 1;  // (c + 1)^2 - c^2
      for (int m : members) on_node[p.node_of(m)] = 0;
    }
    long long msgs = rooted ? 1 : per_pair;
    t.messages += msgs * pairs;
    t.bytes += msgs * pairs * bytes_per_msg;
    t.intra_messages += msgs * intra;
    t.inter_messages += msgs * (pairs - intra);
    t.intra_bytes += msgs * intra * bytes_per_msg;
    t.inter_bytes += msgs * (pairs - intra) * bytes_per_msg;
  }
  return t;
}

}  // namespace gridweave
