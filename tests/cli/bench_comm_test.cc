// `switchyard bench comm` end to end (a smoke test: tiny sizes, few iterations): the --json lines
// carry every field with consistent values and a passing result check; the table has its columns;
// bad flag combinations exit with code 2 saying what is wrong. Speed is not asserted.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/run_switchyard.h"

namespace switchyard {
namespace {

using Result = testing::CliResult;

// Runs `switchyard <args>`, capturing stdout and stderr.
Result Switchyard(const std::string& args) { return testing::RunSwitchyard(args); }

std::vector<nlohmann::json> JsonLines(const std::string& text) {
  return testing::JsonLinesOf(text);
}

TEST(CliBenchComm, JsonLinesHaveEveryFieldAndPassTheCheck) {
  Result r = Switchyard(
      "bench comm --op allreduce --ranks 3 --sizes 4K,64K --algo ring,tree --iters 2 --warmup 1 "
      "--json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;  // 2 sizes x 2 algorithms
  std::set<std::pair<int64_t, std::string>> seen;
  for (const nlohmann::json& j : lines) {
    SCOPED_TRACE(j.dump());
    EXPECT_EQ(j.at("op"), "allreduce");
    EXPECT_EQ(j.at("ranks"), 3);
    EXPECT_EQ(j.at("transport"), "inprocess");
    EXPECT_EQ(j.at("dtype"), "float32");
    EXPECT_EQ(j.at("emulated"), false);
    EXPECT_EQ(j.at("check"), "ok");
    seen.insert({j.at("bytes").get<int64_t>(), j.at("algorithm").get<std::string>()});
    const double time_us = j.at("time_us"), algbw = j.at("algbw_gbps"), busbw = j.at("busbw_gbps");
    EXPECT_GT(time_us, 0);
    // algbw = bytes / time; busbw = algbw x 2 (W - 1) / W for allreduce (nccl-tests).
    EXPECT_NEAR(algbw, j.at("bytes").get<double>() / (time_us * 1e-6) / 1e9, 1e-6 * algbw);
    EXPECT_NEAR(busbw, algbw * 4.0 / 3.0, 1e-9 + 1e-9 * busbw);
    // In-process the limit (one thread's memcpy) is measured in the same run.
    EXPECT_GT(j.at("memcpy_gbps").get<double>(), 0);
    EXPECT_NEAR(j.at("busbw_over_memcpy").get<double>(), busbw / j.at("memcpy_gbps").get<double>(),
                1e-9 + 1e-9 * busbw);
    // And min(W, cores) ranks copying at once, the aggregate.
    EXPECT_EQ(j.at("memcpy_concurrent_threads").get<int>(),
              std::min(3, static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))));
    EXPECT_GT(j.at("memcpy_concurrent_gbps").get<double>(), 0);
  }
  EXPECT_EQ(seen, (std::set<std::pair<int64_t, std::string>>{
                      {4096, "ring"}, {4096, "tree"}, {65536, "ring"}, {65536, "tree"}}));
}

TEST(CliBenchComm, AllToAllOnAnEmulatedTopologyPrintsTheTable) {
  Result r = Switchyard(
      "bench comm --op alltoall --ranks 4 --ranks-per-node 2 --emulate --inter-latency-us 20 "
      "--sizes 4K --algo pairwise,hierarchical --iters 2 --warmup 0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("alltoall on 4 ranks (inprocess, 2 nodes x 2)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("EMULATED links"), std::string::npos) << r.out;
  for (const char* column : {"size(B)", "algorithm", "time(us)", "algbw", "busbw", "memcpy",
                             "bus/memcpy", "memcpy*T", "pairwise", "hierarchical"}) {
    EXPECT_NE(r.out.find(column), std::string::npos) << column << " missing:\n" << r.out;
  }
  EXPECT_EQ(r.out.find("CHECK FAILED"), std::string::npos) << r.out;
}

TEST(CliBenchComm, EveryOpRunsInBFloat16) {
  for (const char* op :
       {"alltoallv", "allgather", "reduce_scatter", "broadcast", "reduce", "scatter", "gather"}) {
    Result r = Switchyard(std::string("bench comm --op ") + op +
                          " --ranks 3 --dtype bfloat16 --sizes 3K --iters 1 --warmup 0 --json");
    ASSERT_EQ(r.exit_code, 0) << op << ": " << r.err;
    std::vector<nlohmann::json> lines = JsonLines(r.out);
    ASSERT_EQ(lines.size(), 1u) << r.out;
    EXPECT_EQ(lines[0].at("op"), op);
    EXPECT_EQ(lines[0].at("dtype"), "bfloat16");
    EXPECT_EQ(lines[0].at("check"), "ok") << lines[0].dump();
  }
}

TEST(CliBenchComm, BadFlagsExitWithCodeTwoSayingWhy) {
  Result r = Switchyard("bench comm --op allreduce --ranks 2 --compare mpi --transport inproc");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--compare mpi needs --transport mpi"), std::string::npos) << r.err;
  r = Switchyard("bench comm --op allgather --ranks 2 --algo tree --sizes 1K --iters 1");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("allgather has no algorithm 'tree'"), std::string::npos) << r.err;
}

#ifdef SY_MPIRUN_SCRIPT
// Over MPI with --compare mpi: our ring and MPI's own allreduce timed in the same run, every line
// checked, and the ratio column is our busbw over MPI's at the same size.
TEST(CliBenchComm, OverMpiComparesWithMpisOwnCollective) {
  const std::string command = std::string("bash ") + SY_MPIRUN_SCRIPT + " -np 2 " +
                              SY_SWITCHYARD_BIN +
                              " bench comm --op allreduce --sizes 4K,256K --algo ring "
                              "--compare mpi --iters 3 --warmup 1 --json";
  Result r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) r.out.append(buffer, n);
  int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << r.out;
  std::vector<nlohmann::json> lines;
  std::istringstream in(r.out);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] == '{') lines.push_back(nlohmann::json::parse(line));
  }
  // Printed by rank 0 only: 2 sizes x (ring + the appended native).
  ASSERT_EQ(lines.size(), 4u) << r.out;
  std::map<int64_t, double> native_busbw;
  for (const nlohmann::json& j : lines) {
    EXPECT_EQ(j.at("transport"), "mpi") << j.dump();
    EXPECT_EQ(j.at("ranks"), 2) << j.dump();
    EXPECT_EQ(j.at("check"), "ok") << j.dump();
    if (j.at("algorithm") == "native") native_busbw[j.at("bytes")] = j.at("busbw_gbps");
  }
  ASSERT_EQ(native_busbw.size(), 2u) << r.out;
  for (const nlohmann::json& j : lines) {
    const double busbw = j.at("busbw_gbps");
    const double mpi = native_busbw.at(j.at("bytes").get<int64_t>());
    EXPECT_GT(busbw, 0) << j.dump();
    EXPECT_NEAR(j.at("busbw_over_mpi").get<double>(), busbw / mpi, 1e-9 + 1e-9 * busbw / mpi)
        << j.dump();
  }
}
#endif

}  // namespace
}  // namespace switchyard
