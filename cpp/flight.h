// The flight recorder: every rank keeps its last N operations, across all the communicators of
// its grid, so that when a job hangs or fails each rank can say what it issued, what it waited
// on and what finished (`gridweave flight` reads the dumps and names the rank that caused it).
// One preallocated ring per grid, shared by its communicators through CommInfo; an op costs
// one slot write under a mutex when issued and one when it starts and ends, and nothing is
// allocated for it (a batch of point-to-point ops keeps one list of its ops' guards).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtype.h"
#include "traffic.h"

namespace gridweave {

enum class FlightState : std::uint8_t { Issued = 0, Started, Completed, Failed };
const char* flight_state_name(FlightState s);

// What an op records beyond its kind: -1 / 0 where it does not apply.
struct FlightEntry {
  std::uint64_t id = 0;   // 1, 2, ... in issue order on this rank; 0: an empty slot
  int line = -1;          // index into the recorder's lines
  int kind = 0;           // an OpKind, or kConnect
  std::uint64_t seq = 0;  // collectives: the n-th on its line (1-based, as every member counts); p2p: the
                          // n-th point-to-point op on its communicator; connect: 0
  int tag = -1;           // p2p only
  int peer = -1;          // p2p: the peer's global rank (-1: a receive from any of several)
  int root = -1;          // rooted collectives: the root's global rank
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;
  DType dtype = DType::Float32;
  std::int64_t issued_ns = 0, started_ns = 0, ended_ns = 0;  // steady clock; 0: not yet
  FlightState state = FlightState::Issued;
};

// A communicator as the recorder names it: its label in the grid and its members' global ranks,
// and how many collectives / p2p ops this rank issued on it (never overwritten by the ring).
struct FlightLine {
  std::string name;
  std::vector<int> members;
  std::uint64_t collectives = 0, p2p = 0;
};

class FlightRecorder {
 public:
  // Not an OpKind: making a line's communicator (its members meet), which can hang too.
  static constexpr int kConnect = 100;
  static const char* kind_name(int kind);

  explicit FlightRecorder(std::size_t capacity);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;
  // Whether any recorder that records (capacity > 0) lives in this process: a Work that no
  // recorder can ever take reads no clock for its stamps.
  static bool any_enabled();
  // GRIDWEAVE_FLIGHT_ENTRIES, else 2048; 0 disables the recorder. A bad value is a GridError.
  static std::size_t capacity_from_env();
  static std::int64_t now_ns();  // steady clock

  std::size_t capacity() const { return ring_.size(); }
  // Registers a line once (a communicator's constructor, or the grid before it makes one).
  int add_line(const std::string& name, const std::vector<int>& members);
  // Records an op as issued now; returns its id (0 when the recorder is disabled).
  std::uint64_t issue(FlightEntry e);
  // Stamps an op's start / end; an op already overwritten by the ring is ignored. A start that
  // comes after the end (a worker's stamps handed over late) still fills the start, never
  // moving the state back.
  void started(std::uint64_t id, std::int64_t ns);
  void ended(std::uint64_t id, std::int64_t ns, bool ok);

  struct Snapshot {
    std::vector<FlightEntry> entries;  // oldest first
    std::vector<FlightLine> lines;
    std::uint64_t recorded = 0;        // ops ever recorded (more than entries once the ring wrapped)
    std::uint64_t version = 0;         // changes with every record or stamp
  };
  Snapshot snapshot() const;
  std::uint64_t version() const;
  // Seconds to add to a steady-clock time for the wall clock (Unix time): ranks compare roughly.
  double steady_to_wall_s() const { return steady_to_wall_s_; }

 private:
  FlightEntry* slot(std::uint64_t id);  // under mu_; null when overwritten
  mutable std::mutex mu_;
  std::vector<FlightEntry> ring_;
  std::vector<FlightLine> lines_;
  std::uint64_t next_ = 0;  // ids issued so far
  std::uint64_t version_ = 0;
  double steady_to_wall_s_ = 0;
};

// Ties one op to its entry: the guard an op's issuing code holds. If the op throws before it
// hands back a Work, the entry is marked failed when the guard goes.
class FlightOp {
 public:
  FlightOp() = default;
  FlightOp(FlightRecorder* rec, std::uint64_t id) : rec_(rec), id_(id) {}
  FlightOp(const FlightOp&) = delete;
  FlightOp& operator=(const FlightOp&) = delete;
  FlightOp(FlightOp&& o) noexcept : rec_(o.rec_), id_(o.release()) {}
  FlightOp& operator=(FlightOp&& o) noexcept {
    if (this != &o) {
      done(false);
      rec_ = o.rec_;
      id_ = o.release();
    }
    return *this;
  }
  ~FlightOp() { done(false); }
  std::uint64_t id() const { return id_; }
  // The op was handed over (to a Work that stamps it): the guard lets go.
  std::uint64_t release() {
    const std::uint64_t id = id_;
    id_ = 0;
    return id;
  }
  void done(bool ok) {
    if (rec_ && id_) rec_->ended(release(), FlightRecorder::now_ns(), ok);
  }

 private:
  FlightRecorder* rec_ = nullptr;
  std::uint64_t id_ = 0;
};

// The dump: the rank's ring as JSON (schema in docs/guide/faults.md, "Flight recorder").
struct FlightHeader {
  int rank = 0;
  int world_size = 1;
  std::vector<std::pair<std::string, int>> coords;  // axis -> this rank's coordinate
  std::vector<std::pair<std::string, int>> axes;    // axis -> size
  std::string reason;                               // the first failure's, else the latest
  std::vector<std::string> reasons;                 // distinct reasons, in order: the first and the latest few
  std::uint64_t reasons_omitted = 0;                // distinct reasons left out between them
  std::string run;                                  // the job (and restart) this rank is of
};
std::string flight_json(const FlightRecorder& rec, const FlightHeader& header);
// Writes `text` to `path` through a temporary file in the same folder (a name of its own: this
// process's id and a counter) and a rename, so a reader never sees half a dump; makes the folder.
// One write at a time in the process. Throws Error on failure (the temporary file removed).
void write_atomically(const std::string& path, const std::string& text);

}  // namespace gridweave
