// The flight recorder (cpp/flight.h): the ring's order, wraparound, states and stamps, a Work's
// stamps made before its entry is attached, the dump written whole, and the grid's dumps.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "error.h"
#include "flight.h"
#include "grid.h"
#include "store.h"
#include "watchdog.h"
#include "work.h"

using namespace gridweave;

namespace {

FlightEntry op(int line, OpKind kind, std::uint64_t seq, std::uint64_t count = 4) {
  FlightEntry e;
  e.line = line;
  e.kind = static_cast<int>(kind);
  e.seq = seq;
  e.count = count;
  e.bytes = count * 4;
  return e;
}

std::string read(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST(Flight, RecordsInOrderAndKeepsTheLastN) {
  FlightRecorder rec(4);
  const int line = rec.add_line("dp", {0, 2, 4});
  std::vector<std::uint64_t> ids;
  for (std::uint64_t k = 1; k <= 6; ++k) ids.push_back(rec.issue(op(line, OpKind::AllReduce, k)));
  EXPECT_EQ(ids, (std::vector<std::uint64_t>{1, 2, 3, 4, 5, 6}));
  const auto s = rec.snapshot();
  EXPECT_EQ(s.recorded, 6u);
  ASSERT_EQ(s.entries.size(), 4u);  // the oldest two were overwritten
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(s.entries[i].id, 3 + i);  // oldest first
    EXPECT_EQ(s.entries[i].seq, 3 + i);
    EXPECT_EQ(s.entries[i].state, FlightState::Issued);
    EXPECT_GT(s.entries[i].issued_ns, 0);
  }
  ASSERT_EQ(s.lines.size(), 1u);
  EXPECT_EQ(s.lines[0].collectives, 6u);  // counted past the ring
  EXPECT_EQ(s.lines[0].members, (std::vector<int>{0, 2, 4}));
}

TEST(Flight, StatesAndStampsOfOpsStillInTheRing) {
  FlightRecorder rec(3);
  const int line = rec.add_line("world", {0, 1});
  const auto a = rec.issue(op(line, OpKind::Send, 1));
  const auto b = rec.issue(op(line, OpKind::AllGather, 1));
  rec.started(a, 100);
  rec.ended(a, 200, true);
  rec.started(b, 150);
  rec.ended(b, 300, false);
  rec.ended(b, 400, true);  // the first end speaks
  rec.started(b, 500);      // a start after the end changes nothing
  auto s = rec.snapshot();
  EXPECT_EQ(s.entries[0].state, FlightState::Completed);
  EXPECT_EQ(s.entries[0].started_ns, 100);
  EXPECT_EQ(s.entries[0].ended_ns, 200);
  EXPECT_EQ(s.entries[1].state, FlightState::Failed);
  EXPECT_EQ(s.entries[1].ended_ns, 300);
  EXPECT_EQ(s.lines[0].p2p, 1u);
  EXPECT_EQ(s.lines[0].collectives, 1u);
  for (int k = 0; k < 3; ++k) rec.issue(op(line, OpKind::AllGather, 2 + k));
  const std::uint64_t before = rec.version();
  rec.ended(a, 999, false);  // overwritten: ignored
  EXPECT_EQ(rec.version(), before);
  s = rec.snapshot();
  for (const auto& e : s.entries) EXPECT_NE(e.id, a);
}

TEST(Flight, AStartHandedOverAfterTheEndIsKept) {
  FlightRecorder rec(4);
  const int line = rec.add_line("world", {0, 1});
  const auto a = rec.issue(op(line, OpKind::AllReduce, 1));
  rec.ended(a, 300, true);  // a worker's end reached the recorder before the issuing thread's start
  rec.started(a, 200);
  const auto s = rec.snapshot();
  EXPECT_EQ(s.entries[0].state, FlightState::Completed);  // not moved back
  EXPECT_EQ(s.entries[0].started_ns, 200);
  EXPECT_EQ(s.entries[0].ended_ns, 300);
}

TEST(Flight, DisabledRecordsNothing) {
  FlightRecorder rec(0);
  EXPECT_EQ(rec.issue(op(rec.add_line("x", {0}), OpKind::Barrier, 1)), 0u);
  EXPECT_TRUE(rec.snapshot().entries.empty());
}

TEST(Flight, AWorkHandsOverStampsMadeBeforeItWasAttached) {
  auto rec = std::make_shared<FlightRecorder>(8);
  const int line = rec->add_line("tp", {0, 1});
  auto early = std::make_shared<TaskWork>("early");
  early->flight_started();
  early->complete();  // a worker finished it before the issuing thread attached it
  early->attach_flight(rec, rec->issue(op(line, OpKind::AllReduce, 1)));
  auto late = std::make_shared<TaskWork>("late");
  late->attach_flight(rec, rec->issue(op(line, OpKind::AllReduce, 2)));
  late->flight_started();
  late->fail(std::make_exception_ptr(std::runtime_error("peer gone")));
  auto running = std::make_shared<TaskWork>("running");
  running->attach_flight(rec, rec->issue(op(line, OpKind::AllReduce, 3)));
  running->flight_started();
  {
    FlightOp thrown(rec.get(), rec->issue(op(line, OpKind::AllReduce, 4)));  // threw before a Work took it
  }
  const auto s = rec->snapshot();
  ASSERT_EQ(s.entries.size(), 4u);
  EXPECT_EQ(s.entries[0].state, FlightState::Completed);
  EXPECT_LE(s.entries[0].started_ns, s.entries[0].ended_ns);
  EXPECT_EQ(s.entries[1].state, FlightState::Failed);
  EXPECT_EQ(s.entries[2].state, FlightState::Started);
  EXPECT_EQ(s.entries[2].ended_ns, 0);
  EXPECT_EQ(s.entries[3].state, FlightState::Failed);
}

TEST(Flight, TheDumpIsWrittenWholeAndEscaped) {
  FlightRecorder rec(4);
  const int line = rec.add_line("dp,tp", {0, 1, 2, 3});
  rec.issue(op(line, OpKind::AllReduce, 1, 1024));
  FlightHeader h;
  h.rank = 2;
  h.world_size = 4;
  h.coords = {{"dp", 1}, {"tp", 0}};
  h.axes = {{"dp", 2}, {"tp", 2}};
  h.reason = "CommTimeout: \"quoted\"\nnext line";
  h.reasons = {h.reason, "shutdown"};
  const std::string text = flight_json(rec, h);
  EXPECT_NE(text.find("\"format\": \"gridweave-flight/1\""), std::string::npos);
  EXPECT_NE(text.find("\\\"quoted\\\"\\nnext line"), std::string::npos);
  EXPECT_NE(text.find("\"kind\": \"all_reduce\", \"line\": \"dp,tp\", \"members\": [0, 1, 2, 3], \"seq\": 1"),
            std::string::npos);
  EXPECT_NE(text.find("\"bytes\": 4096, \"dtype\": \"float32\", \"state\": \"issued\""), std::string::npos);
  EXPECT_NE(text.find("\"started_s\": null"), std::string::npos);
  const auto dir = std::filesystem::temp_directory_path() / ("gw_flight_" + std::to_string(getpid()));
  const auto path = dir / "sub" / "rank2.json";
  write_atomically(path.string(), text);
  EXPECT_EQ(read(path), text);
  write_atomically(path.string(), "{}\n");  // replaced whole, no temporary left beside it
  EXPECT_EQ(read(path), "{}\n");
  int files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir / "sub")) files += f.is_regular_file();
  EXPECT_EQ(files, 1);
  std::filesystem::remove_all(dir);
}

// The grid's dumps: the watchdog's abort writes one on the C++ side; the first failure stays the
// reason when the shutdown's dump adds its own; a dump with nothing new is not written again.
TEST(Flight, TheGridDumpsOnTheWatchdogsAbortAndKeepsTheFirstReason) {
  const auto dir = std::filesystem::temp_directory_path() / ("gw_flight_grid_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir / "store");
  GridOptions o;
  o.axes = {{"dp", 1}};
  o.flight_entries = 16;
  o.flight_dir = (dir / "flight").string();
  Grid grid(o, make_file_store((dir / "store").string()));
  std::vector<float> x(3, 1.0f);
  BufferView v{x.data(), x.size(), DType::Float32};
  auto dp = grid.comm({"dp"});
  dp->all_reduce(v, ReduceOp::Sum, false)->wait(std::chrono::milliseconds(5000));
  dp->info().watchdog->abort(Error(ErrorKind::Timeout, "gridweave: all_reduce timed out"));
  const auto path = dir / "flight" / "rank0.json";
  const std::string first = read(path);
  EXPECT_NE(first.find("\"reason\": \"CommTimeout: gridweave: all_reduce timed out (the watchdog aborted the grid)\""),
            std::string::npos) << first;
  EXPECT_NE(first.find("\"kind\": \"connect\", \"line\": \"dp\""), std::string::npos) << first;
  EXPECT_NE(first.find("\"kind\": \"all_reduce\", \"line\": \"dp\", \"members\": [0], \"seq\": 1"), std::string::npos);
  EXPECT_NE(first.find("\"state\": \"completed\""), std::string::npos);
  std::filesystem::remove(path);
  grid.flight_dump("CommTimeout: gridweave: all_reduce timed out (the watchdog aborted the grid)");
  EXPECT_FALSE(std::filesystem::exists(path));  // nothing new: not written again
  grid.shutdown();
  const std::string last = read(path);
  EXPECT_NE(last.find("\"reason\": \"CommTimeout: gridweave: all_reduce timed out"), std::string::npos) << last;
  EXPECT_NE(last.find("(the watchdog aborted the grid)\", \"shutdown\"]"), std::string::npos) << last;
  std::filesystem::remove(path);
  grid.flight_dump("CommError: later");  // shut down: this grid writes no more
  EXPECT_FALSE(std::filesystem::exists(path));
  std::filesystem::remove_all(dir);
}

// Two grids of one process may dump to one file at once: each write goes through a temporary
// file of its own, one at a time, and the file read is always one whole dump.
TEST(Flight, ConcurrentDumpsToOneFileEachLandWhole) {
  const auto dir = std::filesystem::temp_directory_path() / ("gw_flight_race_" + std::to_string(getpid()));
  const auto path = (dir / "rank0.json").string();
  const std::string a(1 << 16, 'a'), b(1 << 16, 'b');
  std::thread ta([&] {
    for (int k = 0; k < 50; ++k) write_atomically(path, a);
  });
  std::thread tb([&] {
    for (int k = 0; k < 50; ++k) write_atomically(path, b);
  });
  for (int k = 0; k < 50; ++k) {
    const std::string now = read(path);
    EXPECT_TRUE(now.empty() || now == a || now == b) << now.size();
  }
  ta.join();
  tb.join();
  const std::string last = read(path);
  EXPECT_TRUE(last == a || last == b);
  int files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) files += f.is_regular_file();
  EXPECT_EQ(files, 1);  // no temporary left
  std::filesystem::remove_all(dir);
}

TEST(Flight, ADumpKeepsTheFirstReasonAndTheLatestAndCountsTheRest) {
  const auto dir = std::filesystem::temp_directory_path() / ("gw_flight_reasons_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir / "store");
  GridOptions o;
  o.axes = {{"dp", 1}};
  o.flight_entries = 4;
  o.flight_dir = (dir / "flight").string();
  Grid grid(o, make_file_store((dir / "store").string()));
  const int n = 20;
  for (int k = 0; k < n; ++k) grid.flight_dump("CommError: failure " + std::to_string(k));
  const std::string text = read(dir / "flight" / "rank0.json");
  EXPECT_NE(text.find("\"reason\": \"CommError: failure 0\""), std::string::npos) << text;
  std::string kept = "\"reasons\": [\"CommError: failure 0\"";
  for (int k = n - static_cast<int>(Grid::kLatestReasons); k < n; ++k) kept += ", \"CommError: failure " + std::to_string(k) + "\"";
  EXPECT_NE(text.find(kept + "],"), std::string::npos) << text;
  EXPECT_NE(text.find("\"reasons_omitted\": " + std::to_string(n - 1 - Grid::kLatestReasons)), std::string::npos) << text;
  grid.shutdown();
  std::filesystem::remove_all(dir);
}

// The grid's shutdown tests its watched ops first: one that completed unseen is stamped ended in
// the shutdown's dump (NCCL's ops are stamped when a test sees their event).
TEST(Flight, ShutdownStampsWatchedOpsThatCompletedUnseen) {
  struct Flagged : Work {
    std::atomic<bool> done{false};
    Flagged() : Work("flagged op") {}
    bool test() override {
      if (!done) return false;
      flight_ended(true);
      return true;
    }
    void wait(std::chrono::milliseconds) override {}
    int source() const override { return -1; }
  };
  const auto dir = std::filesystem::temp_directory_path() / ("gw_flight_unseen_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir / "store");
  GridOptions o;
  o.axes = {{"dp", 1}};
  o.flight_entries = 8;
  o.flight_dir = (dir / "flight").string();
  Grid grid(o, make_file_store((dir / "store").string()));
  auto dp = grid.comm({"dp"});
  auto w = std::make_shared<Flagged>();
  FlightEntry e = op(dp->info().flight_line, OpKind::AllReduce, 1);
  w->attach_flight(grid.flight(), grid.flight()->issue(e));
  w->flight_started();
  // polled only by shutdown: the watchdog's own pass may come first, or not
  dp->info().watchdog->watch(w, Watchdog::Clock::now() + std::chrono::hours(1));
  w->done = true;
  grid.shutdown();
  const std::string text = read(dir / "flight" / "rank0.json");
  EXPECT_NE(text.find("\"kind\": \"all_reduce\", \"line\": \"dp\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"state\": \"started\""), std::string::npos) << text;
  std::filesystem::remove_all(dir);
}
