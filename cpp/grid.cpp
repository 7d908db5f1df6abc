#include "grid.h"

#include <numeric>

#include "error.h"
#include "gloo_communicator.h"

namespace gridweave {

Grid::Grid(GridOptions options, std::shared_ptr<Store> store)
    : options_(std::move(options)),
      placement_(options_.axes, options_.policy, options_.ranks_per_node),
      store_(std::move(store)),
      counters_(std::make_shared<TrafficCounters>()) {
  GW_CHECK(options_.rank >= 0 && options_.rank < placement_.world_size(),
           "rank " << options_.rank << " is outside the grid of " << placement_.world_size() << " ranks");
  GW_CHECK(options_.timeout.count() > 0, "timeout must be positive");
  if (options_.backend == Backend::Gloo) gloo_device_ = make_gloo_device(options_.hostname);
  else GW_CHECK(transport_available(options_.backend), "backend '" << backend_name(options_.backend)
                                                                 << "' requested but gridweave was built without it");
}

Grid::~Grid() { shutdown(); }

std::string Grid::label(const std::vector<std::string>& axes) {
  if (axes.empty()) return "world";
  std::string s;
  for (const auto& a : axes) s += (s.empty() ? "" : ",") + a;
  return s;
}

std::shared_ptr<Communicator> Grid::comm(const std::vector<std::string>& axes) { return line(axes, false); }

std::shared_ptr<Communicator> Grid::control(const std::vector<std::string>& axes) { return line(axes, true); }

std::shared_ptr<Communicator> Grid::line(const std::vector<std::string>& axes, bool control) {
  // a control channel is a host (Gloo) communicator over the same line, whatever the backend
  const std::string key = label(axes) + (control ? ":control" : "");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(key);
  if (it != comms_.end()) return it->second;

  CommInfo info;
  info.axis = key;
  info.timeout = options_.timeout;
  info.counters = counters_;
  info.check = options_.check;
  int line_id = 0;
  if (axes.empty()) {
    info.members.resize(world_size());
    std::iota(info.members.begin(), info.members.end(), 0);
    info.rank = rank();
  } else {
    info.members = placement_.line(rank(), axes);
    info.rank = placement_.index_in_line(rank(), axes);
    line_id = placement_.line_id(rank(), axes);
  }
  for (int m : info.members) info.member_nodes.push_back(placement_.node_of(m));
  info.ranks_on_node = std::min(placement_.ranks_per_node(), world_size());
  const std::string line_name = "comm/" + key + "/" + std::to_string(line_id);
  info.session = options_.session + "/" + line_name;
  auto line_store = make_prefix_store(line_name, store_);

  std::shared_ptr<Communicator> c;
  // A control channel is a host communicator: the backend's own where it carries host memory
  // (Gloo, MPI: no second rendezvous), else Gloo.
  if (options_.backend == Backend::Gloo || (control && options_.backend != Backend::Mpi)) {
    if (!gloo_device_) gloo_device_ = make_gloo_device(options_.hostname);
    c = std::make_shared<GlooCommunicator>(std::move(info), line_store, gloo_device_);
  } else {
    c = make_communicator(options_.backend, std::move(info), line_store, options_.device_index);
  }
  comms_[key] = c;
  return c;
}

void Grid::shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [axis, c] : comms_) c->close();
  comms_.clear();
}

}  // namespace gridweave
