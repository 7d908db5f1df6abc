// The process grid: placement, one communicator per line of every axis or tuple of
// axes (made lazily, the first time its members use it), per-axis traffic counters.
#pragma once
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "communicator.h"
#include "placement.h"
#include "registry.h"
#include "store.h"
#include "watchdog.h"

namespace gloo::transport {
class Device;
}

namespace gridweave {

// Which transport's rules the data communicators keep beyond their own: None, or NCCL's
// (cpp/emulate_nccl.h) on a host transport, so CPU CI runs what GPUs would.
enum class Emulation : int { None = 0, Nccl = 1 };

struct GridOptions {
  std::vector<Axis> axes;  // naive order
  PlacementPolicy policy = PlacementPolicy::Topology;
  int ranks_per_node = 1;
  int rank = 0;
  Backend backend = Backend::Gloo;
  std::chrono::milliseconds timeout{300000};
  std::string hostname = "127.0.0.1";  // address peers use to reach this rank (Gloo)
  int device_index = -1;               // CUDA device (NCCL)
  std::string session;                 // names this grid alike on all its ranks (the rendezvous prefix)
  CheckLevel check = CheckLevel::Cheap;  // how every op verifies that the members agree
  Emulation emulate = Emulation::None;
  std::size_t eager_bytes = 0;           // under NCCL's rules: sends up to this size complete at once
  // The flight recorder (cpp/flight.h): its entries (-1: GRIDWEAVE_FLIGHT_ENTRIES, else 2048; 0
  // disables it) and the folder its dumps go to ("": none written, the ring still records).
  long long flight_entries = -1;
  std::string flight_dir;
  // Names the job (and its restart) alike on all its ranks: the dumps say which run they are of,
  // so a folder a later run writes into is read run by run.
  std::string flight_run;
};

class Grid {
 public:
  Grid(GridOptions options, std::shared_ptr<Store> store);
  ~Grid();

  int rank() const { return options_.rank; }
  int world_size() const { return placement_.world_size(); }
  const Placement& placement() const { return placement_; }
  const GridOptions& options() const { return options_; }
  std::vector<int> coords() const { return placement_.coords_of(rank()); }

  // Communicator of this rank's line along `axes` (a tuple; {} means the world,
  // indexed by global rank). Every member must ask for it the first time.
  std::shared_ptr<Communicator> comm(const std::vector<std::string>& axes);
  // A host communicator over the same line, whatever the backend (its own where it carries
  // host memory, else Gloo): a control channel for what the data transport cannot do
  // (receive-from-any of small headers).
  std::shared_ptr<Communicator> control(const std::vector<std::string>& axes);
  static std::string label(const std::vector<std::string>& axes);
  // A two-member communicator between members a and b (indices along `axes`) of this rank's
  // line, for one kind of traffic (`channel`): pipeline stages keep one per neighbour and
  // direction, so under NCCL no message ever queues behind another's. Both members make it.
  std::shared_ptr<Communicator> link(const std::vector<std::string>& axes, int a, int b, int channel);
  // A communicator over some members (indices along `axes`, ascending) of this rank's line, one
  // of which is this rank: hybrid sharding's node-local part of a line, or its members at one
  // position on every node. Its traffic is counted under "<axes>:<part>". Every member makes it.
  std::shared_ptr<Communicator> subset(const std::vector<std::string>& axes, const std::vector<int>& members,
                                       const std::string& part);
  // Makes the communicators of these lines now, in this order (the same on every rank), so
  // no two ranks can first touch two shared lines in opposite orders.
  void connect(const std::vector<std::vector<std::string>>& lines);
  // Ends the job's setup: a communicator made after it is counted (and named) as made late,
  // since NCCL's creation blocks the host while other communicators' kernels may be in flight.
  void seal();
  struct Made {
    std::size_t at_setup = 0, after_setup = 0;
    std::vector<std::string> late;  // the keys of those made after setup, in order
  };
  Made made() const;
  // Whether ops keep NCCL's rules (the NCCL transport, or its emulation).
  bool nccl_rules() const { return options_.backend == Backend::Nccl || options_.emulate == Emulation::Nccl; }

  std::map<std::string, AxisCounters> stats() const { return counters_->snapshot(); }
  void reset_stats() { counters_->reset(); }
  // Dumps the flight recorder (shutdown, then nothing more): the watched ops are tested once
  // first, so those that completed unseen are stamped ended; a SIGTERM not yet dumped is dumped
  // first.
  void shutdown();

  // The flight recorder as JSON (reason: what the dump says happened).
  std::string flight_json(const std::string& reason) const;
  // Writes it to <flight_dir>/rank<R>.json (nothing without a folder, or once shut down). The
  // first failure's reason stays the dump's reason (a later "shutdown" is added to its reasons);
  // a dump that would say nothing new (same reason, no op recorded or stamped since) is skipped.
  // Never throws: a dump that cannot be written is said on stderr.
  void flight_dump(const std::string& reason);
  const std::shared_ptr<FlightRecorder>& flight() const { return flight_; }
  // flight_dump(reason) of every grid of this process not yet destroyed (a grid shut down
  // writes nothing more): a communication error that reaches Python, a SIGTERM.
  static void flight_dump_all(const std::string& reason);
  // The reasons a dump keeps: the first, and this many of the latest (the others are counted).
  static constexpr std::size_t kLatestReasons = 8;

 private:
  std::shared_ptr<Communicator> line(const std::vector<std::string>& axes, bool control);
  // The transport's communicator for `info` (a host one for control channels), with NCCL's
  // rules on top when emulated.
  std::shared_ptr<Communicator> make(CommInfo info, const std::string& store_prefix, bool control);
  // Registers `info`'s line with the flight recorder under `name` and records its making.
  FlightOp flight_connect(CommInfo& info, const std::string& name);
  FlightHeader flight_header(const std::string& reason) const;  // under flight_mu_
  GridOptions options_;
  Placement placement_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<TrafficCounters> counters_;
  std::shared_ptr<gloo::transport::Device> gloo_device_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Communicator>> comms_;
  bool sealed_ = false;
  Made made_;
  std::shared_ptr<FlightRecorder> flight_;  // null when disabled
  mutable std::mutex flight_mu_;  // the dumps' (never mu_: a dump must not wait on a line being made)
  std::vector<std::string> flight_reasons_;  // the first, then the latest kLatestReasons
  std::uint64_t flight_reasons_omitted_ = 0;  // distinct reasons dropped between them
  std::uint64_t flight_written_ = 0;  // the recorder's version at the last dump written
  bool flight_closed_ = false;
  // Last: destroyed first, so its thread never aborts a grid that is going away.
  std::shared_ptr<Watchdog> watchdog_;
};

}  // namespace gridweave
