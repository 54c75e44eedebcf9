// Integer flags and memory, end to end (docs/cli.md, "Integers" and "Memory"; docs/errors.md):
// every integer flag of the non-train commands is read as a whole 64-bit number and
// range-checked before anything narrower sees it (4294967297 was 1 as a 32-bit int, -1 was
// 2^64 - 1 as --step, 0x10 was 16 and 010 was 8), and every command refuses up front, with one
// line and exit code 2, sizes that cannot fit in memory (they grew to 23 GB, printed a bare
// std::bad_alloc, spun for ever on an overflowed product or computed for a minute first).
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "cli/run_switchyard.h"

namespace switchyard {
namespace {

using testing::CliResult;
using testing::RunSwitchyard;
using testing::RunSwitchyardAfter;

// Every run here must end well within this: a hang fails as exit code 124. The memory cases also
// run under an 8 GB address-space limit, so that what they need exceeds what is available on any
// machine (RequireMemory counts the limit): a larger machine would start some of them.
const char* const kWithin = "timeout -k 5 60";
const char* const kWithin8G = "ulimit -v 8000000; timeout -k 5 60";

void ExpectOneLineError(const CliResult& r, int code, const std::vector<std::string>& says) {
  EXPECT_EQ(r.exit_code, code) << "stdout:\n" << r.out << "stderr:\n" << r.err;
  EXPECT_EQ(r.err.rfind("switchyard: error: ", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line:\n" << r.err;
  for (const std::string& s : says)
    EXPECT_NE(r.err.find(s), std::string::npos) << s << "\n" << r.err;
}

struct IntCase {
  std::string command;  // with whatever else the command needs before the flag
  std::string flag, value, expected;
};

TEST(CliIntegers, ValuesAreReadWholeAndRefusedAsTyped) {
  const std::string layer = "layer --config c.json --tensors t.safetensors --out o.safetensors";
  const std::string out_of_range = "' is out of range; expected an integer in ";
  const std::string not_integer = "' is not an integer; expected a whole decimal number in ";
  const std::vector<IntCase> cases = {
      {"schedule", "--pp", "4294967297", out_of_range + "[1, 1024]"},
      {"schedule", "--microbatches", "18446744073709551617", out_of_range + "[1, 65536]"},
      {"schedule", "--virtual", "0x10", not_integer + "[1, 64]"},
      {"groups --world 4", "--tp", "-4294967294", out_of_range + "[1, 1048576]"},
      {"groups", "--world", "99999999999999999999", out_of_range + "[1, 1048576]"},
      {layer, "--step", "-1", out_of_range + "[0, 9223372036854775807]"},
      {layer, "--global-token-offset", "1e3", not_integer + "[0, 1125899906842624]"},
      {layer, "--ranks", "4294967297", out_of_range + "[1, 4096]"},
      {"bench comm", "--ranks", "4294967298", out_of_range + "[1, 1024]"},
      {"bench comm", "--timeout-ms", "9223372036854775808", out_of_range + "[1, 86400000]"},
      {"bench gemm", "--threads", "4294967297", out_of_range + "[1, 256]"},
      {"bench layer", "--experts", "4294967297", out_of_range + "[1, 65536]"},
      {"bench layer", "--top-k", "1.0", not_integer + "[1, 65536]"},
      {"bench layer-parallel", "--ranks", "4294967297", out_of_range + "[1, 4096]"},
      {"bench layer-parallel", "--overlap-degree", "4294967298", out_of_range + "[1, 1024]"},
      {"bench cp", "--cp", "2,4294967298", out_of_range + "[1, 256]"},
      {"bench tp", "--tokens", "99999999999999999999", out_of_range + "[1, 1099511627776]"},
      {"bench pipeline", "--pp", "010x", not_integer + "[1, 64]"},
  };
  for (const IntCase& c : cases) {
    SCOPED_TRACE(c.command + " " + c.flag + " " + c.value);
    const CliResult r = RunSwitchyard(c.command + " " + c.flag + " " + c.value);
    // The value shown is the one typed (for a list: the item that is wrong).
    const std::string shown = c.value.substr(c.value.find(',') + 1);
    ExpectOneLineError(r, 2, {c.flag + ": '" + shown + c.expected});
  }
  // Leading zeros are decimal (010 was octal 8), and the range shows in the help.
  CliResult r = RunSwitchyard("schedule --pp 010 --microbatches 10 --kind fthenb");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("schedule fthenb: 10 stages, 10 micro-batches"), std::string::npos) << r.out;
  r = RunSwitchyard("schedule --help");
  EXPECT_NE(r.out.find("--pp INT in [1, 1024]"), std::string::npos) << r.out;
}

// Every integer flag of these commands goes through AddIntOption (flags.h): its help says
// "INT in [lo, hi]". A bare INT would be an integer CLI11 converts on its own (train's keys are
// parsed by train::ResolveTrainConfig and are not listed here).
TEST(CliIntegers, EveryIntegerFlagShowsItsRange) {
  const std::regex bare_int("--[a-z0-9-]+ U?INT(?! in \\[)");
  for (const char* command :
       {"layer", "groups", "schedule", "trace-svg", "bench comm", "bench gemm", "bench layer",
        "bench layer-parallel", "bench cp", "bench tp", "bench pipeline"}) {
    SCOPED_TRACE(command);
    const CliResult r = RunSwitchyard(std::string(command) + " --help");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::istringstream lines(r.out);
    std::string line;
    while (std::getline(lines, line)) EXPECT_FALSE(std::regex_search(line, bare_int)) << line;
  }
}

TEST(CliMemory, SizesThatCannotFitAreRefusedUpFront) {
  // Grew to 23 GB until the OOM killer came; smaller ones printed a bare std::bad_alloc.
  ExpectOneLineError(
      RunSwitchyardAfter(kWithin8G,
                         "schedule --pp 1024 --microbatches 65536 --kind interleaved --virtual 64"),
      2,
      {"the pipeline schedule interleaved (p 1024 x m 65536 x v 64 passes", "needs", "TiB",
       "available"});
  ExpectOneLineError(RunSwitchyardAfter(kWithin8G,
                                        "bench pipeline --pp 64 --microbatches 4096 --kind "
                                        "interleaved --virtual 16"),
                     2, {"the pipeline schedule interleaved", "needs", "available"});
  ExpectOneLineError(
      RunSwitchyardAfter(kWithin8G, "bench pipeline --activation-kib 4194304 --microbatches 4096"),
      2, {"bench pipeline: ", "activations of --activation-kib 4194304", "needs", "available"});
  // The check counted only the expert buffer (a bad_alloc followed), and E = k = 65536 computed
  // the gate for 64 s before the plan refused its rows: everything is counted before any work.
  ExpectOneLineError(RunSwitchyardAfter(kWithin8G, "bench layer --capacity-factor 1e6"), 2,
                     {"bench layer: --tokens 4096", "(capacity factor 1e+06)", "needs", "TiB"});
  ExpectOneLineError(RunSwitchyardAfter(kWithin8G, "bench layer --experts 65536 --top-k 65536"), 2,
                     {"bench layer: ", "--experts 65536", "needs", "available"});
  ExpectOneLineError(RunSwitchyard("bench layer --capacity-factor 1e18"), 2,
                     {"--capacity-factor: '1e18'"});
  ExpectOneLineError(RunSwitchyard("bench layer --capacity-factor -1e30"), 2,
                     {"--capacity-factor: '-1e30'"});
  // The product of two 2^40 sizes overflowed the memory check, which then passed, and the
  // benchmark spun for ever.
  ExpectOneLineError(RunSwitchyardAfter(kWithin8G,
                                        "bench cp --cp 2 --seq 1099511627776 --batch "
                                        "1099511627776 --heads 2 --head-dim 1"),
                     2, {"bench cp: --batch x --seq", "overflows a 64-bit integer"});
  ExpectOneLineError(RunSwitchyardAfter(kWithin8G,
                                        "bench cp --cp 2 --seq 1073741824 --heads 1024 "
                                        "--head-dim 1024"),
                     2, {"bench cp: --seq 1073741824", "needs", "available"});
}

// groups and trace-svg hold memory in proportion to --world and to the trace: checked first too
// (here under a 400 MB address-space limit; a trace of 17 MB of blanks needs about 400 MB).
TEST(CliMemory, GroupsAndTraceSvgCheckTheirMemory) {
  const std::string limit = "ulimit -v 400000; timeout -k 5 60";
  ExpectOneLineError(RunSwitchyardAfter(limit, "groups --world 1048576 --all --json"), 2,
                     {"groups: --world 1048576", "needs 2.0 GiB", "available"});
  const std::string trace = ::testing::TempDir() + "/sy_cli_limits_blank_trace.json";
  std::ofstream(trace) << R"({"traceEvents": [)" << std::string(17 << 20, ' ') << "]}";
  ExpectOneLineError(
      RunSwitchyardAfter(limit, "trace-svg --trace " + trace + " --out " + trace + ".svg"), 2,
      {"trace-svg: the 17.0 MiB of '" + trace + "'", "needs", "available"});
  std::remove(trace.c_str());
}

// The last line of defence: an allocation that fails although the up-front check let it through
// (here the check counts the address-space limit, not what the process already maps) is one line
// naming the command, exit code 1, never a bare std::bad_alloc. p 16 x m 4096 passes are
// estimated at 16 x 4096 x 5120 bytes (parallel/pipeline.h); the limit is 4 MiB above that.
TEST(CliMemory, AnAllocationThatStillFailsIsOneLineNamingTheCommand) {
  const long limit_kib = 16L * 4096 * 5120 / 1024 + 4096;
  const CliResult r = RunSwitchyardAfter("ulimit -v " + std::to_string(limit_kib) + "; " + kWithin,
                                         "schedule --pp 16 --microbatches 4096 --json");
  ExpectOneLineError(r, 1,
                     {"switchyard: error: schedule: out of memory: an allocation failed "
                      "(std::bad_alloc)"});
}

}  // namespace
}  // namespace switchyard
