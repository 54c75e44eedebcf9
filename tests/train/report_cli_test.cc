// `switchyard report` (docs/observability.md) from the command line: the pictures and the table of
// a run directory and of the router trace its `--router_trace` wrote; a source that is neither is
// exit 2 naming it.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "train/train_cli_fixture.h"

namespace switchyard::train {
namespace {

using TrainCliReportTest = TrainCliSafetyTest;

TEST_F(TrainCliReportTest, DrawsARunAndItsRouterTrace) {
  const std::string bin = SY_SWITCHYARD_BIN;
  const CommandResult run =
      Run(Command("run", "--steps 3 --moe_every 2 --num_experts 4 --router_trace " + dir_ +
                             "/trace --router_trace_steps 1,3"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/trace/step_000001/rank_00000.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/trace/step_000002"));

  const CommandResult from_run = Run(bin + " report " + dir_ + "/run");
  ASSERT_EQ(from_run.exit_code, 0) << from_run.err;
  EXPECT_TRUE(Contains(from_run.out, "worst: MoE layer 0 at step")) << from_run.out;
  for (const char* svg : {"expert_load.svg", "imbalance.svg"}) {
    const std::string path = dir_ + "/run/report/" + svg;
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    EXPECT_TRUE(Contains(ReadAll(path), "MoE layer 0")) << path;
  }

  const CommandResult from_trace =
      Run(bin + " report --trace " + dir_ + "/trace --out " + dir_ + "/from_trace");
  ASSERT_EQ(from_trace.exit_code, 0) << from_trace.err;
  EXPECT_TRUE(Contains(from_trace.out, "worst: blocks.1.moe.")) << from_trace.out;
  EXPECT_TRUE(Contains(ReadAll(dir_ + "/from_trace/imbalance.svg"), "blocks.1.moe."));

  const CommandResult missing = Run(bin + " report " + dir_ + "/nothing");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_TRUE(Contains(missing.err, "has no metrics.jsonl")) << missing.err;
}

}  // namespace
}  // namespace switchyard::train
