// The ctest harness of the multi-process tests: n forked ranks that rendezvous through a file
// store in a fresh folder, each running body(rank, store folder); a rank fails on a gtest failure
// or an exception (printed with its rank).
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace gridweave::test_support {

// Returns the number of ranks that failed.
inline int fork_ranks(int n, const std::function<void(int rank, const std::string& store_dir)>& body) {
  static int run = 0;
  auto dir = std::filesystem::temp_directory_path() /
             ("gw_ctest_" + std::to_string(getpid()) + "_" + std::to_string(run++));
  std::filesystem::create_directories(dir);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 0;
      try {
        body(r, dir.string());
        if (::testing::Test::HasFailure()) rc = 1;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        rc = 2;
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::filesystem::remove_all(dir);
  return failed;
}

}  // namespace gridweave::test_support
