// One flag convention across subcommands (docs/cli.md, "Flag spelling"): flags are spelled with
// dashes, the old underscore spellings still work (only the name before '=' is rewritten, never a
// value), help shows what each value is (INT, FLOAT, SIZES, PATH, NAME), never TEXT, and trace-svg
// takes --trace / --out as well as its older positional form.
#include <gtest/gtest.h>

#include <filesystem>
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

const std::vector<std::string> kCommands = {"train",      "train-dense", "layer",
                                            "groups",     "trace-svg",   "bench comm",
                                            "bench gemm", "bench layer", "bench layer-parallel"};

TEST(CliFlags, HelpShowsDashedFlagsWithValueTypes) {
  for (const std::string& command : kCommands) {
    SCOPED_TRACE(command);
    CliResult r = RunSwitchyard(command + " --help");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out.find("TEXT"), std::string::npos) << r.out;
    // Declared flags (lines of the options list) are dashed.
    std::istringstream lines(r.out);
    std::string line;
    const std::regex underscored("^\\s+--[a-z0-9-]*_");
    while (std::getline(lines, line)) {
      EXPECT_FALSE(std::regex_search(line, underscored)) << line << " in:\n" << r.out;
    }
  }
  CliResult r = RunSwitchyard("train --help");
  for (const char* flag : {"--batch-size INT", "--lr FLOAT", "--data PATH", "--dispatch NAME",
                           "--tied-head BOOL", "--moe-layer-config PATH", "--zero-stage INT"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag << " in:\n" << r.out;
  }
  EXPECT_NE(r.out.find("keys of a --config JSON file are the flag names with underscores"),
            std::string::npos)
      << r.out;
  r = RunSwitchyard("bench comm --help");
  EXPECT_NE(r.out.find("--sizes SIZES"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--intra-latency-us FLOAT"), std::string::npos) << r.out;
}

TEST(CliFlags, UnderscoreSpellingsAreAliases) {
  // train and train-dense: the value reaches the same key, spelled either way (a value the key
  // refuses, so that nothing trains).
  for (const char* command : {"train", "train-dense"}) {
    for (const char* flag : {"--batch-size 0", "--batch_size 0", "--batch_size=0"}) {
      SCOPED_TRACE(std::string(command) + " " + flag);
      CliResult r = RunSwitchyard(std::string(command) + " --steps 1 " + flag);
      EXPECT_EQ(r.exit_code, 2) << r.err;
      EXPECT_NE(r.err.find("'batch_size' must be >= 1, got 0"), std::string::npos) << r.err;
    }
  }
  // The dashed subcommands accept underscores too; values keep theirs (reduce_scatter).
  CliResult r = RunSwitchyard(
      "bench comm --op reduce_scatter --ranks 2 --ranks_per_node 1 --reduce_op max --sizes 1K "
      "--iters 1 --warmup 0 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"op\":\"reduce_scatter\""), std::string::npos) << r.out;
  r = RunSwitchyard("groups --world 4 --ep 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // An unknown flag is still an error, exit 2.
  r = RunSwitchyard("groups --world 4 --no_such_flag 1");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("no-such-flag"), std::string::npos) << r.err;
}

TEST(CliFlags, TraceSvgTakesFlagsOrPositionals) {
  const std::string dir = ::testing::TempDir() + "/sy_cli_trace_svg";
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/t.json");
    f << R"({"traceEvents": [{"ph": "X", "tid": 0, "name": "experts c0", "cat": "forward",
             "ts": 0, "dur": 10}, {"ph": "X", "tid": 1, "name": "send c0", "cat": "forward",
             "ts": 5, "dur": 3}]})";
  }
  CliResult r = RunSwitchyard("trace-svg --trace " + dir + "/t.json --out " + dir + "/a.svg");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/a.svg"));
  r = RunSwitchyard("trace-svg " + dir + "/t.json " + dir + "/b.svg");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/b.svg"));
  r = RunSwitchyard("trace-svg --trace " + dir + "/t.json " + dir + "/c.svg");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/c.svg"));
  r = RunSwitchyard("trace-svg --trace " + dir + "/t.json");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--out PATH is required"), std::string::npos) << r.err;
  r = RunSwitchyard("trace-svg --trace " + dir + "/t.json --out " + dir + "/d.svg " + dir +
                    "/x.json " + dir + "/e.svg");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("name different files"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace switchyard
