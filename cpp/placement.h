// Placement: grid coordinates <-> global ranks, nodes, and the lines of ranks
// along an axis or a tuple of axes. Plain data and math; no communication, so it is
// tested without processes (and without hardware).
#pragma once
#include <map>
#include <string>
#include <vector>

namespace gridweave {

struct Axis {
  std::string name;
  int size = 1;
};

enum class PlacementPolicy : int { Naive = 0, Topology = 1 };

// Relative traffic of an axis, heaviest first: tensor / sub-graph axes move
// activations in blocking collectives every layer (the cube's z, then y, most); sp is a ring of p2p steps that
// overlap with compute; pp sends activations only at stage boundaries; dp reduces
// gradients once per step, overlapped with backward.
int axis_traffic_weight(const std::string& name);

class Placement {
 public:
  // `axes` in naive order: row-major, the last axis varies fastest over ranks.
  // `topology` reorders them so the heaviest axes vary fastest (land inside a node).
  Placement(std::vector<Axis> axes, PlacementPolicy policy, int ranks_per_node);

  int world_size() const { return world_size_; }
  int ranks_per_node() const { return ranks_per_node_; }
  PlacementPolicy policy() const { return policy_; }
  const std::vector<Axis>& axes() const { return axes_; }
  // Axes from slowest- to fastest-varying over global ranks.
  const std::vector<std::string>& physical_order() const { return physical_order_; }
  int axis_index(const std::string& name) const;
  int axis_size(const std::string& name) const { return axes_[axis_index(name)].size; }

  std::vector<int> coords_of(int rank) const;          // in `axes` order
  int rank_of(const std::vector<int>& coords) const;
  int node_of(int rank) const { return rank / ranks_per_node_; }

  // The global ranks of the line through `rank` along `line_axes`; member k has
  // coordinates k in row-major order over line_axes (first one slowest).
  std::vector<int> line(int rank, const std::vector<std::string>& line_axes) const;
  // Index of `rank` in its own line.
  int index_in_line(int rank, const std::vector<std::string>& line_axes) const;
  // A stable id of the line through `rank` (the smallest member's global rank).
  int line_id(int rank, const std::vector<std::string>& line_axes) const;

 private:
  std::vector<Axis> axes_;
  PlacementPolicy policy_;
  int ranks_per_node_;
  int world_size_ = 1;
  std::vector<std::string> physical_order_;
  std::vector<int> stride_;  // per axis (in `axes` order): global-rank stride
};

// SUPER-style traffic of one segmented collective: every rank exchanges one message
// with each member of its line, itself included (SUPER §V counts Messages = n*g).
// Summed over all ranks of the grid.
struct TrafficModel {
  long long messages = 0, intra_messages = 0, inter_messages = 0;
  long long bytes = 0, intra_bytes = 0, inter_bytes = 0;
};
TrafficModel segmented_traffic(const Placement& p, const std::vector<std::string>& line_axes, const std::string& op,
                               long long nbytes);

}  // namespace gridweave
