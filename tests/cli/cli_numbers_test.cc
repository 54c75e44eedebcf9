// Numbers on the command line, end to end (docs/cli.md): bad sizes and emulation parameters exit 2
// with one line naming the flag, the value and what was expected (never a crash, a bare
// std::bad_alloc, a hang or a silently different size); sizes that cannot fit in memory are
// refused up front saying how much they needed; and the benchmarks print only meaningful figures
// ("-" in tables, null in --json), never nan, inf or -nan.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/run_switchyard.h"

namespace switchyard {
namespace {

using testing::CliResult;
using testing::JsonLinesOf;
using testing::RunSwitchyard;

// A quick `bench comm` with the given extra flags.
CliResult BenchComm(const std::string& flags) {
  return RunSwitchyard("bench comm --ranks 2 --iters 1 --warmup 0 " + flags);
}

void ExpectUsageError(const CliResult& r, const std::vector<std::string>& says) {
  EXPECT_EQ(r.exit_code, 2) << "stdout:\n" << r.out << "stderr:\n" << r.err;
  EXPECT_EQ(r.err.rfind("switchyard: error: ", 0), 0u) << r.err;
  for (const std::string& s : says)
    EXPECT_NE(r.err.find(s), std::string::npos) << s << "\n" << r.err;
}

TEST(CliSizes, BadSizesExitTwoNamingFlagAndValue) {
  // -1 segfaulted; -1M and nan threw a bare std::bad_alloc; inf benchmarked 0 bytes.
  for (const char* bad : {"-1", "-1M", "nan", "inf", "1X", "0x100", "1.5", "4K,,8K"}) {
    SCOPED_TRACE(bad);
    ExpectUsageError(BenchComm(std::string("--sizes=") + bad), {"--sizes", bad});
  }
  // A range whose end overflows looped forever.
  ExpectUsageError(BenchComm("--sizes 1:18446744073709551615"), {"--sizes", "too large"});
  ExpectUsageError(BenchComm("--sizes 0:4K"), {"--sizes", "1 <= FROM <= TO"});
  ExpectUsageError(BenchComm("--sizes 1K:4K:1"), {"--sizes", "FACTOR"});
}

TEST(CliSizes, SizesAreRoundedUpToWholeElementsAndBlocks) {
  // `--sizes 1` became 0 bytes. Now: one float32 element (allreduce), one per rank (alltoall).
  CliResult r = BenchComm("--op allreduce --sizes 1,4,5 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> lines = JsonLinesOf(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;  // 1 and 4 are both 4 bytes
  EXPECT_EQ(lines[0].at("bytes"), 4);
  EXPECT_EQ(lines[1].at("bytes"), 8);
  r = RunSwitchyard("bench comm --iters 1 --warmup 0 --op alltoall --ranks 3 --sizes 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  lines = JsonLinesOf(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_EQ(lines[0].at("bytes"), 12);
  EXPECT_EQ(lines[0].at("check"), "ok");
  // The table says so.
  r = RunSwitchyard("bench comm --iters 1 --warmup 0 --op alltoall --ranks 3 --sizes 4K");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("# sizes rounded up to a multiple of 12 bytes (3 ranks x float32"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("4104"), std::string::npos) << r.out;
}

TEST(CliSizes, SizesThatCannotFitAreRefusedUpFront) {
  // 8G on 2 ranks was found by the OOM killer; 1e12 gave a bare std::bad_alloc.
  for (const char* size : {"8G", "1e12", "1P"}) {
    SCOPED_TRACE(size);
    ExpectUsageError(BenchComm(std::string("--sizes ") + size),
                     {"bench comm --sizes", "needs", "available"});
  }
  ExpectUsageError(RunSwitchyard("bench layer-parallel --ranks 2 --tokens 1099511627776 "
                                 "--model-dim 8 --hidden-dim 8 --experts 2 --repeat 1 --warmup 0 "
                                 "--rounds 1"),
                   {"bench layer-parallel", "needs", "available"});
}

TEST(CliEmulation, BadLinkParametersExitTwoNamingTheDeadline) {
  // 1e12 us slept past every deadline; negative bandwidths and NaN latencies were accepted.
  ExpectUsageError(BenchComm("--sizes 4K --emulate --intra-latency-us 1e12"),
                   {"--intra-latency-us", "collective deadline (--timeout-ms 120000 ms)"});
  ExpectUsageError(BenchComm("--sizes 4K --emulate --timeout-ms 1000 --inter-latency-us 1000000"),
                   {"--inter-latency-us", "--timeout-ms 1000 ms"});
  ExpectUsageError(BenchComm("--sizes 4K --emulate --intra-gbps -1"), {"--intra-gbps", "-1"});
  ExpectUsageError(BenchComm("--sizes 4K --emulate --inter-latency-us nan"),
                   {"--inter-latency-us", "nan"});
  ExpectUsageError(BenchComm("--sizes 4K --emulate --inter-gbps inf"), {"--inter-gbps", "inf"});
  ExpectUsageError(BenchComm("--sizes 4K --emulate --inter-gbps 1e-9"), {"--inter-gbps", "1e-09"});
  // A message that alone takes longer than the deadline at the emulated bandwidth.
  ExpectUsageError(BenchComm("--sizes 64M --emulate --timeout-ms 1000 --intra-gbps 0.001"),
                   {"--intra-gbps", "64.0 MiB", "--timeout-ms 1000 ms"});
  ExpectUsageError(RunSwitchyard("bench layer-parallel --ranks 2 --emulate-ranks-per-node 1 "
                                 "--inter-latency-us 1e9 --tokens 8 --model-dim 8 --hidden-dim 8 "
                                 "--experts 2 --repeat 1 --warmup 0 --rounds 1"),
                   {"--inter-latency-us", "collective deadline (60000 ms, the default)"});
  ExpectUsageError(RunSwitchyard("bench layer-parallel --ranks 2 --emulate-ranks-per-node 1 "
                                 "--intra-gbps=-3 --tokens 8 --model-dim 8 --hidden-dim 8 "
                                 "--experts 2 --repeat 1 --warmup 0 --rounds 1"),
                   {"--intra-gbps", "-3"});
}

TEST(CliFloats, NanAndInfinityAreRefusedWhereRangesWereChecked) {
  // CLI::Range lets nan through (every comparison with nan is false).
  ExpectUsageError(RunSwitchyard("bench layer-parallel --hot-expert-bias nan --ranks 2 --tokens 8 "
                                 "--model-dim 8 --hidden-dim 8 --experts 2 --repeat 1"),
                   {"--hot-expert-bias", "nan"});
  ExpectUsageError(RunSwitchyard("bench layer-parallel --capacity-factor inf --ranks 2 --tokens 8 "
                                 "--model-dim 8 --hidden-dim 8 --experts 2 --repeat 1"),
                   {"--capacity-factor", "inf"});
  ExpectUsageError(RunSwitchyard("trace-svg --width nan --trace t.json --out t.svg"),
                   {"--width", "nan"});
}

TEST(CliBenchOutput, SizeZeroPrintsNoNanAndNullsInJson) {
  CliResult r = BenchComm("--op allreduce --sizes 0,4K");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* glitch : {"nan", "inf"}) {
    EXPECT_EQ(r.out.find(glitch), std::string::npos) << glitch << " in:\n" << r.out;
  }
  EXPECT_NE(r.out.find("# -: not meaningful"), std::string::npos) << r.out;
  r = BenchComm("--op allreduce --sizes 0,4K --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> lines = JsonLinesOf(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  EXPECT_EQ(lines[0].at("bytes"), 0);
  for (const char* key :
       {"algbw_gbps", "busbw_gbps", "memcpy_gbps", "busbw_over_memcpy", "memcpy_concurrent_gbps"}) {
    EXPECT_TRUE(lines[0].at(key).is_null()) << key << ": " << lines[0].dump();
    EXPECT_TRUE(lines[1].at(key).is_number()) << key << ": " << lines[1].dump();
  }
  EXPECT_GT(lines[0].at("time_us").get<double>(), -1e-9);
}

TEST(CliBenchOutput, LayerParallelPrintsNoFractionOfNothing) {
  // One rank: no token all-to-all runs, so "hidden behind compute" has no meaning (it said 0%).
  const std::string flags =
      "bench layer-parallel --ranks 1 --tokens 16 --model-dim 8 --hidden-dim 8 --experts 2 "
      "--repeat 1 --warmup 0 --rounds 1 --no-reference";
  CliResult r = RunSwitchyard(flags + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> lines = JsonLinesOf(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_TRUE(lines[0].at("schedule").at("hidden_fraction").is_null()) << lines[0].dump();
  EXPECT_TRUE(lines[0].at("ratio_to_single_rank").is_null()) << lines[0].dump();
  r = RunSwitchyard(flags);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("-> - hidden behind compute (-: no token all-to-all ran)"),
            std::string::npos)
      << r.out;
  for (const char* glitch : {"nan", "inf"}) {
    EXPECT_EQ(r.out.find(glitch), std::string::npos) << glitch << " in:\n" << r.out;
  }
}

// bench gemm and bench layer: sizes and factors from flags are range-checked, and operands that
// cannot fit are refused up front (--expert went through std::stoll: 'x' was an uncaught
// std::invalid_argument with exit 1; 2^20-sized operands went to the OOM killer; a NaN
// capacity factor ran).
TEST(CliSizes, BenchGemmAndLayerCheckTheirSizes) {
  ExpectUsageError(RunSwitchyard("bench gemm --expert 1,2,x"), {"--expert", "'x'"});
  ExpectUsageError(RunSwitchyard("bench gemm --expert 1,-2,3"), {"--expert", "-2"});
  ExpectUsageError(RunSwitchyard("bench gemm --expert 1.5,2,3"), {"--expert", "whole number"});
  ExpectUsageError(RunSwitchyard("bench gemm --expert 1,2"), {"--expert", "C,M,H"});
  ExpectUsageError(RunSwitchyard("bench gemm --m 1048576 --k 1048576 --n 1048576"),
                   {"bench gemm's operands needs", "TiB", "available"});
  ExpectUsageError(RunSwitchyard("bench layer --capacity-factor nan"), {"--capacity-factor"});
  ExpectUsageError(RunSwitchyard("bench layer --tokens 16777216 --model-dim 16777216"),
                   {"needs", "available"});
}

}  // namespace
}  // namespace switchyard
