// Overlap and scheduling (docs/overlap.md) against the single-rank layer, ranks as threads: Tutel's
// overlap degree D for the fixed and variable all-to-all, FasterMoE's smart schedule and shadow
// experts, for W in {2, 4, 8}, dropless and capacity mode, even splits and splits with ranks that
// hold no tokens. Every collective has a short deadline, so a schedule that deadlocks fails with
// TimeoutError instead of hanging. Also: the cost models, options errors, bytes on the wire.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "parallel/parallel_cases.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/parallel/schedule.h"

namespace switchyard::parallel {
namespace {

using testing::Inputs;
using testing::Layout;
using testing::MakeInputs;
using testing::MatchesReference;
using testing::SmallConfig;

// W ranks with E experts, and the schedules expected to run there, written out (a schedule that
// stops being generated fails ListsExactlyTheExpectedLayouts instead of vanishing).
struct WorldCase {
  int world_size;
  int64_t num_experts;
  std::vector<std::string> layouts;
};

void PrintTo(const WorldCase& wc, std::ostream* os) {
  *os << "W=" << wc.world_size << " E=" << wc.num_experts;
}

std::vector<WorldCase> WorldCases() {
  // Even W, unsharded experts: every schedule.
  const std::vector<std::string> w2 = {"a2a_d2",
                                       "a2a_d3",
                                       "a2av_d2",
                                       "a2av_d4",
                                       "a2a_d2_tp2_dedup",
                                       "smart_g1",
                                       "smart_g2_a2av",
                                       "smart_auto",
                                       "smart_g1_d2_a2av",
                                       "shadow_auto",
                                       "shadow_0_a2av",
                                       "shadow_0_1_d2_smart_g1",
                                       "shadow_auto_ep_replicas"};
  const std::vector<std::string> w4 = {"a2a_d2",
                                       "a2a_d3",
                                       "a2av_d2",
                                       "a2av_d4",
                                       "a2a_d2_2dh",
                                       "a2a_d2_tp2_dedup",
                                       "smart_g1",
                                       "smart_g2_a2av",
                                       "smart_auto",
                                       "smart_g1_d2_a2av",
                                       "shadow_auto",
                                       "shadow_0_a2av",
                                       "shadow_0_1_d2_smart_g1",
                                       "shadow_auto_ep_replicas"};
  return {
      {2, 4, w2},
      {4, 4, w4},
      {4, 8, w4},
      // E = 2 < W = 4: experts split in n = 2 (sharded r 1 and 2; no shadows except with ep 2,
      // where they are not split).
      {4,
       2,
       {"a2a_d2", "a2a_d3", "a2av_d2", "a2av_d4", "a2a_d2_2dh", "a2a_d2_tp2_dedup",
        "a2a_d2_sharded_r1", "a2av_d2_sharded_r2", "smart_g1", "smart_g2_a2av", "smart_auto",
        "smart_g1_d2_a2av", "shadow_auto_ep_replicas"}},
      {8, 8, w4},
  };
}

// A split with a rank (two for W >= 4) holding no tokens.
std::vector<int64_t> SplitWithEmptyRanks(int64_t tokens, int shards) {
  std::vector<int64_t> split = EvenSplit(tokens, shards);
  if (shards >= 2) {
    split[0] += split[1];
    split[1] = 0;
  }
  if (shards >= 4) {
    split[2] += split[shards - 1];
    split[static_cast<size_t>(shards) - 1] = 0;
  }
  return split;
}

DriverOptions WithDeadline(const ParallelOptions& p) {
  DriverOptions o;
  o.parallel = p;
  return o;
}

// The ranks' collective deadline.
comm::InProcessOptions Deadline() {
  comm::InProcessOptions inprocess;
  inprocess.timeout = comm::Milliseconds(20000);
  return inprocess;
}

class OverlapTest : public ::testing::TestWithParam<WorldCase> {};

TEST_P(OverlapTest, ListsExactlyTheExpectedLayouts) {
  const WorldCase& wc = GetParam();
  EXPECT_EQ(testing::LayoutNames(testing::OverlapLayoutsFor(wc.world_size, wc.num_experts)),
            wc.layouts)
      << "W=" << wc.world_size << " E=" << wc.num_experts;
}

TEST_P(OverlapTest, EveryScheduleEqualsWholeBatch) {
  const WorldCase& wc = GetParam();
  const std::vector<Layout> layouts = testing::OverlapLayoutsFor(wc.world_size, wc.num_experts);
  EXPECT_EQ(testing::LayoutNames(layouts), wc.layouts);
  for (bool dropless : {true, false}) {
    const moe::LayerConfig config = SmallConfig(wc.num_experts, dropless, 0.75f);
    const Inputs in = MakeInputs(config, 41, 21);
    const testing::Reference ref = testing::WholeBatchReference(config, in);
    for (const Layout& layout : layouts) {
      for (bool empty_ranks : {false, true}) {
        DriverOptions o = WithDeadline(layout.options);
        if (empty_ranks) {
          Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
          o.token_split = SplitWithEmptyRanks(in.x.size(0), mesh.data_shards());
        }
        LayerRunResult run;
        ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o, Deadline()))
            << layout.name << (dropless ? " dropless" : " capacity");
        EXPECT_TRUE(MatchesReference(run, ref))
            << "W=" << wc.world_size << " E=" << wc.num_experts << " " << layout.name
            << (dropless ? " dropless" : " capacity") << (empty_ranks ? " empty ranks" : "");
        const ParallelOptions& p = layout.options;
        if (p.adaptive_r != 0) {
          EXPECT_EQ(run.overlap_degree, p.overlap_degree) << layout.name;
        }
        if (p.shadow.policy == ShadowPolicy::kList) {
          EXPECT_EQ(run.shadowed.size(), p.shadow.experts.size()) << layout.name;
        }
        if (layout.name == "shadow_auto" && dropless && !empty_ranks) {
          // The compute-bound cost model and the skewed gate without drops: the popular experts
          // are worth shadowing (with capacity, drops cap their loads and it may not pay).
          EXPECT_FALSE(run.shadowed.empty()) << layout.name;
        }
        if (p.smart_group != kSmartOff) {
          EXPECT_GE(run.smart_group, 1) << layout.name;
          // A group as large as the EP group would be the plain exchange in one step: over the
          // bandwidth-bound links smart_auto is given, auto must pick a real schedule.
          const Mesh mesh = ExpertMesh(p.mesh, config.num_experts, config.hidden_dim);
          const auto ep = static_cast<int>(mesh.GroupOf(GroupKind::kExpert, 0).size());
          if (layout.name == "smart_auto") {
            EXPECT_LT(run.smart_group, ep) << layout.name << " W=" << wc.world_size;
          }
        }
      }
    }
  }
}

TEST_P(OverlapTest, PerRankScopeEqualsOneLayerPerShard) {
  const WorldCase& wc = GetParam();
  const moe::LayerConfig config = SmallConfig(wc.num_experts, false, 0.75f);
  const Inputs in = MakeInputs(config, 37, 22);
  const std::vector<Layout> layouts = testing::OverlapLayoutsFor(wc.world_size, wc.num_experts);
  EXPECT_EQ(testing::LayoutNames(layouts), wc.layouts);
  for (const Layout& layout : layouts) {
    DriverOptions o = WithDeadline(layout.options);
    o.parallel.batch_scope = BatchScope::kPerRank;
    Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
    o.token_split = SplitWithEmptyRanks(in.x.size(0), mesh.data_shards());
    const testing::Reference ref = testing::PerShardReference(config, in, o.token_split);
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o, Deadline()))
        << layout.name;
    EXPECT_TRUE(MatchesReference(run, ref)) << "W=" << wc.world_size << " " << layout.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, OverlapTest, ::testing::ValuesIn(WorldCases()),
                         [](const ::testing::TestParamInfo<WorldCase>& param_info) {
                           return "W" + std::to_string(param_info.param.world_size) + "_E" +
                                  std::to_string(param_info.param.num_experts);
                         });

TEST(Overlap, GatedBfloat16AndPrescoreWithEveryScheduleKind) {
  moe::LayerConfig config = SmallConfig(4, true);
  config.gated = true;
  config.activation = kernels::Activation::kSilu;
  config.prescore = true;
  config.fc_bias = false;
  const Inputs in = MakeInputs(config, 33, 23);
  const testing::Reference ref = testing::WholeBatchReference(config, in);
  for (const char* name : {"a2a_d3", "a2av_d2", "smart_g1_d2_a2av", "shadow_0_1_d2_smart_g1"}) {
    for (const Layout& layout : testing::OverlapLayoutsFor(4, 4)) {
      if (layout.name != name) continue;
      LayerRunResult run =
          RunLayerOnRanks(config, in.params, in.x, in.dy, WithDeadline(layout.options), Deadline());
      EXPECT_TRUE(MatchesReference(run, ref)) << name;
    }
  }
}

TEST(Overlap, VariableSizeBytesDoNotDependOnTheSchedule) {
  // All-to-all-v sends exactly the kept rows whatever D and g are; fixed capacity pads each
  // expert's rows on the wire to a multiple of D.
  const moe::LayerConfig config = SmallConfig(4, false, 1.0f);
  const Inputs in = MakeInputs(config, 40, 24);
  auto token_bytes = [&](ParallelOptions p) {
    DriverOptions o = WithDeadline(p);
    LayerRunResult run = RunLayerOnRanks(config, in.params, in.x, in.dy, o, Deadline());
    double b = 0;
    for (const RankReport& r : run.ranks) b += r.forward.Bytes(Traffic::kTokens);
    return std::make_pair(b, run.buffer_capacity);
  };
  ParallelOptions v;
  v.mesh.world_size = 4;
  v.dispatch = DispatchKind::kAllToAllV;
  const double plain = token_bytes(v).first;
  EXPECT_GT(plain, 0);
  for (int d : {2, 3, 5}) {
    ParallelOptions p = v;
    p.overlap_degree = d;
    EXPECT_EQ(token_bytes(p).first, plain) << "D=" << d;
  }
  for (int g : {1, 2, 4}) {
    ParallelOptions p = v;
    p.smart_group = g;
    EXPECT_EQ(token_bytes(p).first, plain) << "g=" << g;
  }
  ParallelOptions f;
  f.mesh.world_size = 4;
  for (int d : {1, 2, 4, 5}) {
    f.overlap_degree = d;
    const int64_t wire = token_bytes(f).second;
    EXPECT_EQ(wire % d, 0) << "D=" << d;
  }
}

TEST(Overlap, ShadowingTheHotExpertSendsFewerTokens) {
  // MakeInputs' gate sends most tokens to experts 0 and 1: shadowing them keeps those rows home.
  const moe::LayerConfig config = SmallConfig(4, true);
  const Inputs in = MakeInputs(config, 64, 25);
  auto run = [&](const std::string& shadow) {
    ParallelOptions p;
    p.mesh.world_size = 4;
    p.dispatch = DispatchKind::kAllToAllV;
    p.shadow = ShadowFromString(shadow);
    return RunLayerOnRanks(config, in.params, in.x, in.dy, WithDeadline(p), Deadline());
  };
  LayerRunResult plain = run("none"), shadowed = run("0,1");
  double plain_tokens = 0, shadow_tokens = 0, shadow_weights = 0;
  for (size_t r = 0; r < 4; ++r) {
    plain_tokens += plain.ranks[r].forward.Bytes(Traffic::kTokens);
    shadow_tokens += shadowed.ranks[r].forward.Bytes(Traffic::kTokens);
    shadow_weights += shadowed.ranks[r].forward.Bytes(Traffic::kWeights) +
                      shadowed.ranks[r].backward.Bytes(Traffic::kWeights);
  }
  EXPECT_LT(shadow_tokens, 0.5 * plain_tokens);
  EXPECT_GT(shadow_weights, 0);
  EXPECT_EQ(shadowed.shadowed, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(plain.shadowed.empty());
}

TEST(CostModels, ShadowPolicyPicksTheHotExpertOnlyWhenItPays) {
  ShadowProblem pr;
  pr.ranks = 4;
  pr.num_experts = 4;
  pr.model_dim = 512;
  pr.hidden_dim = 2048;
  // Every rank sends 1000 rows to expert 0 and 2 to each other expert.
  for (int p = 0; p < 4; ++p) {
    for (int e = 0; e < 4; ++e) pr.counts.push_back(e == 0 ? 1000 : 2);
  }
  // A row costs 12.6 us of expert GEMMs (forward + backward), an expert's 8.4 MB of parameters
  // 0.34 ms there and back: worth it for the hot expert, not for the cold ones.
  CostModel fast_link{50, 5, 1000};
  EXPECT_EQ(ChooseShadowExperts(pr, fast_link), (std::vector<int64_t>{0}));
  // Parameters (8 MiB per expert) over a very slow link cost more than the imbalance.
  CostModel slow_link{0.01, 5, 1000};
  EXPECT_TRUE(ChooseShadowExperts(pr, slow_link).empty());
  // Balanced loads: nothing to gain.
  for (int64_t& c : pr.counts) c = 100;
  EXPECT_TRUE(ChooseShadowExperts(pr, fast_link).empty());
  std::vector<char> none(4, 0), hot(4, 0);
  hot[0] = 1;
  EXPECT_GT(ShadowStepSeconds(pr, hot, fast_link), ShadowStepSeconds(pr, none, fast_link));
}

TEST(CostModels, SmartGroupPipelinesWhenBandwidthBoundAndNotWhenLatencyBound) {
  // 8 ranks, 64 MB to send, about as long to compute as to send: pipelining in 8 steps wins.
  CostModel bw{10, 1, 100};
  const double bytes = 64e6, flops = 64e6 / 10e9 * 100e9;
  EXPECT_EQ(ChooseSmartGroup(8, bytes, flops, bw), 1);
  EXPECT_LT(SmartScheduleSeconds(1, 8, bytes, flops, bw),
            SmartScheduleSeconds(8, 8, bytes, flops, bw));
  // Tiny messages and a high latency: every extra step costs 7 latencies; one step is best.
  CostModel lat{10, 1000, 100};
  EXPECT_EQ(ChooseSmartGroup(8, 1e3, 1e3, lat), 8);
  EXPECT_EQ(SmartGroupFromString("auto"), kSmartAuto);
  EXPECT_EQ(SmartGroupFromString("off"), kSmartOff);
  EXPECT_EQ(SmartGroupFromString("2"), 2);
  EXPECT_THROW(SmartGroupFromString("two"), InvalidArgument);
  EXPECT_EQ(ShadowFromString("auto").policy, ShadowPolicy::kAuto);
  EXPECT_EQ(ShadowFromString("none").policy, ShadowPolicy::kNone);
  EXPECT_EQ(ShadowFromString("3,1").experts, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(ShadowToString(ShadowFromString("3,1")), "3,1");
  EXPECT_THROW(ShadowFromString("1,x"), InvalidArgument);
}

TEST(CostModels, MeasuredModelIsEqualOnEveryRank) {
  std::vector<CostModel> got(4);
  comm::RunInProcess(4, [&](comm::Communicator& c) {
    got[static_cast<size_t>(c.rank())] = MeasureCostModel(c, CostModel{}, 64, 128, 1);
  });
  for (const CostModel& m : got) {
    EXPECT_GT(m.link_gbps, 0);
    EXPECT_GT(m.gemm_gflops, 0);
    EXPECT_EQ(m.link_gbps, got[0].link_gbps);
    EXPECT_EQ(m.gemm_gflops, got[0].gemm_gflops);
    EXPECT_EQ(m.link_latency_us, got[0].link_latency_us);
  }
}

TEST(Overlap, ClearErrors) {
  const moe::LayerConfig config = SmallConfig(4, true);
  const Inputs in = MakeInputs(config, 8, 26);
  auto error = [&](const moe::LayerConfig& c, const ParallelOptions& p) -> std::string {
    try {
      Inputs local = MakeInputs(c, 8, 26);
      RunLayerOnRanks(c, local.params, local.x, local.dy, WithDeadline(p), Deadline());
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  ParallelOptions p;
  p.mesh.world_size = 4;
  ParallelOptions bad = p;
  bad.overlap_degree = 0;
  EXPECT_NE(error(config, bad).find("overlap degree: expected >= 1"), std::string::npos);
  bad = p;
  bad.overlap_degree = 2;
  bad.dispatch = DispatchKind::kAllGather;
  EXPECT_NE(error(config, bad).find("not allgather"), std::string::npos);
  bad = p;
  bad.smart_group = 3;
  EXPECT_NE(error(config, bad).find("smart schedule group size 3"), std::string::npos);
  bad = p;
  bad.smart_group = 2;
  bad.hierarchical_ranks_per_node = 2;
  EXPECT_NE(error(config, bad).find("alternatives"), std::string::npos);
  bad = p;
  bad.shadow = ShadowFromString("4");
  EXPECT_NE(error(config, bad).find("shadow: expert 4 does not exist"), std::string::npos);
  bad = p;
  bad.shadow = ShadowFromString("auto");
  EXPECT_NE(error(SmallConfig(2, true), bad).find("unsharded experts"), std::string::npos);
}

}  // namespace
}  // namespace switchyard::parallel
