#include "flight.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "error.h"

namespace gridweave {

const char* flight_state_name(FlightState s) {
  switch (s) {
    case FlightState::Issued: return "issued";
    case FlightState::Started: return "started";
    case FlightState::Completed: return "completed";
    case FlightState::Failed: return "failed";
  }
  return "issued";
}

const char* FlightRecorder::kind_name(int kind) {
  return kind == kConnect ? "connect" : op_name(static_cast<OpKind>(kind));
}

namespace {
std::atomic<int> enabled_recorders{0};  // recorders of capacity > 0 alive in this process
}  // namespace

FlightRecorder::FlightRecorder(std::size_t capacity) : ring_(capacity) {
  using namespace std::chrono;
  const double wall = duration<double>(system_clock::now().time_since_epoch()).count();
  steady_to_wall_s_ = wall - static_cast<double>(now_ns()) * 1e-9;
  if (!ring_.empty()) enabled_recorders.fetch_add(1);
}

FlightRecorder::~FlightRecorder() {
  if (!ring_.empty()) enabled_recorders.fetch_sub(1);
}

bool FlightRecorder::any_enabled() { return enabled_recorders.load(std::memory_order_relaxed) > 0; }

std::size_t FlightRecorder::capacity_from_env() {
  const char* v = std::getenv("GRIDWEAVE_FLIGHT_ENTRIES");
  if (!v || !*v) return 2048;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  GW_CHECK(end && *end == '\0' && n >= 0 && n <= (1LL << 24),
           "GRIDWEAVE_FLIGHT_ENTRIES must be an integer in [0, 16777216] (0 disables the flight recorder), got '"
               << v << "'");
  return static_cast<std::size_t>(n);
}

std::int64_t FlightRecorder::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int FlightRecorder::add_line(const std::string& name, const std::vector<int>& members) {
  std::lock_guard<std::mutex> lock(mu_);
  lines_.push_back(FlightLine{name, members, 0, 0});
  ++version_;
  return static_cast<int>(lines_.size()) - 1;
}

std::uint64_t FlightRecorder::issue(FlightEntry e) {
  if (ring_.empty()) return 0;
  e.issued_ns = now_ns();
  e.state = FlightState::Issued;
  std::lock_guard<std::mutex> lock(mu_);
  e.id = ++next_;
  if (e.line >= 0 && e.line < static_cast<int>(lines_.size()) && e.kind != kConnect) {
    FlightLine& l = lines_[e.line];
    const bool p2p = e.kind == static_cast<int>(OpKind::Send) || e.kind == static_cast<int>(OpKind::Recv);
    std::uint64_t& n = p2p ? l.p2p : l.collectives;
    if (e.seq > n) n = e.seq;
  }
  ring_[(e.id - 1) % ring_.size()] = e;
  ++version_;
  return e.id;
}

FlightEntry* FlightRecorder::slot(std::uint64_t id) {
  if (id == 0 || ring_.empty()) return nullptr;
  FlightEntry& e = ring_[(id - 1) % ring_.size()];
  return e.id == id ? &e : nullptr;
}

void FlightRecorder::started(std::uint64_t id, std::int64_t ns) {
  std::lock_guard<std::mutex> lock(mu_);
  FlightEntry* e = slot(id);
  if (!e || e->started_ns) return;
  e->started_ns = ns;  // also when the end came first (a worker's stamps handed over late)
  if (e->state == FlightState::Issued) e->state = FlightState::Started;
  ++version_;
}

void FlightRecorder::ended(std::uint64_t id, std::int64_t ns, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  FlightEntry* e = slot(id);
  if (!e || e->ended_ns) return;  // the first end speaks (a watchdog's abort after the op's own failure)
  e->ended_ns = ns;
  e->state = ok ? FlightState::Completed : FlightState::Failed;
  ++version_;
}

FlightRecorder::Snapshot FlightRecorder::snapshot() const {
  Snapshot s;
  std::lock_guard<std::mutex> lock(mu_);
  s.lines = lines_;
  s.recorded = next_;
  s.version = version_;
  const std::uint64_t n = ring_.size();
  const std::uint64_t first = next_ > n ? next_ - n + 1 : 1;
  s.entries.reserve(static_cast<std::size_t>(next_ - first + 1));
  for (std::uint64_t id = first; id <= next_; ++id) s.entries.push_back(ring_[(id - 1) % n]);
  return s;
}

std::uint64_t FlightRecorder::version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return version_;
}

namespace {

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// Seconds on the steady clock, or null for a stamp not made.
std::string seconds(std::int64_t ns) {
  if (!ns) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6f", static_cast<double>(ns) * 1e-9);
  return buf;
}

std::string ints(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string pairs(const std::vector<std::pair<std::string, int>>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + quoted(v[i].first) + ": " + std::to_string(v[i].second);
  return s + "}";
}

}  // namespace

std::string flight_json(const FlightRecorder& rec, const FlightHeader& h) {
  const FlightRecorder::Snapshot s = rec.snapshot();
  std::ostringstream os;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6f", rec.steady_to_wall_s());
  os << "{\n  \"format\": \"gridweave-flight/1\",\n  \"rank\": " << h.rank << ",\n  \"world_size\": " << h.world_size
     << ",\n  \"coords\": " << pairs(h.coords) << ",\n  \"axes\": " << pairs(h.axes) << ",\n  \"pid\": " << getpid()
     << ",\n  \"run\": " << quoted(h.run) << ",\n  \"reason\": " << quoted(h.reason) << ",\n  \"reasons\": [";
  for (std::size_t i = 0; i < h.reasons.size(); ++i) os << (i ? ", " : "") << quoted(h.reasons[i]);
  os << "],\n  \"reasons_omitted\": " << h.reasons_omitted << ",\n  \"dumped_s\": " << seconds(FlightRecorder::now_ns()) << ",\n  \"steady_to_wall_s\": " << buf
     << ",\n  \"capacity\": " << rec.capacity() << ",\n  \"recorded\": " << s.recorded << ",\n  \"lines\": [";
  for (std::size_t i = 0; i < s.lines.size(); ++i) {
    const FlightLine& l = s.lines[i];
    os << (i ? "," : "") << "\n    {\"name\": " << quoted(l.name) << ", \"members\": " << ints(l.members)
       << ", \"collectives\": " << l.collectives << ", \"p2p\": " << l.p2p << "}";
  }
  os << (s.lines.empty() ? "" : "\n  ") << "],\n  \"entries\": [";
  for (std::size_t i = 0; i < s.entries.size(); ++i) {
    const FlightEntry& e = s.entries[i];
    const FlightLine* l = e.line >= 0 && e.line < static_cast<int>(s.lines.size()) ? &s.lines[e.line] : nullptr;
    os << (i ? "," : "") << "\n    {\"id\": " << e.id << ", \"kind\": \"" << FlightRecorder::kind_name(e.kind)
       << "\", \"line\": " << (l ? quoted(l->name) : "null") << ", \"members\": " << (l ? ints(l->members) : "[]")
       << ", \"seq\": " << e.seq << ", \"tag\": " << e.tag << ", \"peer\": " << e.peer << ", \"root\": " << e.root
       << ", \"count\": " << e.count << ", \"bytes\": " << e.bytes << ", \"dtype\": \""
       << (e.kind == FlightRecorder::kConnect || e.kind == static_cast<int>(OpKind::Barrier) ? "" : dtype_name(e.dtype))
       << "\", \"state\": \"" << flight_state_name(e.state) << "\", \"issued_s\": " << seconds(e.issued_ns)
       << ", \"started_s\": " << seconds(e.started_ns) << ", \"ended_s\": " << seconds(e.ended_ns) << "}";
  }
  os << (s.entries.empty() ? "" : "\n  ") << "]\n}\n";
  return os.str();
}

void write_atomically(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  // One dump at a time in the process (two grids of one process may share a folder and a rank),
  // each through a temporary file of its own.
  static std::mutex* write_mu = new std::mutex;  // never destroyed: a dump may run at exit
  static std::atomic<std::uint64_t> serial{0};
  std::lock_guard<std::mutex> lock(*write_mu);
  const fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  if (ec) throw Error(ErrorKind::Comm, "gridweave: cannot make " + target.parent_path().string() + ": " + ec.message());
  // in the same folder (a rename does not cross file systems), named by this process and a counter
  const fs::path tmp = target.parent_path() / ("." + target.filename().string() + "." + std::to_string(getpid()) +
                                               "." + std::to_string(serial.fetch_add(1) + 1) + ".tmp");
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error(ErrorKind::Comm, "gridweave: cannot write " + tmp.string() + ": " + std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0;
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;  // a full disk may only say so here
  if (!written || !closed) {
    const int err = !written ? write_errno : errno;
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw Error(ErrorKind::Comm, "gridweave: cannot write " + tmp.string() + ": " + std::strerror(err));
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw Error(ErrorKind::Comm, "gridweave: cannot rename " + tmp.string() + " to " + path + ": " + ec.message());
  }
}

}  // namespace gridweave
