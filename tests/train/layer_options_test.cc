// The MoE layer's options as training-run keys (docs/training.md, "MoE layer options"): each one
// reaches the layer of every MoE block, and several optimizer steps on W in-process ranks give the
// single-rank run's losses, gradient norms, expert loads and parameters. Also: the step trace
// (trace_step), gradient accumulation with MoE blocks whose routing does not depend on the
// micro-batch split, and the config keys' parsing and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/file_util.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/zero.h"
#include "train/run_compare.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using testing::TempDir;

// The distributed tests' tiny MoE model (train/tiny_run.h), without the final sample.
TrainConfig QuietTinyMoeConfig(const TempDir& dir) {
  TrainConfig c = testing::TinyMoeConfig(dir);
  c.sample_tokens = 0;
  return c;
}

using RunResult = testing::RunRecord;
using testing::ExpectSameRun;
using testing::SingleRank;

RunResult OnRanks(const TrainConfig& c, int steps) {
  return testing::OnRanks(c, steps, ZeroOptions{.poison_non_owned = true});
}

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The names of the events of a trace.json, per (rank, stream) track: tid = 2 rank + stream.
std::map<int, std::multiset<std::string>> TraceTracks(const std::string& path) {
  const nlohmann::json j = nlohmann::json::parse(ReadTextFile(path));
  std::map<int, std::multiset<std::string>> tracks;
  for (const nlohmann::json& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    tracks[e.at("tid").get<int>()].insert(e.at("name").get<std::string>());
  }
  return tracks;
}

bool HasPrefix(const std::multiset<std::string>& names, const std::string& prefix) {
  for (const std::string& n : names) {
    if (n.starts_with(prefix)) return true;
  }
  return false;
}

class LayerOptionsTest : public ::testing::Test {
 protected:
  void SetUp() override { kernels::SetBlasThreads(1); }
  TempDir dir_;
};

// Tutel's adaptive r: 2 experts on 4 ranks (each expert's hidden dimension in n = 2 H-shards), so
// r = 0 (every rank gathers the experts' weights), 1 and 2 are all possible; fixed, auto and a
// list that changes r every step give the one-rank run. The trace of a step shows which r ran:
// r = 0 sends no tokens (no "send c<chunk>" events on the comm track), r >= 1 does.
TEST_F(LayerOptionsTest, AdaptiveRFixedAutoAndSwitchedBetweenStepsMatchOneRank) {
  TrainConfig base = QuietTinyMoeConfig(dir_);
  base.num_experts = 2;
  base.top_k = 1;
  const int kSteps = 3;
  const RunResult want = SingleRank(base, kSteps);
  for (const char* r : {"0", "1", "2", "auto", "0,2,1"}) {
    TrainConfig c = base;
    c.ranks = 4;
    c.adaptive_r = r;
    ExpectSameRun(want, OnRanks(c, kSteps), fmt::format("adaptive_r {}", r));
  }
  // Which r ran: step 1 under "0,1" (r = 0) and step 2 (r = 1).
  for (int step : {1, 2}) {
    TrainConfig c = base;
    c.ranks = 4;
    c.adaptive_r = "0,1";
    c.trace_step = step;
    c.out = dir_ / fmt::format("trace{}", step);
    OnRanks(c, 2);
    const auto tracks = TraceTracks(c.out + "/trace.json");
    ASSERT_TRUE(tracks.contains(1)) << "step " << step;
    EXPECT_EQ(HasPrefix(tracks.at(1), "send c"), step == 2) << "step " << step;
  }
  // An r that does not divide the H-shards.
  TrainConfig bad = base;
  bad.ranks = 4;
  bad.adaptive_r = "1,3";
  const std::string e = ErrorOf([&] { OnRanks(bad, 1); });
  EXPECT_NE(e.find("'adaptive_r' \"1,3\": r = 3 is neither 0 nor a divisor of the 2 H-shard"),
            std::string::npos)
      << e;
}

// Tutel's 2DH all-to-all (nodes of 2 ranks, and the machine's ranks per node), FasterMoE's smart
// schedule and shadow experts, each with check_finite on: the one-rank run. The step traces show
// the smart schedule's pair-wise steps and the shadowed experts' broadcasts.
TEST_F(LayerOptionsTest, HierarchicalSmartScheduleAndShadowExpertsMatchOneRank) {
  TrainConfig base = QuietTinyMoeConfig(dir_);
  const int kSteps = 3;
  const RunResult want = SingleRank(base, kSteps);
  struct Case {
    const char* what;
    const char* dispatch = "alltoall";
    const char* a2a = "flat";
    int per_node = 0;
    const char* smart = "off";
    const char* shadow = "none";
    int zero = 0;
    // A communication event of rank 0 that only this option makes (its trace of step 1).
    const char* event = nullptr;
  };
  const Case cases[] = {
      {"2dh, 2 ranks per node", "alltoall", "2dh", 2},
      {"2dh, the machine's ranks per node", "alltoall", "2dh", 0, "off", "none", 2},
      {"smart schedule g 2", "alltoall", "flat", 0, "2", "none", 0, "send c1"},  // 2 steps
      {"smart schedule auto, alltoallv", "alltoallv", "flat", 0, "auto"},
      {"shadow experts 0,3", "alltoall", "flat", 0, "off", "0,3", 0, "broadcast e3"},
      {"shadow experts auto, alltoallv", "alltoallv", "flat", 0, "off", "auto", 1},
  };
  for (const Case& k : cases) {
    TrainConfig c = base;
    c.ranks = 4;
    c.dispatch = k.dispatch;
    c.a2a_algo = k.a2a;
    c.a2a_ranks_per_node = k.per_node;
    c.smart_schedule = k.smart;
    c.shadow_experts = k.shadow;
    c.zero_stage = k.zero;
    c.check_finite = true;
    c.trace_step = 1;
    c.out = dir_ / "traced";
    ExpectSameRun(want, OnRanks(c, kSteps), k.what);
    if (k.event != nullptr) {
      EXPECT_TRUE(TraceTracks(c.out + "/trace.json")[1].contains(k.event)) << k.what;
    }
  }
  // The options reach the layer: its options in the rank's FFN.
  TrainConfig c = base;
  c.ranks = 4;
  c.a2a_algo = "2dh";
  c.a2a_ranks_per_node = 2;
  c.smart_schedule = "off";
  c.shadow_experts = "1";
  c.check_finite = true;
  const parallel::ParallelOptions o = TrainParallelOptions(c, 4);
  EXPECT_EQ(o.hierarchical_ranks_per_node, 2);
  EXPECT_EQ(o.shadow.policy, parallel::ShadowPolicy::kList);
  EXPECT_EQ(o.shadow.experts, std::vector<int64_t>{1});
  EXPECT_TRUE(MoeLayerConfig(c).check_finite);
  c.smart_schedule = "2";
  EXPECT_EQ(TrainParallelOptions(c, 4).smart_group, 2);
  c.dispatch = "allgather";
  EXPECT_NE(ErrorOf([&] { TrainParallelOptions(c, 4); }).find("'a2a_algo' 2dh"), std::string::npos);
  // The a2a-FFN pipeline needs exchanged tokens: refused with the config, not when the layer is
  // built (the planner's layouts go through the same check).
  c.a2a_algo = base.a2a_algo;
  c.smart_schedule = base.smart_schedule;
  c.shadow_experts = base.shadow_experts;
  c.overlap_degree = 2;
  EXPECT_NE(ErrorOf([&] { TrainParallelOptions(c, 4); }).find("'overlap_degree' 2 pipelines"),
            std::string::npos);
  c.dispatch = "alltoallv";
  EXPECT_EQ(TrainParallelOptions(c, 4).overlap_degree, 2);
}

// The per-rank routing scope (Tutel's and DeepSpeed's default): capacity, drops and the balancing
// losses from each data-parallel rank's own rows. W data-parallel ranks then equal one rank that
// routes each of W micro-batches on its own (microbatches = W), drops included; the global scope
// does not (the runs differ, which makes the comparison meaningful).
TEST_F(LayerOptionsTest, PerRankRoutingScopeEqualsOneRankWithAMicroBatchPerRank) {
  TrainConfig base = QuietTinyMoeConfig(dir_);
  base.routing_scope = "per_rank";
  const int kSteps = 3;
  for (int ranks : {2, 4}) {
    TrainConfig one = base;
    one.microbatches = ranks;
    const RunResult want = SingleRank(one, kSteps);
    for (double d : want.drop_rate) EXPECT_GT(d, 0.0);
    TrainConfig c = base;
    c.ranks = ranks;
    ExpectSameRun(want, OnRanks(c, kSteps), fmt::format("per_rank on {} ranks", ranks));
    if (ranks == 4) {
      c.ep = 2;
      c.zero_stage = 2;
      c.dispatch = "alltoallv";
      ExpectSameRun(want, OnRanks(c, kSteps), "per_rank on 4 ranks, ep 2, ZeRO 2, alltoallv");
    }
    TrainConfig global = c;
    global.routing_scope = "global";
    global.ep = 0;
    global.zero_stage = 0;
    global.dispatch = "alltoall";
    const RunResult other = OnRanks(global, 1);
    EXPECT_GT(std::abs(other.loss[0] - want.loss[0]), 1e-5) << ranks << " ranks";
  }
}

// Gradient accumulation (micro-batch size x micro-batches = batch): an MoE model whose routing
// does not depend on how the batch is split -- no drops (capacity_factor 0) and no load-balancing
// loss (l_aux is not linear in the tokens; the z-loss, a mean over tokens, is) -- takes the
// whole-batch steps with 2 or 4 micro-batches, on one rank and on 2 ranks.
TEST_F(LayerOptionsTest, MicrobatchesEqualTheWholeBatchWithMoeBlocks) {
  TrainConfig base = QuietTinyMoeConfig(dir_);
  base.capacity_factor = 0;
  base.aux_loss_coef = 0;
  const int kSteps = 3;
  const RunResult want = SingleRank(base, kSteps);
  for (double d : want.drop_rate) EXPECT_EQ(d, 0.0);
  for (int m : {2, 4}) {
    TrainConfig c = base;
    c.microbatches = m;
    ExpectSameRun(want, SingleRank(c, kSteps), fmt::format("{} micro-batches", m));
  }
  TrainConfig c = base;
  c.microbatches = 2;
  c.ranks = 2;
  ExpectSameRun(want, OnRanks(c, kSteps), "2 micro-batches on 2 ranks");
}

// trace_step: one step of every rank in <out>/trace.json (Chrome trace events): a compute and a
// communication track per rank, with the trainer's phases and the MoE blocks' events; tracing
// does not change the run.
TEST_F(LayerOptionsTest, TraceStepWritesEveryRanksComputeAndCommunication) {
  TrainConfig c = QuietTinyMoeConfig(dir_);
  c.ranks = 2;
  c.zero_stage = 3;
  const RunResult plain = OnRanks(c, 3);
  c.trace_step = 2;
  ExpectSameRun(plain, OnRanks(c, 3), "traced");
  const auto tracks = TraceTracks(c.out + "/trace.json");
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(tracks.contains(2 * rank)) << "rank " << rank << " compute";
    ASSERT_TRUE(tracks.contains(2 * rank + 1)) << "rank " << rank << " comm";
    const auto& compute = tracks.at(2 * rank);
    const auto& comm = tracks.at(2 * rank + 1);
    EXPECT_EQ(compute.count("forward + backward"), 1u) << rank;
    EXPECT_EQ(compute.count("optimizer step"), 1u) << rank;
    EXPECT_TRUE(compute.contains("gate")) << rank;
    EXPECT_TRUE(HasPrefix(compute, "experts")) << rank;
    EXPECT_EQ(comm.count("gradient reduce"), 1u) << rank;
    EXPECT_EQ(comm.count("gradient norm"), 1u) << rank;
    // ZeRO-3: the parameters outside blocks at the step's start, each block's before its
    // forward and again before its backward (2 blocks).
    EXPECT_EQ(comm.count("parameter all-gather"), 1u) << rank;
    EXPECT_EQ(comm.count("block parameter all-gather"), 4u) << rank;
    EXPECT_GE(comm.size(), 5u) << rank;  // the MoE block's collectives
  }
  // Exactly one step: the MoE block ran forward and backward once per rank.
  EXPECT_EQ(tracks.at(0).count("gate"), 1u);
}

TEST(LayerOptionKeysTest, ParseValidateAndNameTheKey) {
  TrainConfig c;
  SetTrainConfigValue(c, "adaptive_r", "2");  // a bare number
  EXPECT_EQ(c.adaptive_r, "2");
  SetTrainConfigValue(c, "adaptive_r", "1,0,2");
  EXPECT_EQ(AdaptiveRAtStep(c.adaptive_r, 0), 1);
  EXPECT_EQ(AdaptiveRAtStep(c.adaptive_r, 1), 0);
  EXPECT_EQ(AdaptiveRAtStep(c.adaptive_r, 5), 2);
  EXPECT_EQ(AdaptiveRAtStep("auto", 3), parallel::kAdaptiveRAuto);
  EXPECT_EQ(AdaptiveRAtStep("default", 3), parallel::kAdaptiveRDefault);
  SetTrainConfigValue(c, "smart_schedule", "2");
  EXPECT_EQ(c.smart_schedule, "2");
  SetTrainConfigValue(c, "shadow_experts", "0,3");
  EXPECT_EQ(c.shadow_experts, "0,3");
  ValidateTrainConfig(c);
  for (const char* key : {"adaptive_r", "a2a_algo", "a2a_ranks_per_node", "smart_schedule",
                          "shadow_experts", "trace_step"}) {
    EXPECT_TRUE(IsLayoutKey(key)) << key;
  }
  EXPECT_FALSE(IsLayoutKey("routing_scope"));  // changes what is computed
  // Round trip through JSON.
  c.routing_scope = "per_rank";
  c.a2a_algo = "2dh";
  c.val_data = "held.txt";
  const TrainConfig back = TrainConfigFromJson(TrainConfigToJson(c));
  EXPECT_EQ(back.adaptive_r, "1,0,2");
  EXPECT_EQ(back.routing_scope, "per_rank");
  EXPECT_EQ(back.a2a_algo, "2dh");
  EXPECT_EQ(back.val_data, "held.txt");
  struct Bad {
    const char* key;
    const char* value;
    const char* message;
  };
  for (const Bad& b : {
           Bad{"adaptive_r", "1,x", "'adaptive_r' \"1,x\": expected"},
           Bad{"adaptive_r", "-3", "'adaptive_r' \"-3\""},
           Bad{"routing_scope", "local", "'routing_scope' must be \"global\" or \"per_rank\""},
           Bad{"a2a_algo", "tree", "'a2a_algo' must be \"flat\" or \"2dh\""},
           Bad{"smart_schedule", "often", "'smart_schedule' \"often\""},
           Bad{"shadow_experts", "a,b", "'shadow_experts' \"a,b\""},
           Bad{"trace_step", "-1", "'trace_step' must be >= 0"},
       }) {
    TrainConfig x;
    const std::string e = ErrorOf([&] {
      SetTrainConfigValue(x, b.key, b.value);
      ValidateTrainConfig(x);
    });
    EXPECT_NE(e.find(b.message), std::string::npos) << b.key << " " << b.value << ": " << e;
  }
}

}  // namespace
}  // namespace switchyard::train
