// `switchyard report` (docs/observability.md) from the command line: the pictures and the table of
// a run directory and of the router trace its `--router_trace` wrote; a source that is neither is
// exit 2 naming it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

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

  // Every line holds the layer's router statistics, consistent with its loads; the run's summary
  // names the line of the largest max/mean.
  const std::vector<json> lines = Metrics("run");
  ASSERT_EQ(lines.size(), 3u);
  double worst = 0;
  int64_t worst_step = 0;
  for (const json& line : lines) {
    ASSERT_TRUE(line.contains("router")) << line.dump();
    ASSERT_EQ(line.at("router").size(), 1u) << line.dump();
    const json& r = line.at("router")[0];
    const std::vector<int64_t> load = line.at("expert_load")[0].get<std::vector<int64_t>>();
    int64_t routed = 0;
    for (int64_t l : load) routed += l;
    const int64_t most = *std::max_element(load.begin(), load.end());
    EXPECT_EQ(r.at("routed").get<int64_t>(), routed);
    EXPECT_EQ(r.at("num_tokens").get<int64_t>(), 8 * 16);
    EXPECT_EQ(r.at("max_load").get<int64_t>(), most);
    EXPECT_EQ(r.at("min_load").get<int64_t>(), *std::min_element(load.begin(), load.end()));
    EXPECT_NEAR(r.at("max_over_mean").get<double>(), 4.0 * static_cast<double>(most) / routed,
                1e-12);
    EXPECT_EQ(r.at("dropped_share").get<double>(), line.at("drop_rate")[0].get<double>());
    EXPECT_GT(r.at("entropy").get<double>(), 0.0);
    for (const char* key : {"cv", "l_aux", "z_loss", "bias_min", "bias_max"}) {
      EXPECT_TRUE(r.contains(key)) << key;
    }
    if (r.at("max_over_mean").get<double>() > worst) {
      worst = r.at("max_over_mean").get<double>();
      worst_step = line.at("step").get<int64_t>();
    }
  }
  EXPECT_TRUE(Contains(run.out, fmt::format("routing: worst imbalance MoE layer 0 at step {}: "
                                            "max/mean {:.3f}",
                                            worst_step, worst)))
      << run.out;
  // With log_every 2 a line's statistics are those of its two steps summed (its expert_load).
  const CommandResult two =
      Run(Command("two", "--steps 4 --log_every 2 --moe_every 2 --num_experts 4"));
  ASSERT_EQ(two.exit_code, 0) << two.err;
  const std::vector<json> pairs = Metrics("two");
  ASSERT_EQ(pairs.size(), 2u);
  for (const json& line : pairs) {
    const json& r = line.at("router")[0];
    const std::vector<int64_t> load = line.at("expert_load")[0].get<std::vector<int64_t>>();
    int64_t routed = 0;
    for (int64_t l : load) routed += l;
    EXPECT_EQ(r.at("num_tokens").get<int64_t>(), 2 * 8 * 16) << line.dump();
    EXPECT_EQ(r.at("routed").get<int64_t>(), routed) << line.dump();
    EXPECT_NEAR(r.at("max_over_mean").get<double>(),
                4.0 * static_cast<double>(*std::max_element(load.begin(), load.end())) / routed,
                1e-12)
        << line.dump();
  }
  const json summary = json::parse(ReadAll(dir_ + "/run/summary.json"));
  EXPECT_EQ(summary.at("router_worst").at("step").get<int64_t>(), worst_step);
  EXPECT_EQ(summary.at("router_worst").at("max_over_mean").get<double>(), worst);

  const CommandResult from_run = Run(bin + " report " + dir_ + "/run");
  ASSERT_EQ(from_run.exit_code, 0) << from_run.err;
  EXPECT_TRUE(Contains(from_run.out, fmt::format("worst: MoE layer 0 at step {}: max/mean {:.3f}",
                                                 worst_step, worst)))
      << from_run.out;
  for (const char* svg : {"expert_load.svg", "imbalance.svg"}) {
    const std::string path = dir_ + "/run/report/" + svg;
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    EXPECT_TRUE(Contains(ReadAll(path), "MoE layer 0")) << path;
  }
  // The heatmap is the data's: a cell per step and expert holding its load; the imbalance curve
  // has a point per line.
  const std::string heatmap = ReadAll(dir_ + "/run/report/expert_load.svg");
  for (const json& line : lines) {
    const std::vector<int64_t> load = line.at("expert_load")[0].get<std::vector<int64_t>>();
    for (size_t e = 0; e < load.size(); ++e) {
      const std::string cell = fmt::format("<title>step {} expert {}: {} tokens</title>",
                                           line.at("step").get<int64_t>(), e, load[e]);
      EXPECT_TRUE(Contains(heatmap, cell)) << cell;
    }
  }
  const std::string curve = ReadAll(dir_ + "/run/report/imbalance.svg");
  const size_t points = curve.find("<polyline points=\"");
  ASSERT_NE(points, std::string::npos);
  const std::string coords = curve.substr(points, curve.find('"', points + 18) - points);
  EXPECT_EQ(std::count(coords.begin(), coords.end(), ','), 3) << coords;

  const CommandResult from_trace =
      Run(bin + " report --trace " + dir_ + "/trace --out " + dir_ + "/from_trace");
  ASSERT_EQ(from_trace.exit_code, 0) << from_trace.err;
  EXPECT_TRUE(Contains(from_trace.out, "worst: blocks.1.moe.")) << from_trace.out;
  EXPECT_TRUE(Contains(ReadAll(dir_ + "/from_trace/imbalance.svg"), "blocks.1.moe."));
  // The trace's heatmap holds the recorded steps' loads: those the run logged for steps 1 and 3.
  const std::string trace_heatmap = ReadAll(dir_ + "/from_trace/expert_load.svg");
  for (size_t at : {size_t{0}, size_t{2}}) {
    const std::vector<int64_t> load = lines[at].at("expert_load")[0].get<std::vector<int64_t>>();
    for (size_t e = 0; e < load.size(); ++e) {
      const std::string cell = fmt::format("<title>step {} expert {}: {} tokens</title>",
                                           lines[at].at("step").get<int64_t>(), e, load[e]);
      EXPECT_TRUE(Contains(trace_heatmap, cell)) << cell;
    }
  }

  const CommandResult missing = Run(bin + " report " + dir_ + "/nothing");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_TRUE(Contains(missing.err, "has no metrics.jsonl")) << missing.err;
}

}  // namespace
}  // namespace switchyard::train
