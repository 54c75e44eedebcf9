// `switchyard layer --ranks W ...` end to end: the same in.safetensors gives the same
// out.safetensors as the single-rank run for every layout; `switchyard groups` prints the groups;
// bad layouts exit with code 2 and one line naming what does not divide; `--adaptive-r auto`
// prints the r and predicted volume the library's choice gives.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "parallel/cli_helpers.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::parallel {
namespace {

using testing::ReadAll;
using testing::RunCommand;
using testing::SameOutputs;

const char* kConfig = R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "top_k": 2,
  "capacity_factor": 0.75, "z_loss_coef": 0.01, "aux_loss_coef": 0.1})";

// The executable under test; the environment variable SY_SWITCHYARD_BIN runs the tests against
// another build.
std::string Bin() {
  const char* env = std::getenv("SY_SWITCHYARD_BIN");
  return env != nullptr && *env != '\0' ? env : SY_SWITCHYARD_BIN;
}

std::string Layer(const std::string& dir, const std::string& out, const std::string& flags) {
  return Bin() + " layer --quiet --config " + dir + "/layer.json" + " --tensors " + dir +
         "/in.safetensors --out " + dir + "/" + out + " " + flags;
}

TEST(CliLayerParallel, EveryLayoutWritesTheSingleRankOutputs) {
  const std::string dir = testing::TestDir("sy_cli_parallel");
  testing::WriteLayerInputs(dir, kConfig, 30);
  ASSERT_EQ(RunCommand(Layer(dir, "single.safetensors", ""), dir).exit_code, 0);
  for (const char* flags :
       {"--ranks 4", "--ranks 4 --dispatch alltoallv --tp 2", "--ranks 4 --dispatch allgather",
        "--ranks 4 --2dh 2", "--ranks 2 --adaptive-r 0",
        "--ranks 4 --arrangement megatron --etp 2 --dispatch alltoallv",
        "--ranks 8 --adaptive-r auto", "--ranks 8 --adaptive-r 2", "--ranks 3 --ep 1"}) {
    testing::CommandResult r = RunCommand(Layer(dir, "parallel.safetensors", flags), dir);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.err;
    EXPECT_TRUE(SameOutputs(dir + "/parallel.safetensors", dir + "/single.safetensors")) << flags;
  }
}

TEST(CliLayerParallel, EveryScheduleWritesTheSingleRankOutputs) {
  const std::string dir = testing::TestDir("sy_cli_parallel");
  testing::WriteLayerInputs(dir, kConfig, 30);
  ASSERT_EQ(RunCommand(Layer(dir, "single.safetensors", ""), dir).exit_code, 0);
  for (const char* flags :
       {"--ranks 4 --overlap-degree 2", "--ranks 4 --dispatch alltoallv --overlap-degree 3",
        "--ranks 4 --smart-schedule 2", "--ranks 4 --smart-schedule auto --dispatch alltoallv",
        "--ranks 4 --shadow auto", "--ranks 4 --shadow 0,1 --overlap-degree 2",
        "--ranks 8 --adaptive-r 2 --overlap-degree 2", "--ranks 4 --2dh 2 --overlap-degree 2"}) {
    testing::CommandResult r = RunCommand(Layer(dir, "parallel.safetensors", flags), dir);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.err;
    EXPECT_TRUE(SameOutputs(dir + "/parallel.safetensors", dir + "/single.safetensors")) << flags;
  }
  testing::CommandResult r = RunCommand(
      Layer(dir, "parallel.safetensors", "--ranks 4 --overlap-degree 2 --dispatch allgather"), dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("overlap degree 2 applies to"), std::string::npos) << r.err;
}

TEST(CliLayerParallel, TraceFileAndItsSvgTimeline) {
  const std::string dir = testing::TestDir("sy_cli_parallel");
  testing::WriteLayerInputs(dir, kConfig, 30);
  testing::CommandResult r = RunCommand(
      Layer(dir, "out.safetensors", "--ranks 2 --overlap-degree 2 --trace " + dir + "/t.json"),
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(testing::ReadAll(dir + "/t.json"));
  std::set<std::string> names;
  for (const auto& e : j["traceEvents"]) names.insert(e["name"].get<std::string>());
  for (const char* n : {"thread_name", "gate", "send c0", "experts c1", "return c1", "decode"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  r = RunCommand(std::string(SY_SWITCHYARD_BIN) + " trace-svg " + dir + "/t.json " + dir +
                     "/t.svg --category forward",
                 dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string svg = testing::ReadAll(dir + "/t.svg");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("rank 1 comm"), std::string::npos);
  EXPECT_NE(svg.find("experts c1"), std::string::npos);
  r = RunCommand(
      std::string(SY_SWITCHYARD_BIN) + " trace-svg " + dir + "/layer.json " + dir + "/bad.svg",
      dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

TEST(CliBenchLayer, RanksReachTheParallelBenchWithTheSchedules) {
  const std::string dir = testing::TestDir("sy_cli_parallel");
  testing::CommandResult r = RunCommand(
      std::string(SY_SWITCHYARD_BIN) +
          " bench layer --ranks 2 --tokens 64 --model-dim 16 --hidden-dim 32 --experts 4 "
          "--overlap-degree 2 --repeat 1 --warmup 0 --rounds 1 --no-reference --json "
          "--emulate-ranks-per-node 1 --inter-gbps 1 --trace " +
          dir + "/b.json",
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["op"], "layer-parallel");
  EXPECT_EQ(j["ranks"], 2);
  EXPECT_EQ(j["schedule"]["overlap_degree"], 2);
  EXPECT_TRUE(j["schedule"].contains("plain_step_median_ms"));
  EXPECT_TRUE(j["schedule"].contains("hidden_fraction"));
  EXPECT_EQ(j["emulation"]["inter_gbps"], 1.0);
  EXPECT_NO_THROW(nlohmann::json::parse(testing::ReadAll(dir + "/b.json")));
}

TEST(CliLayerParallel, AdaptiveRAutoPrintsTheChosenRAndItsPredictedVolume) {
  // W = 8, E = 2: each expert split over n = 4 ranks, r in {0, 1, 2, 4}. Large experts (H 64) and
  // few tokens make the weights term dominate, so auto picks a large r.
  const std::string dir = testing::TestDir("sy_cli_parallel");
  const char* config_json = R"({"model_dim": 8, "hidden_dim": 64, "num_experts": 2, "top_k": 1,
    "capacity_factor": 1.0})";
  testing::WriteLayerInputs(dir, config_json, 16);
  testing::CommandResult r = RunCommand(
      std::string(SY_SWITCHYARD_BIN) + " layer --config " + dir + "/layer.json --tensors " + dir +
          "/in.safetensors --out " + dir + "/out.safetensors --ranks 8 --adaptive-r auto",
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::smatch match;
  const std::regex line(R"(volume model for r = (\d+) \(auto\): predicted volume (\S+) elements)");
  ASSERT_TRUE(std::regex_search(r.out, match, line)) << r.out;
  const int printed_r = std::stoi(match[1].str());
  const double printed_volume = std::stod(match[2].str());

  // What the library chooses for this config: C_g = E * C * M with C the largest kept count of
  // any (rank, expert) over the 8 token shards (global scope: the single-rank layer's routing of
  // the whole batch), P = E * (2 H M + H + M).
  const moe::LayerConfig config = moe::LayerConfigFromJson(config_json);
  const TensorMap in = ReadSafetensors(dir + "/in.safetensors");
  const moe::LayerOutput single =
      moe::MoeLayer(config).Forward(moe::ParamsFromMap(config, in), in.at("x"));
  const int ranks = 8, shards = ranks / static_cast<int>(config.num_experts);
  const std::vector<int64_t> split = EvenSplit(single.topk_idx.size(0), ranks);
  int64_t capacity = 0, token = 0;
  for (int64_t tokens : split) {
    std::vector<int64_t> kept(static_cast<size_t>(config.num_experts), 0);
    for (int64_t t = token; t < token + tokens; ++t) {
      for (int64_t j = 0; j < config.top_k; ++j) {
        const int64_t i = t * config.top_k + j;
        if (single.locations.At(i) >= 0) ++kept[static_cast<size_t>(single.topk_idx.At(i))];
      }
    }
    token += tokens;
    capacity = std::max(capacity, *std::max_element(kept.begin(), kept.end()));
  }
  const double m = static_cast<double>(config.model_dim),
               h = static_cast<double>(config.hidden_dim);
  const double capacity_volume = static_cast<double>(config.num_experts * capacity) * m;
  const double params = static_cast<double>(config.num_experts) * (2 * h * m + h + m);
  const int expected_r = ChooseAdaptiveR(shards, capacity_volume, params, config.num_experts);
  EXPECT_EQ(printed_r, expected_r) << r.out;
  EXPECT_EQ(printed_volume,
            PredictedVolume(expected_r, capacity_volume, params, config.num_experts))
      << r.out;
  EXPECT_NE(expected_r, 1) << "the config should make auto differ from the default r";
}

TEST(CliLayerParallel, NonDividingLayoutIsOneClearLine) {
  const std::string dir = testing::TestDir("sy_cli_parallel");
  testing::WriteLayerInputs(dir, kConfig, 10);
  testing::CommandResult r = RunCommand(Layer(dir, "out.safetensors", "--ranks 3"), dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("num_experts 4 is not divisible by ep 3"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// check_finite holds with ranks as with one: a NaN in x or dy is refused (exit 2, one line).
TEST(CliLayerParallel, CheckFiniteIsHonouredOnRanks) {
  const std::string dir = testing::TestDir("sy_cli_parallel");
  const std::string config = R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4,
    "check_finite": true})";
  testing::WriteLayerInputs(dir, config, 6);
  TensorMap in = ReadSafetensors(dir + "/in.safetensors");
  for (const char* name : {"x", "dy"}) {
    TensorMap bad = in;
    bad[name] = in.at(name).Clone();
    bad[name].data<float>()[9] = std::numeric_limits<float>::quiet_NaN();
    WriteSafetensors(dir + "/in.safetensors", bad);
    for (const char* flags : {"", "--ranks 2", "--ranks 4 --scope per_rank"}) {
      testing::CommandResult r = RunCommand(Layer(dir, "out.safetensors", flags), dir);
      EXPECT_EQ(r.exit_code, 2) << name << " " << flags << ": " << r.err << r.out;
      EXPECT_NE(r.err.find(std::string(name) + ": element [1, 1] is nan (check_finite is on)"),
                std::string::npos)
          << name << " " << flags << ": " << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
  }
}

// Per-rank scope with ranks that hold no tokens: l_aux and z_loss are the mean over the ranks
// that hold tokens, so one token on four ranks reports the one-rank values.
TEST(CliLayerParallel, PerRankScopeLeavesOutRanksWithoutTokens) {
  const std::string dir = testing::TestDir("sy_cli_parallel");
  testing::WriteLayerInputs(dir, kConfig, 1);
  testing::CommandResult one = RunCommand(Layer(dir, "one.safetensors", ""), dir);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  testing::CommandResult four =
      RunCommand(Layer(dir, "four.safetensors", "--ranks 4 --scope per_rank"), dir);
  ASSERT_EQ(four.exit_code, 0) << four.err;
  TensorMap a = ReadSafetensors(dir + "/one.safetensors");
  TensorMap b = ReadSafetensors(dir + "/four.safetensors");
  EXPECT_GT(a.at("l_aux").At(0), 0);
  EXPECT_NEAR(b.at("l_aux").At(0), a.at("l_aux").At(0), 1e-6);
  EXPECT_GT(a.at("z_loss").At(0), 0);
  EXPECT_NEAR(b.at("z_loss").At(0), a.at("z_loss").At(0), 1e-6);
  // Three tokens on four ranks: the mean of the three ranks' own values.
  testing::WriteLayerInputs(dir, kConfig, 3);
  ASSERT_EQ(RunCommand(Layer(dir, "four.safetensors", "--ranks 4 --scope per_rank"), dir).exit_code,
            0);
  const moe::LayerConfig c = moe::LayerConfigFromJson(kConfig);
  const TensorMap in = ReadSafetensors(dir + "/in.safetensors");
  moe::MoeLayer layer(c);
  const moe::LayerParams params = moe::ParamsFromMap(c, in);
  double l_aux = 0;
  for (int64_t t = 0; t < 3; ++t) {
    moe::ForwardOptions fo;
    fo.global_token_offset = t;
    l_aux += layer.Forward(params, in.at("x").Slice(t, t + 1), fo).l_aux;
  }
  EXPECT_NEAR(ReadSafetensors(dir + "/four.safetensors").at("l_aux").At(0), l_aux / 3, 1e-5);
}

TEST(CliTraceSvg, OutputNamingTheInputIsRefused) {
  const std::string dir = testing::TestDir("sy_cli_trace_svg");
  WriteTextFileAtomic(dir + "/t.json", R"({"traceEvents": []})");
  testing::CommandResult r =
      RunCommand(Bin() + " trace-svg " + dir + "/t.json " + dir + "/./t.json", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("names the same file as input '" + dir + "/t.json'"), std::string::npos)
      << r.err;
  EXPECT_EQ(ReadAll(dir + "/t.json"), R"({"traceEvents": []})");
}

TEST(CliGroups, PrintsDeepSpeedGroupsAsJson) {
  const std::string dir = testing::TestDir("sy_cli_groups");
  testing::CommandResult r =
      RunCommand(std::string(SY_SWITCHYARD_BIN) + " groups --world 16 --ep 4 --tp 2 --json", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["groups"]["expert"][0], (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(j["groups"]["ep_dp"][0], (std::vector<int>{0, 8}));
  EXPECT_EQ(j["data_shards"], 8);
  r = RunCommand(std::string(SY_SWITCHYARD_BIN) + " groups --world 16 --ep 4 --tp 2", dir);
  EXPECT_NE(r.out.find("[0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]"), std::string::npos)
      << r.out;
}

}  // namespace
}  // namespace switchyard::parallel
