// C++ microbenchmark of the Gloo transport, no Python in the loop:
//   bench_engine --ranks=N [--benchmark_out=file.json --benchmark_out_format=json]
// forks N ranks that rendezvous through a file store. Every rank runs the same
// fixed iteration counts (collectives need all members); rank 0 reports.
// With 8 ranks it also times a segmented all-gather on 4 disjoint pairs against the
// same four all-gathers run one pair after another.
#include <benchmark/benchmark.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "gloo_communicator.h"
#include "store.h"

using namespace gridweave;

namespace {

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

std::shared_ptr<GlooCommunicator> connect(const std::string& dir, const std::string& axis, std::vector<int> members,
                                          int rank, std::shared_ptr<gloo::transport::Device> dev) {
  CommInfo info;
  info.axis = axis;
  info.members = std::move(members);
  info.rank = rank;
  info.timeout = std::chrono::milliseconds(120000);
  info.counters = std::make_shared<TrafficCounters>();
  std::filesystem::create_directories(dir + "/" + axis);
  return std::make_shared<GlooCommunicator>(info, make_file_store(dir + "/" + axis), dev);
}

const std::chrono::milliseconds kWait(120000);

int run_rank(int rank, int n, const std::string& dir, int argc, char** argv) {
  auto dev = make_gloo_device("127.0.0.1");
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);
  auto world = connect(dir, "world", all, rank, dev);
  std::shared_ptr<GlooCommunicator> pair;
  if (n == 8) pair = connect(dir, "pair" + std::to_string(rank / 2), {rank - rank % 2, rank - rank % 2 + 1}, rank % 2, dev);

  for (std::size_t bytes = 4 << 10; bytes <= (64u << 20); bytes *= 4) {
    const int iters = static_cast<int>(std::max<std::size_t>(3, std::min<std::size_t>(200, (64u << 20) / bytes)));
    const std::size_t count = bytes / sizeof(float);
    auto in = std::make_shared<std::vector<float>>(count, 1.0f);
    auto out = std::make_shared<std::vector<float>>(count);
    auto v = [](std::vector<float>& x, std::size_t c) { return BufferView{x.data(), c, DType::Float32}; };
    const std::string sz = std::to_string(bytes);
    // all_gather: `bytes` is the gathered output, as for torch's all_gather_into_tensor.
    benchmark::RegisterBenchmark(("all_gather/ranks:" + std::to_string(n) + "/bytes:" + sz).c_str(),
                                 [=](benchmark::State& st) {
                                   for (auto _ : st) world->all_gather(v(*in, count / n), v(*out, count), false)->wait(kWait);
                                   st.SetBytesProcessed(st.iterations() * bytes);
                                 })->Iterations(iters)->UseRealTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("reduce_scatter/ranks:" + std::to_string(n) + "/bytes:" + sz).c_str(),
                                 [=](benchmark::State& st) {
                                   for (auto _ : st)
                                     world->reduce_scatter(v(*in, count), v(*out, count / n), ReduceOp::Sum, false)->wait(kWait);
                                   st.SetBytesProcessed(st.iterations() * bytes);
                                 })->Iterations(iters)->UseRealTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("all_reduce/ranks:" + std::to_string(n) + "/bytes:" + sz).c_str(),
                                 [=](benchmark::State& st) {
                                   for (auto _ : st) world->all_reduce(v(*in, count), ReduceOp::Sum, false)->wait(kWait);
                                   st.SetBytesProcessed(st.iterations() * bytes);
                                 })->Iterations(iters)->UseRealTime()->Unit(benchmark::kMicrosecond);
    if (pair) {
      benchmark::RegisterBenchmark(("segmented_all_gather/groups:4/bytes:" + sz).c_str(), [=](benchmark::State& st) {
        for (auto _ : st) {
          pair->all_gather(v(*in, count / 2), v(*out, count), false)->wait(kWait);
          world->barrier(false)->wait(kWait);
        }
      })->Iterations(iters)->UseRealTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("sequential_all_gather/groups:4/bytes:" + sz).c_str(), [=](benchmark::State& st) {
        for (auto _ : st) {
          for (int g = 0; g < 4; ++g) {
            if (rank / 2 == g) pair->all_gather(v(*in, count / 2), v(*out, count), false)->wait(kWait);
            world->barrier(false)->wait(kWait);
          }
        }
      })->Iterations(iters)->UseRealTime()->Unit(benchmark::kMicrosecond);
    }
  }
  // Only rank 0 reports; the others must not write the --benchmark_out file.
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (rank == 0 || std::strncmp(argv[i], "--benchmark_out", 15) != 0) args.push_back(argv[i]);
  int nargs = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&nargs, args.data());
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int n = 4;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--ranks=", 8) == 0) n = std::atoi(argv[i] + 8);
    else rest.push_back(argv[i]);
  }
  if (n < 1) {
    std::cerr << "--ranks must be >= 1\n";
    return 2;
  }
  auto dir = (std::filesystem::temp_directory_path() / ("gw_bench_" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(dir);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int c = static_cast<int>(rest.size());
      std::vector<char*> args = rest;
      args.push_back(nullptr);
      try {
        _exit(run_rank(r, n, dir, c, args.data()));
      } catch (const std::exception& e) {
        std::cerr << "rank " << r << ": " << e.what() << "\n";
        _exit(1);
      }
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t p : pids) {
    int status = 0;
    waitpid(p, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  std::filesystem::remove_all(dir);
  return rc;
}
