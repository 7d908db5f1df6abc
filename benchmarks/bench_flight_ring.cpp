// The flight recorder's own cost per op, one thread, no communication: what an op pays with the
// recorder on (its entry issued, the Work's entry attached, started and ended) against off (the
// same Work, stamped with no recorder attached, as with GRIDWEAVE_FLIGHT_ENTRIES=0).
//   bench_flight_ring [--benchmark_format=json]
#include <benchmark/benchmark.h>

#include <memory>

#include "flight.h"
#include "work.h"

using namespace gridweave;

namespace {

FlightEntry small_all_reduce(int line, std::uint64_t seq) {
  FlightEntry e;
  e.line = line;
  e.kind = static_cast<int>(OpKind::AllReduce);
  e.seq = seq;
  e.count = 1;
  e.bytes = 4;
  return e;
}

void BM_WorkOff(benchmark::State& state) {
  for (auto _ : state) {
    auto w = std::make_shared<TaskWork>("all_reduce");
    w->flight_started();
    w->complete();
    benchmark::DoNotOptimize(w);
  }
}
BENCHMARK(BM_WorkOff);

void BM_WorkOn(benchmark::State& state) {
  auto rec = std::make_shared<FlightRecorder>(2048);
  const int line = rec->add_line("dp", {0, 1});
  std::uint64_t seq = 0;
  for (auto _ : state) {
    FlightOp op(rec.get(), rec->issue(small_all_reduce(line, ++seq)));
    auto w = std::make_shared<TaskWork>("all_reduce");
    w->attach_flight(rec, op.release());
    w->flight_started();
    w->complete();
    benchmark::DoNotOptimize(w);
  }
}
BENCHMARK(BM_WorkOn);

}  // namespace

BENCHMARK_MAIN();
