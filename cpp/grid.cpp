#include "grid.h"

#include <numeric>

#include "error.h"
#include "gloo_communicator.h"
#include "emulate_nccl.h"

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
  GW_CHECK(options_.emulate == Emulation::None || options_.backend != Backend::Nccl,
           "emulate='nccl' runs NCCL's rules on a CPU transport (gloo or mpi); the nccl backend keeps its own");
  // A failure or a timeout of any op aborts every communicator of the grid (NCCL's kernels
  // would otherwise wait forever on a peer); the next op raises it.
  watchdog_ = std::make_shared<Watchdog>([this](const Error&) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, c] : comms_) c->close();
  });
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
  info.watchdog = watchdog_;
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
  auto c = make(std::move(info), "comm/" + key + "/" + std::to_string(line_id), control);
  comms_[key] = c;
  return c;
}

std::shared_ptr<Communicator> Grid::make(CommInfo info, const std::string& line_name, bool control) {
  // called under mu_
  if (sealed_) {
    ++made_.after_setup;
    made_.late.push_back(line_name);
  } else {
    ++made_.at_setup;
  }
  info.session = options_.session + "/" + line_name;
  auto line_store = make_prefix_store(line_name, store_);
  // A control channel is a host communicator: the backend's own where it carries host memory
  // (Gloo, MPI: no second rendezvous), else Gloo. Under NCCL's rules the data communicators
  // are host ones too, wrapped in the rules (control channels keep the host's: on GPUs they are Gloo).
  const bool rules = options_.emulate == Emulation::Nccl && !control;
  CommInfo host_info = info;
  if (rules) {  // the wrapper counts and checks; the inner one only carries bytes
    host_info.counters = nullptr;
    host_info.check = CheckLevel::Cheap;
  }
  std::shared_ptr<Communicator> c;
  if (options_.backend == Backend::Gloo || (control && options_.backend != Backend::Mpi)) {
    if (!gloo_device_) gloo_device_ = make_gloo_device(options_.hostname);
    c = std::make_shared<GlooCommunicator>(std::move(host_info), line_store, gloo_device_);
  } else {
    c = make_communicator(options_.backend, std::move(host_info), line_store, options_.device_index);
  }
  if (rules) c = std::make_shared<NcclRulesCommunicator>(std::move(info), c, options_.eager_bytes);
  return c;
}

std::shared_ptr<Communicator> Grid::link(const std::vector<std::string>& axes, int a, int b, int channel) {
  std::vector<int> line(world_size());
  std::iota(line.begin(), line.end(), 0);  // the world, by global rank
  if (!axes.empty()) line = placement_.line(rank(), axes);
  GW_CHECK(a >= 0 && b >= 0 && a < static_cast<int>(line.size()) && b < static_cast<int>(line.size()) && a != b,
           "link on axis '" << label(axes) << "': members " << a << " and " << b << " are not two of its "
                            << line.size());
  const int me = axes.empty() ? rank() : placement_.index_in_line(rank(), axes);
  GW_CHECK(me == a || me == b, "link on axis '" << label(axes) << "' between members " << a << " and " << b
                                                << ": this rank is member " << me);
  const std::string key = label(axes) + ":link:" + std::to_string(a) + ">" + std::to_string(b) + "#" +
                          std::to_string(channel);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(key);
  if (it != comms_.end()) return it->second;
  CommInfo info;
  info.axis = label(axes);  // counted with its line's traffic
  info.timeout = options_.timeout;
  info.counters = counters_;
  info.check = options_.check;
  info.watchdog = watchdog_;
  info.members = {line[a], line[b]};
  info.rank = me == a ? 0 : 1;
  for (int m : info.members) info.member_nodes.push_back(placement_.node_of(m));
  info.ranks_on_node = std::min(placement_.ranks_per_node(), world_size());
  auto c = make(std::move(info), "comm/" + key + "/" + std::to_string(line[a]) + "-" + std::to_string(line[b]), false);
  comms_[key] = c;
  return c;
}

std::shared_ptr<Communicator> Grid::subset(const std::vector<std::string>& axes, const std::vector<int>& members,
                                           const std::string& part) {
  std::vector<int> line(world_size());
  std::iota(line.begin(), line.end(), 0);  // the world, by global rank
  if (!axes.empty()) line = placement_.line(rank(), axes);
  const int me = axes.empty() ? rank() : placement_.index_in_line(rank(), axes);
  GW_CHECK(!members.empty() && !part.empty(), "subset of axis '" << label(axes) << "': no members or no part name");
  int pos = -1;
  std::string names;
  for (std::size_t i = 0; i < members.size(); ++i) {
    GW_CHECK(members[i] >= 0 && members[i] < static_cast<int>(line.size()) && (i == 0 || members[i] > members[i - 1]),
             "subset of axis '" << label(axes) << "': members must be ascending indices of its "
                                << line.size() << ", got " << members[i]);
    if (members[i] == me) pos = static_cast<int>(i);
    names += (names.empty() ? "" : "-") + std::to_string(line[members[i]]);
  }
  GW_CHECK(pos >= 0, "subset of axis '" << label(axes) << "': this rank (member " << me << ") is not in it");
  const std::string key = label(axes) + ":" + part + ":" + names;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(key);
  if (it != comms_.end()) return it->second;
  CommInfo info;
  info.axis = label(axes) + ":" + part;
  info.timeout = options_.timeout;
  info.counters = counters_;
  info.check = options_.check;
  info.watchdog = watchdog_;
  for (int m : members) info.members.push_back(line[m]);
  info.rank = pos;
  for (int m : info.members) info.member_nodes.push_back(placement_.node_of(m));
  info.ranks_on_node = std::min(placement_.ranks_per_node(), world_size());
  auto c = make(std::move(info), "comm/" + key, false);
  comms_[key] = c;
  return c;
}

void Grid::connect(const std::vector<std::vector<std::string>>& lines) {
  for (const auto& axes : lines) line(axes, false);
}

void Grid::seal() {
  std::lock_guard<std::mutex> lock(mu_);
  sealed_ = true;
}

Grid::Made Grid::made() const {
  std::lock_guard<std::mutex> lock(mu_);
  return made_;
}

void Grid::shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [axis, c] : comms_) c->close();
  comms_.clear();
}

}  // namespace gridweave
