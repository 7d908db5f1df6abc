#include "grid.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <thread>

#include "error.h"
#include "gloo_communicator.h"
#include "emulate_nccl.h"

namespace gridweave {

namespace {

// The grids of this process not yet destroyed, for the dumps that are not one grid's own (an
// error reaching Python, a SIGTERM). Never destroyed: a dump may run while the process exits.
struct LiveGrids {
  std::mutex mu;
  std::vector<Grid*> grids;
};
LiveGrids& live_grids() {
  static LiveGrids* l = new LiveGrids;
  return *l;
}

// ---- SIGTERM: the launcher ending the job (torchrun sends SIGKILL after a grace period) ------
// A rank blocked in a wait of the engine (its Python thread holds no GIL and runs no Python
// signal handler until the wait ends) must still dump. The handler does only what is
// async-signal-safe: it writes one byte to a pipe, then chains to the handler installed before it
// (Python's own C handler, which sets the flag its Python-level handler runs on). A thread of the
// engine reads the pipe and dumps every live grid; where the previous disposition was the
// default, it then restores it and sends SIGTERM again, so the process ends by the signal as it
// would have.
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "a signal handler counts with it");
int sigterm_pipe[2] = {-1, -1};
pid_t sigterm_pid = 0;                      // the process whose thread reads the pipe (not a fork's child)
struct sigaction sigterm_prev;              // written only while the handler is not installed
std::atomic<std::uint64_t> sigterm_raised{0}, sigterm_dumped{0};

enum class Disposition { Default, Ignore, Function };
Disposition disposition(const struct sigaction& a) {
  if (a.sa_flags & SA_SIGINFO)
    return a.sa_sigaction == nullptr ? Disposition::Default
           : reinterpret_cast<void*>(a.sa_sigaction) == reinterpret_cast<void*>(SIG_IGN) ? Disposition::Ignore
                                                                                         : Disposition::Function;
  return a.sa_handler == SIG_DFL ? Disposition::Default
         : a.sa_handler == SIG_IGN ? Disposition::Ignore
                                   : Disposition::Function;
}

extern "C" void gridweave_on_sigterm(int sig, siginfo_t* info, void* context) {
  const int saved = errno;
  const struct sigaction& prev = sigterm_prev;
  const Disposition d = disposition(prev);
  if (getpid() == sigterm_pid) {
    sigterm_raised.fetch_add(1);
    const char one = 1;
    const ssize_t n = write(sigterm_pipe[1], &one, 1);  // non-blocking: a full pipe has a dump coming
    (void)n;
  } else if (d == Disposition::Default) {
    // a forked child, without the thread that dumps: end by the signal as before (it is blocked
    // while this handler runs, and delivered when it returns)
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
  }
  if (d == Disposition::Function) {
    if (prev.sa_flags & SA_SIGINFO) prev.sa_sigaction(sig, info, context);
    else prev.sa_handler(sig);
  }
  errno = saved;
}

void sigterm_thread(int fd) {
  for (;;) {
    char buf[64];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the pipe went (a fork's child closed its copy)
    const std::uint64_t seen = sigterm_raised.load();
    Grid::flight_dump_all("SIGTERM");
    sigterm_dumped.store(seen);
    if (disposition(sigterm_prev) == Disposition::Default) {  // end by the signal, as without the handler
      struct sigaction dfl;
      std::memset(&dfl, 0, sizeof(dfl));
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(SIGTERM, &dfl, nullptr);
      kill(getpid(), SIGTERM);
      return;
    }
  }
}

void forget_sigterm_pipe() {  // pthread_atfork's child: the thread that read the pipe is the parent's
  for (int& fd : sigterm_pipe) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

// Installs the handler (a grid with a flight folder is made): once, and again if another handler
// replaced it since (Python's signal.signal does), chaining to that one. A failure is said on
// stderr: the other dumps still happen.
void install_sigterm() {
  static std::mutex* mu = new std::mutex;
  std::lock_guard<std::mutex> lock(*mu);
  static bool atfork = false;
  if (!atfork) atfork = pthread_atfork(nullptr, nullptr, forget_sigterm_pipe) == 0;
  if (sigterm_pipe[0] < 0) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      std::fprintf(stderr, "gridweave: no flight recorder dump on SIGTERM: pipe2 failed (errno %d)\n", errno);
      return;
    }
    fcntl(fds[0], F_SETFL, 0);  // the thread blocks on its end; the handler's end never blocks
    // the thread takes no signal (they go to the process's other threads)
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    try {
      std::thread(sigterm_thread, fds[0]).detach();
    } catch (const std::exception& e) {
      pthread_sigmask(SIG_SETMASK, &old, nullptr);
      close(fds[0]);
      close(fds[1]);
      std::fprintf(stderr, "gridweave: no flight recorder dump on SIGTERM: %s\n", e.what());
      return;
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    sigterm_pipe[0] = fds[0];
    sigterm_pipe[1] = fds[1];
  }
  struct sigaction cur;
  if (sigaction(SIGTERM, nullptr, &cur) != 0) return;
  const bool ours = (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == gridweave_on_sigterm;
  if (!ours) sigterm_prev = cur;  // not installed now: no handler of ours reads it meanwhile
  sigterm_pid = getpid();         // a fork's child that makes a grid reads its own pipe
  if (ours) return;
  struct sigaction mine;
  std::memset(&mine, 0, sizeof(mine));
  mine.sa_sigaction = gridweave_on_sigterm;
  mine.sa_mask = cur.sa_mask;
  // as the previous handler asked (Python's restarts no call: its waits see EINTR and run it);
  // with none, interrupted calls restart
  mine.sa_flags = SA_SIGINFO | (disposition(cur) == Disposition::Function ? cur.sa_flags & (SA_RESTART | SA_ONSTACK)
                                                                          : SA_RESTART);
  if (sigaction(SIGTERM, &mine, nullptr) != 0)
    std::fprintf(stderr, "gridweave: no flight recorder dump on SIGTERM: sigaction failed (errno %d)\n", errno);
}

bool sigterm_pending() { return sigterm_raised.load() != sigterm_dumped.load(); }

}  // namespace

void Grid::flight_dump_all(const std::string& reason) {
  LiveGrids& l = live_grids();
  std::lock_guard<std::mutex> lock(l.mu);  // a grid is not destroyed while it dumps
  for (Grid* g : l.grids) g->flight_dump(reason);
}

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
  const std::size_t entries = options_.flight_entries < 0 ? FlightRecorder::capacity_from_env()
                                                          : static_cast<std::size_t>(options_.flight_entries);
  if (entries > 0) flight_ = std::make_shared<FlightRecorder>(entries);
  // A failure or a timeout of any op aborts every communicator of the grid (NCCL's kernels
  // would otherwise wait forever on a peer); the next op raises it. The flight recorder is
  // dumped here, on the C++ side: the rank's Python may be blocked, or never see the failure.
  watchdog_ = std::make_shared<Watchdog>([this](const Error& e) {
    flight_dump(std::string(e.kind() == ErrorKind::Timeout ? "CommTimeout: " : "CommError: ") + e.what() +
                " (the watchdog aborted the grid)");
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, c] : comms_) c->close();
  });
  if (flight_ && !options_.flight_dir.empty()) install_sigterm();
  LiveGrids& l = live_grids();
  std::lock_guard<std::mutex> lock(l.mu);
  l.grids.push_back(this);
}

FlightOp Grid::flight_connect(CommInfo& info, const std::string& name) {
  if (!flight_) return FlightOp();
  info.flight = flight_;
  info.name = name;
  info.flight_line = flight_->add_line(name, info.members);
  FlightEntry e;
  e.line = info.flight_line;
  e.kind = FlightRecorder::kConnect;
  const std::uint64_t id = flight_->issue(e);
  flight_->started(id, FlightRecorder::now_ns());
  return FlightOp(flight_.get(), id);
}

FlightHeader Grid::flight_header(const std::string& reason) const {
  FlightHeader h;
  h.rank = rank();
  h.world_size = world_size();
  const std::vector<int> c = coords();
  for (std::size_t k = 0; k < options_.axes.size(); ++k) {
    h.axes.emplace_back(options_.axes[k].name, options_.axes[k].size);
    if (k < c.size()) h.coords.emplace_back(options_.axes[k].name, c[k]);
  }
  h.reasons = flight_reasons_;
  h.reasons_omitted = flight_reasons_omitted_;
  h.run = options_.flight_run;
  if (!reason.empty() && std::find(h.reasons.begin(), h.reasons.end(), reason) == h.reasons.end())
    h.reasons.push_back(reason);
  // the first failure is the dump's reason; "shutdown" only when nothing failed
  h.reason = h.reasons.empty() ? "" : h.reasons.back();
  for (const auto& r : h.reasons)
    if (r != "shutdown") {
      h.reason = r;
      break;
    }
  return h;
}

std::string Grid::flight_json(const std::string& reason) const {
  GW_CHECK(flight_, "the flight recorder is disabled (GRIDWEAVE_FLIGHT_ENTRIES=0)");
  std::lock_guard<std::mutex> lock(flight_mu_);
  return gridweave::flight_json(*flight_, flight_header(reason));
}

void Grid::flight_dump(const std::string& reason) {
  if (!flight_ || options_.flight_dir.empty()) return;
  std::lock_guard<std::mutex> lock(flight_mu_);
  if (flight_closed_) return;
  const bool known = std::find(flight_reasons_.begin(), flight_reasons_.end(), reason) != flight_reasons_.end();
  const std::uint64_t version = flight_->version();
  if (known && version == flight_written_) return;  // nothing new to say
  if (!known) {
    flight_reasons_.push_back(reason);
    if (flight_reasons_.size() > 1 + kLatestReasons) {  // keep the first, and the latest few
      flight_reasons_.erase(flight_reasons_.begin() + 1);
      ++flight_reasons_omitted_;
    }
  }
  const std::string path = options_.flight_dir + "/rank" + std::to_string(rank()) + ".json";
  try {
    write_atomically(path, gridweave::flight_json(*flight_, flight_header("")));
    flight_written_ = version;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gridweave: rank %d: the flight recorder's dump (%s) was not written: %s\n", rank(),
                 reason.c_str(), e.what());
  }
}

Grid::~Grid() {
  {
    LiveGrids& l = live_grids();
    std::lock_guard<std::mutex> lock(l.mu);  // after a dump of every grid under way
    l.grids.erase(std::remove(l.grids.begin(), l.grids.end(), this), l.grids.end());
  }
  shutdown();
}

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
  FlightOp connecting = flight_connect(info, key);
  auto c = make(std::move(info), "comm/" + key + "/" + std::to_string(line_id), control);
  connecting.done(true);
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
  if (rules) {  // the wrapper counts, checks and records; the inner one only carries bytes
    host_info.counters = nullptr;
    host_info.check = CheckLevel::Cheap;
    host_info.flight = nullptr;
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
  FlightOp connecting = flight_connect(info, key);
  auto c = make(std::move(info), "comm/" + key + "/" + std::to_string(line[a]) + "-" + std::to_string(line[b]), false);
  connecting.done(true);
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
  FlightOp connecting = flight_connect(info, info.axis);
  auto c = make(std::move(info), "comm/" + key, false);
  connecting.done(true);
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
  if (flight_ && !options_.flight_dir.empty()) {
    // ops that completed unseen (NCCL's end is stamped when a test sees its event) are stamped now
    if (watchdog_) watchdog_->poll_outstanding();
    // a SIGTERM whose dump is still to come (its thread runs behind this one) is dumped first
    if (sigterm_pending()) flight_dump("SIGTERM");
  }
  flight_dump("shutdown");  // before the close cancels what is still in flight: as it stood
  {
    std::lock_guard<std::mutex> lock(flight_mu_);
    flight_closed_ = true;  // a later failure (another grid's, in this process) is not this one's
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [axis, c] : comms_) c->close();
  comms_.clear();
}

}  // namespace gridweave
