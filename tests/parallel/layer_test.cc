// The parallel layer beyond the layout matrix: the options of the MoE layer (noise, drop
// policies, slot orders, score functions, losses, pre-score, gated experts, bfloat16, the DeepSpeed
// preset) under the main layouts; switching adaptive r between steps; gradient synchronisation;
// bytes on the wire against their formula; errors; and the moe hook that sums the gate losses of
// a batch split over ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/parallel_cases.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/losses.h"
#include "switchyard/moe/variants.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::parallel {
namespace {

using testing::Inputs;
using testing::Layout;
using testing::MakeInputs;
using testing::MatchesReference;
using testing::SmallConfig;

std::vector<float> Floats(const Tensor& t) {
  const Tensor f = t.dtype() == DType::kFloat32 ? t : t.To(DType::kFloat32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

struct ConfigCase {
  std::string name;
  std::function<void(moe::LayerConfig&)> edit;
};

std::vector<ConfigCase> ConfigCases() {
  using moe::LayerConfig;
  return {
      {"prescore", [](LayerConfig& c) { c.prescore = true; }},
      {"gated_silu",
       [](LayerConfig& c) {
         c.gated = true;
         c.activation = kernels::Activation::kSilu;
       }},
      {"no_bias", [](LayerConfig& c) { c.fc_bias = false; }},
      {"deepspeed_preset",
       [](LayerConfig& c) {
         LayerConfig p = moe::PresetConfig("deepspeed", 2);
         c.capacity_formula = p.capacity_formula;
         c.min_capacity = p.min_capacity;
         c.renormalize_after_drop = p.renormalize_after_drop;
         c.preset = "deepspeed";
       }},
      {"drop_probs", [](LayerConfig& c) { c.drop_policy = moe::DropPolicy::kProbs; }},
      {"drop_random_top1",
       [](LayerConfig& c) {
         c.top_k = 1;
         c.drop_policy = moe::DropPolicy::kRandom;
       }},
      {"bpr", [](LayerConfig& c) { c.batch_prioritized_routing = true; }},
      {"token_order_top3",
       [](LayerConfig& c) {
         c.top_k = 3;
         c.slot_order = moe::SlotOrder::kTokenOrder;
         c.aux_loss = moe::AuxLoss::kGShardAllChoices;
       }},
      {"tutel_noise_importance_load",
       [](LayerConfig& c) {
         c.noise = moe::NoiseKind::kTutelNormal;
         c.aux_loss = moe::AuxLoss::kImportanceLoad;
       }},
      {"jitter", [](LayerConfig& c) { c.noise = moe::NoiseKind::kJitter; }},
      {"gumbel_random_routing",
       [](LayerConfig& c) {
         c.noise = moe::NoiseKind::kGumbelSecond;
         c.random_routing = true;
       }},
      {"sigmoid", [](LayerConfig& c) { c.score_function = moe::ScoreFunction::kSigmoid; }},
      {"softmax_after_topk",
       [](LayerConfig& c) { c.score_function = moe::ScoreFunction::kSoftmaxAfterTopK; }},
      {"capacity_factor_0", [](LayerConfig& c) { c.capacity_factor = 0.0f; }},
      {"capacity_factor_negative", [](LayerConfig& c) { c.capacity_factor = -0.75f; }},
      {"explicit_capacity_aligned",
       [](LayerConfig& c) {
         c.capacity = 5;
         c.alignment = 2;
       }},
      {"expert_bias",
       [](LayerConfig& c) {
         c.expert_bias = true;
         c.normalize_gate = false;
       }},
      // DeepSeek-V3's router: sigmoid scores, two groups of which a token may use one, routed
      // scaling.
      {"group_limited_sigmoid_scaled",
       [](LayerConfig& c) {
         c.score_function = moe::ScoreFunction::kSigmoid;
         c.num_groups = 2;
         c.group_topk = 1;
         c.top_k = c.num_experts / 2;
         c.topk_scaling_factor = 2.5f;
       }},
  };
}

std::vector<Layout> MainLayouts(int w, int64_t e) {
  std::vector<Layout> out;
  for (Layout& l : testing::LayoutsFor(w, e)) {
    for (const char* name : {"ds_alltoall", "ds_alltoallv", "ds_allgather", "ds_tp2_dedup",
                             "ds_sharded_r2", "ds_sharded_r1", "mg_etp2", "ds_r0"}) {
      if (l.name == name) out.push_back(l);
    }
  }
  return out;
}

class ConfigTest : public ::testing::TestWithParam<ConfigCase> {};

TEST_P(ConfigTest, GlobalScopeEqualsWholeBatch) {
  for (int64_t experts : {int64_t{4}, int64_t{2}}) {
    moe::LayerConfig config = SmallConfig(experts, false, 0.75f);
    GetParam().edit(config);
    Inputs in = MakeInputs(config, 29, 21);
    if (config.expert_bias) {
      in.params.expert_bias = Tensor::FromVector(std::vector<float>(experts, 0.0f), {experts});
      in.params.expert_bias.data<float>()[experts - 1] = 0.3f;
    }
    // The reference at the same step (noise is keyed by it).
    moe::MoeLayer single(config);
    moe::ForwardOptions fo;
    fo.step = 3;
    testing::Reference ref;
    ref.output = single.Forward(in.params, in.x, fo);
    moe::LayerGradients g = single.Backward(in.params, ref.output, in.dy);
    ref.grad_x = g.x;
    ref.grads = g.params;
    for (const Layout& layout : MainLayouts(4, experts)) {
      DriverOptions o;
      o.parallel = layout.options;
      Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
      o.token_split = EvenSplit(in.x.size(0), mesh.data_shards());
      o.token_split.back() += o.token_split.front();
      o.token_split.front() = 0;
      o.step = 3;
      LayerRunResult run;
      ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
      EXPECT_TRUE(MatchesReference(run, ref))
          << GetParam().name << " E=" << experts << " " << layout.name;
    }
  }
}

TEST_P(ConfigTest, PerRankScopeEqualsOneLayerPerShard) {
  moe::LayerConfig config = SmallConfig(4, false, 0.75f);
  GetParam().edit(config);
  Inputs in = MakeInputs(config, 29, 22);
  if (config.expert_bias) {
    in.params.expert_bias = Tensor::Zeros({4});
  }
  for (const Layout& layout : MainLayouts(4, 4)) {
    DriverOptions o;
    o.parallel = layout.options;
    o.parallel.batch_scope = BatchScope::kPerRank;
    Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
    o.token_split = EvenSplit(in.x.size(0), mesh.data_shards());
    // capacity_factor <= 0 takes the largest load over the expert group, which covers every
    // shard in these layouts: give the reference that.
    std::vector<int64_t> max_load;
    if (config.capacity_factor <= 0 && !config.capacity) {
      moe::MoeLayer single(config);
      int64_t start = 0, m = 0;
      for (int64_t t : o.token_split) {
        moe::LayerOutput out = single.Forward(in.params, in.x.Slice(start, start + t),
                                              {start, 0, std::nullopt, 1, false});
        m = std::max(m, *std::max_element(out.expert_loads.begin(), out.expert_loads.end()));
        start += t;
      }
      max_load.assign(o.token_split.size(), m);
    }
    const testing::Reference ref = testing::PerShardReference(config, in, o.token_split, max_load);
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
    EXPECT_TRUE(MatchesReference(run, ref)) << GetParam().name << " " << layout.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Options, ConfigTest, ::testing::ValuesIn(ConfigCases()),
                         [](const ::testing::TestParamInfo<ConfigCase>& param_info) {
                           return param_info.param.name;
                         });

TEST(ParallelLayer, BFloat16ActivationsMatchTheSingleRankLayer) {
  moe::LayerConfig config = SmallConfig(4, true);
  Inputs in = MakeInputs(config, 24, 31);
  in.x = in.x.To(DType::kBFloat16);
  in.dy = in.dy.To(DType::kBFloat16);
  const testing::Reference ref = testing::WholeBatchReference(config, in);
  for (const Layout& layout : MainLayouts(4, 4)) {
    DriverOptions o;
    o.parallel = layout.options;
    LayerRunResult run = RunLayerOnRanks(config, in.params, in.x, in.dy, o);
    EXPECT_EQ(run.output.y.dtype(), DType::kBFloat16);
    EXPECT_TRUE(MatchesReference(run, ref, 1e-2, 1e-2)) << layout.name;
  }
}

// The sequence loss (aux_loss sequence) of a batch split over ranks: 2 ranks, ep 2, sequences of
// 8 rows over 24 tokens (12 per rank, so the middle sequence lies on both). The global scope
// equals one rank on the whole batch; the per-rank scope equals one layer per rank's 12 tokens
// (sequences of 4 rows there, 3 per rank).
TEST(ParallelLayer, SequenceLossEqualsTheSingleRankLayer) {
  for (BatchScope scope : {BatchScope::kGlobal, BatchScope::kPerRank}) {
    moe::LayerConfig config = SmallConfig(4, false, 0.75f);
    config.aux_loss = moe::AuxLoss::kSequence;
    config.sequence_length = scope == BatchScope::kGlobal ? 8 : 4;
    config.aux_loss_coef = 1.0f;  // the loss's gradient is a visible part of the gate's
    const Inputs in = MakeInputs(config, 24, 41);
    DriverOptions o;
    o.parallel.mesh.world_size = 2;
    o.parallel.mesh.ep = 2;
    o.parallel.batch_scope = scope;
    const testing::Reference ref = scope == BatchScope::kGlobal
                                       ? testing::WholeBatchReference(config, in)
                                       : testing::PerShardReference(config, in, {12, 12});
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o));
    EXPECT_GT(run.output.l_aux, 0.5f);
    EXPECT_TRUE(MatchesReference(run, ref))
        << (scope == BatchScope::kGlobal ? "global" : "per_rank");
  }
}

// Runs `fn(layer, shard params, x slice, dy slice)` on W in-process ranks.
void OnRanks(int w, const moe::LayerConfig& config, const ParallelOptions& options,
             const Inputs& in,
             const std::function<void(ParallelMoeLayer&, const moe::LayerParams&, const Tensor&,
                                      const Tensor&)>& fn) {
  comm::RunInProcess(w, [&](comm::Communicator& world) {
    ParallelMoeLayer layer(config, options, MakeLayerGroups(world, config, options));
    Mesh mesh = layer.mesh();
    std::vector<int64_t> split = EvenSplit(in.x.size(0), mesh.data_shards());
    int64_t start = 0;
    for (int d = 0; d < layer.coords().token_shard; ++d) start += split[static_cast<size_t>(d)];
    const int64_t t = split[static_cast<size_t>(layer.coords().token_shard)];
    fn(layer, layer.ShardParams(in.params), in.x.Slice(start, start + t),
       in.dy.Slice(start, start + t));
  });
}

bool SameBits(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(ParallelLayer, EmptyBatchOnEveryRank) {
  for (bool dropless : {true, false}) {
    const moe::LayerConfig config = SmallConfig(4, dropless, 0.75f);
    const Inputs in = MakeInputs(config, 0, 35);
    const testing::Reference ref = testing::WholeBatchReference(config, in);
    for (const Layout& layout : MainLayouts(4, 4)) {
      DriverOptions o;
      o.parallel = layout.options;
      LayerRunResult run;
      ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
      EXPECT_EQ(run.output.y.size(0), 0) << layout.name;
      EXPECT_TRUE(MatchesReference(run, ref)) << layout.name;
    }
  }
}

TEST(ParallelLayer, SwitchingAdaptiveRBetweenStepsEqualsFreshRuns) {
  // 4 ranks, 2 experts: each expert split into n = 2 shards; r in {0, 1, 2}.
  const moe::LayerConfig config = SmallConfig(2, false, 0.75f);
  const Inputs in = MakeInputs(config, 26, 41);
  ParallelOptions options;
  options.mesh.world_size = 4;
  const std::vector<int> schedule{1, 2, 0, 2, 1};
  struct StepResult {
    Tensor y, dx, dgate, dfc1, dfc2, dfc2_bias;
    int r = 0;
  };
  std::vector<std::vector<StepResult>> switched(4), fresh(4);
  auto record = [&](ParallelMoeLayer& layer, const moe::LayerParams& p, const Tensor& x,
                    const Tensor& dy, int r) {
    ParallelForwardOptions fo;
    fo.adaptive_r = r;
    ParallelOutput out = layer.Forward(p, x, fo);
    ParallelGradients g = layer.Backward(p, out, dy);
    layer.SyncGradients(&g.params);
    return StepResult{out.layer.y,
                      g.x,
                      g.params.gate_weight,
                      g.params.experts.fc1_weight,
                      g.params.experts.fc2_weight,
                      g.params.experts.fc2_bias,
                      out.adaptive_r};
  };
  OnRanks(
      4, config, options, in,
      [&](ParallelMoeLayer& layer, const moe::LayerParams& p, const Tensor& x, const Tensor& dy) {
        for (int r : schedule) {
          switched[static_cast<size_t>(layer.coords().rank)].push_back(record(layer, p, x, dy, r));
        }
      });
  for (int r : schedule) {
    OnRanks(
        4, config, options, in,
        [&](ParallelMoeLayer& layer, const moe::LayerParams& p, const Tensor& x, const Tensor& dy) {
          fresh[static_cast<size_t>(layer.coords().rank)].push_back(record(layer, p, x, dy, r));
        });
  }
  for (size_t rank = 0; rank < 4; ++rank) {
    for (size_t s = 0; s < schedule.size(); ++s) {
      const StepResult &a = switched[rank][s], &b = fresh[rank][s];
      EXPECT_EQ(a.r, schedule[s]);
      EXPECT_TRUE(SameBits(a.y, b.y)) << "rank " << rank << " step " << s;
      EXPECT_TRUE(SameBits(a.dx, b.dx)) << "rank " << rank << " step " << s;
      EXPECT_TRUE(SameBits(a.dgate, b.dgate)) << "rank " << rank << " step " << s;
      EXPECT_TRUE(SameBits(a.dfc1, b.dfc1)) << "rank " << rank << " step " << s;
      EXPECT_TRUE(SameBits(a.dfc2, b.dfc2)) << "rank " << rank << " step " << s;
      EXPECT_TRUE(SameBits(a.dfc2_bias, b.dfc2_bias)) << "rank " << rank << " step " << s;
    }
  }
  // And every r gives the single-rank result.
  const testing::Reference ref = testing::WholeBatchReference(config, in);
  for (int r : {0, 1, 2}) {
    DriverOptions o;
    o.parallel = options;
    o.parallel.adaptive_r = r;
    EXPECT_TRUE(MatchesReference(RunLayerOnRanks(config, in.params, in.x, in.dy, o), ref))
        << "r = " << r;
  }
}

TEST(ParallelLayer, SyncedGradientsAreEqualOnEveryHolder) {
  // After SyncGradients, every rank holding the same expert shard holds the same gradient of every
  // expert tensor, and every rank the same gate gradient: replicas (tp, ep_dp) and sharded
  // experts (E < W: each rank holds an H-shard, r groups) alike.
  struct Case {
    int experts;
    const char* name;
  };
  const Case cases[] = {{4, "ds_tp2_dedup"},     {4, "ds_tp2_nodedup"},  {4, "ds_ep_replicas"},
                        {4, "mg_etp2_ep2_edp2"}, {2, "ds_sharded_r1"},   {2, "ds_sharded_r2"},
                        {2, "ds_sharded_r4"},    {2, "ds_sharded_auto"}, {2, "ds_r0"}};
  for (const Case& c : cases) {
    const moe::LayerConfig config = SmallConfig(c.experts, true);
    const Inputs in = MakeInputs(config, 30, 51);
    int found = 0;
    for (const Layout& layout : testing::LayoutsFor(8, c.experts)) {
      if (layout.name != c.name) continue;
      ++found;
      std::vector<moe::LayerParams> grads(8);
      std::vector<Tensor> ys(8);
      std::vector<RankCoords> coords(8);
      OnRanks(8, config, layout.options, in,
              [&](ParallelMoeLayer& layer, const moe::LayerParams& p, const Tensor& x,
                  const Tensor& dy) {
                ParallelOutput out = layer.Forward(p, x);
                ParallelGradients g = layer.Backward(p, out, dy);
                layer.SyncGradients(&g.params);
                const auto r = static_cast<size_t>(layer.coords().rank);
                grads[r] = g.params;
                ys[r] = out.layer.y;
                coords[r] = layer.coords();
              });
      Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
      for (int r = 0; r < 8; ++r) {
        EXPECT_TRUE(SameBits(grads[r].gate_weight, grads[0].gate_weight))
            << c.name << " rank " << r;
        const moe::NamedTensors mine = moe::ParamsToMap(config, grads[r]);
        int compared = 0;
        for (int peer : mesh.GroupOf(GroupKind::kExpertHolders, r)) {
          const moe::NamedTensors theirs = moe::ParamsToMap(config, grads[peer]);
          for (const auto& [key, tensor] : mine) {
            if (!key.starts_with("experts.")) continue;
            ASSERT_TRUE(theirs.count(key)) << key;
            EXPECT_TRUE(SameBits(tensor, theirs.at(key)))
                << c.name << " " << key << " ranks " << r << " and " << peer;
            ++compared;
          }
        }
        EXPECT_GT(compared, 0) << c.name << " rank " << r;
        // Tensor-parallel duplicates hold the same tokens and get the same outputs.
        for (int peer : mesh.GroupOf(GroupKind::kTensor, r)) {
          if (coords[peer].token_shard == coords[r].token_shard) {
            EXPECT_TRUE(SameBits(ys[r], ys[peer])) << c.name << " ranks " << r << " and " << peer;
          }
        }
      }
    }
    EXPECT_EQ(found, 1) << c.name << " is not a layout of W = 8, E = " << c.experts;
  }
}

TEST(ParallelLayer, BatchExpertLoadsAreTheWholeBatchs) {
  const moe::LayerConfig config = SmallConfig(4, false, 0.75f);
  const Inputs in = MakeInputs(config, 30, 55);
  const testing::Reference ref = testing::WholeBatchReference(config, in);
  for (const Layout& layout : MainLayouts(4, 4)) {
    std::vector<std::vector<int64_t>> loads(4);
    OnRanks(
        4, config, layout.options, in,
        [&](ParallelMoeLayer& layer, const moe::LayerParams& p, const Tensor& x, const Tensor&) {
          ParallelOutput out = layer.Forward(p, x);
          loads[static_cast<size_t>(layer.coords().rank)] = layer.BatchExpertLoads(out);
        });
    for (const auto& l : loads) EXPECT_EQ(l, ref.output.expert_loads) << layout.name;
  }
}

TEST(ParallelLayer, TokenBytesMatchTheirFormula) {
  // Fixed capacity, 4 ranks, 4 experts: each all-to-all sends 3 of its 4 blocks of [1, C, M].
  const moe::LayerConfig config = SmallConfig(4, false, 1.0f);
  const Inputs in = MakeInputs(config, 40, 61);
  for (DispatchKind kind :
       {DispatchKind::kAllToAll, DispatchKind::kAllToAllV, DispatchKind::kAllGather}) {
    ParallelOptions options;
    options.mesh.world_size = 4;
    options.dispatch = kind;
    options.batch_scope = BatchScope::kPerRank;
    std::vector<double> fwd(4), bwd(4), expected(4), sent(4);
    OnRanks(
        4, config, options, in,
        [&](ParallelMoeLayer& layer, const moe::LayerParams& p, const Tensor& x, const Tensor& dy) {
          ParallelOutput out = layer.Forward(p, x);
          ParallelGradients g = layer.Backward(p, out, dy);
          const auto r = static_cast<size_t>(layer.coords().rank);
          fwd[r] = out.stats.Bytes(Traffic::kTokens);
          bwd[r] = g.stats.Bytes(Traffic::kTokens);
          const double row_bytes = 16.0 * 4;
          if (kind == DispatchKind::kAllToAll) {
            // C = k * floor(cf * ceil(T / E)) = 2 * 3 with T = 10 per rank; two all-to-alls.
            EXPECT_EQ(out.buffer_capacity, 6);
            expected[r] = 2 * 3 * 6 * row_bytes;
          } else if (kind == DispatchKind::kAllGather) {
            // All-gather 3 x T_max rows, reduce-scatter 3/4 of [4 T_max] rows.
            expected[r] = 2 * 3 * 10 * row_bytes;
          }
          // Kept rows for experts on other ranks (expert e lives on rank e).
          for (int64_t e = 0; e < 4; ++e) {
            if (e != static_cast<int64_t>(r)) {
              sent[r] +=
                  static_cast<double>(out.layer.expert_counts[static_cast<size_t>(e)]) * row_bytes;
            }
          }
        });
    double total_fwd = 0, total_sent = 0;
    for (size_t r = 0; r < 4; ++r) {
      if (kind != DispatchKind::kAllToAllV) {
        EXPECT_EQ(fwd[r], expected[r]) << DispatchKindName(kind) << " rank " << r;
      }
      EXPECT_EQ(bwd[r], fwd[r]) << DispatchKindName(kind) << " rank " << r;
      total_fwd += fwd[r];
      total_sent += sent[r];
    }
    // All-to-all-v: exactly the kept rows, there and back.
    if (kind == DispatchKind::kAllToAllV) {
      EXPECT_EQ(total_fwd, 2 * total_sent);
    }
  }
}

TEST(ParallelLayer, ClearErrors) {
  const Inputs in = MakeInputs(SmallConfig(4, true), 8, 71);
  auto error = [&](const moe::LayerConfig& config, const ParallelOptions& p) -> std::string {
    DriverOptions o;
    o.parallel = p;
    try {
      Inputs local = MakeInputs(config, 8, 71);
      RunLayerOnRanks(config, local.params, local.x, local.dy, o);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  ParallelOptions p;
  p.mesh.world_size = 4;
  EXPECT_NE(error(SmallConfig(6, true), p).find("num_experts 6 is not divisible by ep 4"),
            std::string::npos);
  ParallelOptions r3 = p;
  r3.adaptive_r = 3;
  EXPECT_NE(error(SmallConfig(2, true), r3).find("adaptive r 3"), std::string::npos);
  ParallelOptions hier = p;
  hier.hierarchical_ranks_per_node = 2;
  hier.dispatch = DispatchKind::kAllToAllV;
  EXPECT_NE(error(SmallConfig(4, true), hier).find("2DH"), std::string::npos);
  DriverOptions bad_split;
  bad_split.parallel = p;
  bad_split.token_split = {1, 2, 3};
  EXPECT_THROW(RunLayerOnRanks(SmallConfig(4, true), in.params, in.x, in.dy, bad_split),
               InvalidArgument);
  EXPECT_EQ(AdaptiveRFromString("auto"), kAdaptiveRAuto);
  EXPECT_EQ(AdaptiveRFromString("2"), 2);
  EXPECT_THROW(AdaptiveRFromString("two"), InvalidArgument);
}

// Whether a call trains is its own flag: an evaluation call on 4 ranks equals the single-rank
// layer's evaluation call (no noise, no random routing), and differs from a training call.
TEST(ParallelLayer, EvaluationCallsEqualTheSingleRankLayersEvaluation) {
  moe::LayerConfig config = SmallConfig(4, false, 0.75f);
  config.noise = moe::NoiseKind::kTutelNormal;
  config.noise_std = 4.0f;
  config.random_routing = true;
  const Inputs in = MakeInputs(config, 29, 23);
  moe::MoeLayer single(config);
  moe::ForwardOptions fo;
  fo.step = 2;
  fo.training = false;
  testing::Reference ref;
  ref.output = single.Forward(in.params, in.x, fo);
  moe::LayerGradients g = single.Backward(in.params, ref.output, in.dy);
  ref.grad_x = g.x;
  ref.grads = g.params;
  fo.training = true;
  const moe::LayerOutput trained = single.Forward(in.params, in.x, fo);
  ASSERT_NE(Floats(trained.gates), Floats(ref.output.gates)) << "the noise changes no gate value";
  for (const Layout& layout : MainLayouts(4, 4)) {
    DriverOptions o;
    o.parallel = layout.options;
    o.step = 2;
    o.training = false;
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
    EXPECT_TRUE(MatchesReference(run, ref)) << layout.name;
  }
}

// One set of process groups serves every layer of its mesh: two layers with other expert counts
// (the same H-shards per expert) on the same groups each equal their single-rank layer, and a
// layer whose options ask for another mesh is refused with both meshes named.
TEST(ParallelLayer, LayersShareOneSetOfProcessGroups) {
  const moe::LayerConfig four = SmallConfig(4, true), eight = SmallConfig(8, true);
  const Inputs in4 = MakeInputs(four, 16, 41), in8 = MakeInputs(eight, 16, 42);
  const moe::LayerOutput want4 = moe::MoeLayer(four).Forward(in4.params, in4.x);
  const moe::LayerOutput want8 = moe::MoeLayer(eight).Forward(in8.params, in8.x);
  ParallelOptions options;
  options.mesh.world_size = 4;
  std::vector<std::string> errors(4);
  comm::RunInProcess(4, [&](comm::Communicator& world) {
    std::shared_ptr<ProcessGroups> groups = MakeLayerGroups(world, four, options);
    ParallelMoeLayer a(four, options, groups), b(eight, options, groups);
    EXPECT_EQ(&a.groups(), &b.groups());
    const int r = world.rank();
    ParallelForwardOptions fo;
    fo.global_token_offset = 4 * r;
    fo.save_for_backward = false;
    const ParallelOutput ya =
        a.Forward(a.ShardParams(in4.params), in4.x.Slice(4 * r, 4 * r + 4), fo);
    const ParallelOutput yb =
        b.Forward(b.ShardParams(in8.params), in8.x.Slice(4 * r, 4 * r + 4), fo);
    const std::vector<float> got_a = Floats(ya.layer.y), got_b = Floats(yb.layer.y);
    const std::vector<float> all_a = Floats(want4.y), all_b = Floats(want8.y);
    for (size_t i = 0; i < got_a.size(); ++i) {
      EXPECT_NEAR(got_a[i], all_a[64 * static_cast<size_t>(r) + i], 2e-5) << "rank " << r;
      EXPECT_NEAR(got_b[i], all_b[64 * static_cast<size_t>(r) + i], 2e-5) << "rank " << r;
    }
    try {
      ParallelMoeLayer sharded(SmallConfig(2, true), options, groups);  // 2 H-shards per expert
    } catch (const InvalidArgument& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("process groups: built for the mesh (world 4, tp 1, pp 1, cp 1, ep 4, etp 1, "
                     "arrangement deepspeed, order tp-cp-ep-dp-pp, 1 H-shard(s) per expert), but "
                     "the layer's options ask for (world 4, tp 1, pp 1, cp 1, ep 4, etp 1, "
                     "arrangement deepspeed, order tp-cp-ep-dp-pp, 2 H-shard(s)"),
              std::string::npos)
        << e;
  }
}

// PR-MoE's residual MLP and DeepSeek's shared expert are dense and replicated: on every
// dispatcher and schedule (and in both batch scopes) the layer with them equals the single-rank
// layer, outputs, l_aux and every gradient (the variants' summed over the token shards).
TEST(ParallelLayer, ResidualAndSharedExpertsEqualTheSingleRankLayer) {
  struct Variant {
    const char* name;
    std::function<void(moe::LayerConfig&)> edit;
  };
  const Variant variants[] = {
      {"residual_moe", [](moe::LayerConfig& c) { c.residual_moe = true; }},
      {"shared_expert", [](moe::LayerConfig& c) { c.shared_expert_hidden = 8; }},
      {"both_gated_no_bias",
       [](moe::LayerConfig& c) {
         c.residual_moe = true;
         c.shared_expert_hidden = 12;
         c.gated = true;
         c.fc_bias = false;
       }},
  };
  for (const Variant& v : variants) {
    for (int64_t experts : {int64_t{4}, int64_t{2}}) {
      moe::LayerConfig config = SmallConfig(experts, false, 0.75f);
      v.edit(config);
      const Inputs in = MakeInputs(config, 29, 51);
      const testing::Reference ref = testing::WholeBatchReference(config, in);
      ASSERT_TRUE(moe::HasVariants(config));
      std::vector<Layout> layouts = testing::LayoutsFor(4, experts);
      for (Layout& l : testing::OverlapLayoutsFor(4, experts)) layouts.push_back(l);
      for (const Layout& layout : layouts) {
        DriverOptions o;
        o.parallel = layout.options;
        LayerRunResult run;
        ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
        EXPECT_TRUE(MatchesReference(run, ref)) << v.name << " E=" << experts << " " << layout.name;
      }
      for (const Layout& layout : MainLayouts(4, experts)) {
        DriverOptions o;
        o.parallel = layout.options;
        o.parallel.batch_scope = BatchScope::kPerRank;
        Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
        o.token_split = EvenSplit(in.x.size(0), mesh.data_shards());
        const testing::Reference per_shard = testing::PerShardReference(config, in, o.token_split);
        LayerRunResult run;
        ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
        EXPECT_TRUE(MatchesReference(run, per_shard))
            << v.name << " per_rank E=" << experts << " " << layout.name;
      }
    }
  }
}

TEST(AdaptiveR, AutoPicksTheCheapestBySpecFormula) {
  // docs/parallel.md, "Tutel's adaptive r": V(0) = 2 P; V(r) = 4 C_g r + 2 P / (E r).
  EXPECT_DOUBLE_EQ(PredictedVolume(0, 1, 1000, 2), 2000);
  EXPECT_DOUBLE_EQ(PredictedVolume(2, 1, 1000, 2), 8 + 500);
  EXPECT_EQ(ChooseAdaptiveR(4, 1, 1000, 2), 4);     // tiny batches: model parallel
  EXPECT_EQ(ChooseAdaptiveR(4, 1000, 1000, 2), 0);  // huge batches: gather the weights
  EXPECT_EQ(ChooseAdaptiveR(4, 60, 1000, 2), 2);    // 4*60*2 + 250 = 730 < 740, 1000, 2000
  EXPECT_EQ(ChooseAdaptiveR(1, 1, 1000, 2), 1);
}

// Ranks whose tokens are not a contiguous range of the batch (context parallelism holds chunks of
// every sequence) route as one rank when each token carries its global index: rank r of 4 holds
// tokens r, r + 4, r + 8, ... With binding capacity and the order-dependent options (random and
// position drops, batch-prioritized routing, Tutel noise with random routing) the outputs, drops,
// l_aux and the gate's gradient equal moe::MoeLayer on the batch in order; in the global scope on
// 4 token shards, and in the per-rank scope on cp 2 x dp 2, where each cp group routes its two
// ranks' tokens as one batch (rows 2 d .. of the interleave: the reference is one layer per dp
// rank on its tokens in order).
TEST(ParallelLayer, TokensInAnyOrderWithTheirGlobalIndexRouteAsOneRank) {
  const int w = 4;
  const int64_t t_num = 40;
  // Drop policy and aux loss: the sequence loss (sequences of 10 tokens, spread over the ranks)
  // adds its per-sequence sums over the routing group.
  const std::vector<std::pair<moe::DropPolicy, moe::AuxLoss>> cases = {
      {moe::DropPolicy::kPosition, moe::AuxLoss::kGShard},
      {moe::DropPolicy::kRandom, moe::AuxLoss::kGShard},
      {moe::DropPolicy::kRandom, moe::AuxLoss::kSequence}};
  for (const auto& drop_aux : cases) {
    const moe::DropPolicy drop = drop_aux.first;
    for (const bool per_rank : {false, true}) {
      moe::LayerConfig c = SmallConfig(4, false, 0.75f);
      c.aux_loss = drop_aux.second;
      c.sequence_length = 10;
      c.drop_policy = drop;
      c.batch_prioritized_routing = drop == moe::DropPolicy::kPosition;
      c.noise = moe::NoiseKind::kTutelNormal;
      c.noise_std = 2.0f;
      c.random_routing = true;
      const Inputs in = MakeInputs(c, t_num, 61);
      ParallelOptions options;
      options.mesh.world_size = w;
      options.mesh.cp = per_rank ? 2 : 1;
      options.batch_scope = per_rank ? BatchScope::kPerRank : BatchScope::kGlobal;
      // The reference: the batch in order (per rank: each dp rank's tokens in order, offset by
      // its first token), step 3.
      const int shards = per_rank ? 2 : 1;  // dp ranks
      moe::MoeLayer one(c);
      std::vector<moe::LayerOutput> want(static_cast<size_t>(shards));
      Tensor want_dgate = Tensor::Zeros({c.num_experts, c.model_dim});
      for (int d = 0; d < shards; ++d) {
        const int64_t begin = t_num / shards * d, end = t_num / shards * (d + 1);
        moe::ForwardOptions fo;
        fo.global_token_offset = begin;
        fo.step = 3;
        want[static_cast<size_t>(d)] = one.Forward(in.params, in.x.Slice(begin, end).Clone(), fo);
        const moe::LayerGradients g =
            one.Backward(in.params, want[static_cast<size_t>(d)], in.dy.Slice(begin, end).Clone());
        for (int64_t i = 0; i < want_dgate.numel(); ++i) {
          want_dgate.data<float>()[i] += g.params.gate_weight.data<float>()[i];
        }
      }
      const std::string what =
          fmt::format("{} drops, {} loss, {}", moe::DropPolicyName(drop),
                      moe::AuxLossName(c.aux_loss), per_rank ? "per_rank cp 2 x dp 2" : "global");
      int64_t want_dropped = 0;
      for (const moe::LayerOutput& o : want) want_dropped += o.dropped;
      ASSERT_GT(want_dropped, 0) << what;
      std::vector<int64_t> dropped(w, 0);
      comm::RunInProcess(w, [&](comm::Communicator& world) {
        ParallelMoeLayer layer(c, options, MakeLayerGroups(world, c, options));
        const RankCoords& rc = layer.coords();
        // Token shard s: every 4th token of the batch (per rank: of its dp rank's half, every
        // 2nd, the cp ranks interleaved).
        const int64_t stride = per_rank ? 2 : w,
                      base_shard = per_rank ? rc.cp_rank : rc.token_shard;
        const int64_t begin = per_rank ? t_num / 2 * rc.dp_rank : 0;
        const int64_t end = per_rank ? begin + t_num / 2 : t_num;
        std::vector<int64_t> index;
        for (int64_t g = begin + base_shard; g < end; g += stride) index.push_back(g);
        const auto n = static_cast<int64_t>(index.size());
        Tensor x = Tensor::Empty({n, c.model_dim}), dy = Tensor::Empty({n, c.model_dim});
        for (int64_t r = 0; r < n; ++r) {
          std::copy_n(in.x.data<float>() + index[r] * c.model_dim, c.model_dim,
                      x.data<float>() + r * c.model_dim);
          std::copy_n(in.dy.data<float>() + index[r] * c.model_dim, c.model_dim,
                      dy.data<float>() + r * c.model_dim);
        }
        ParallelForwardOptions fo;
        fo.global_token_offset = begin;
        fo.step = 3;
        fo.token_index = index;
        const moe::LayerParams p = layer.ShardParams(in.params);
        const ParallelOutput out = layer.Forward(p, x, fo);
        ParallelGradients g = layer.Backward(p, out, dy);
        layer.SyncGradients(&g.params);
        dropped[static_cast<size_t>(world.rank())] = out.layer.dropped;
        const moe::LayerOutput& ref = want[static_cast<size_t>(per_rank ? rc.dp_rank : 0)];
        EXPECT_NEAR(out.layer.l_aux, ref.l_aux, 1e-5 * std::abs(ref.l_aux)) << what;
        EXPECT_EQ(out.layer.capacity, ref.capacity) << what;
        for (int64_t r = 0; r < n; ++r) {
          const int64_t tok = index[r] - begin;
          for (int64_t m = 0; m < c.model_dim; ++m) {
            EXPECT_NEAR(out.layer.y.data<float>()[r * c.model_dim + m],
                        ref.y.data<float>()[tok * c.model_dim + m], 2e-5)
                << what << " token " << index[r];
          }
          for (int64_t j = 0; j < 2; ++j) {
            EXPECT_EQ(out.layer.locations.data<int32_t>()[r * 2 + j],
                      ref.locations.data<int32_t>()[tok * 2 + j])
                << what << " token " << index[r];
          }
        }
        // The gate's gradient, summed over the token shards: the whole batch's.
        for (int64_t i = 0; i < want_dgate.numel(); ++i) {
          EXPECT_NEAR(g.params.gate_weight.data<float>()[i], want_dgate.data<float>()[i],
                      1e-4 + 1e-3 * std::abs(want_dgate.data<float>()[i]))
              << what << " element " << i;
        }
      });
      int64_t total = 0;
      for (int64_t d : dropped) total += d;
      EXPECT_EQ(total, want_dropped) << what;
    }
  }
}

// Callers that give no offsets (every rank at global_token_offset 0, as the Python module): the
// ranks' tokens route in rank order, as one rank over their concatenation; the random drop policy,
// which keys a draw by the token's index, refuses ranges that overlap.
TEST(ParallelLayer, OverlappingTokenRangesRouteInRankOrder) {
  const int w = 2;
  const int64_t t_num = 24;
  moe::LayerConfig c = SmallConfig(4, false, 0.75f);
  const Inputs in = MakeInputs(c, t_num, 17);
  moe::MoeLayer one(c);
  const moe::LayerOutput want = one.Forward(in.params, in.x, {});
  ASSERT_GT(want.dropped, 0);
  ParallelOptions options;
  options.mesh.world_size = w;
  options.batch_scope = BatchScope::kGlobal;
  comm::RunInProcess(w, [&](comm::Communicator& world) {
    ParallelMoeLayer layer(c, options, MakeLayerGroups(world, c, options));
    const int64_t begin = t_num / w * world.rank(), n = t_num / w;
    const moe::LayerParams p = layer.ShardParams(in.params);
    const ParallelOutput out = layer.Forward(p, in.x.Slice(begin, begin + n).Clone(), {});
    for (int64_t i = 0; i < n * c.model_dim; ++i) {
      EXPECT_NEAR(out.layer.y.data<float>()[i], want.y.data<float>()[begin * c.model_dim + i], 2e-5)
          << "element " << i << " of rank " << world.rank();
    }
  });
  c.drop_policy = moe::DropPolicy::kRandom;
  std::vector<std::string> errors(w);
  comm::RunInProcess(w, [&](comm::Communicator& world) {
    ParallelMoeLayer layer(c, options, MakeLayerGroups(world, c, options));
    const moe::LayerParams p = layer.ShardParams(in.params);
    try {
      layer.Forward(p, in.x.Slice(0, t_num / w).Clone(), {});
    } catch (const InvalidArgument& e) {
      errors[static_cast<size_t>(world.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("drop_policy random"), std::string::npos) << e;
    EXPECT_NE(e.find("overlap"), std::string::npos) << e;
  }
}

TEST(GateLossSums, SumsOfTwoHalvesGiveTheWholeBatchsLossesAndGradients) {
  for (moe::AuxLoss aux :
       {moe::AuxLoss::kGShard, moe::AuxLoss::kGShardAllChoices, moe::AuxLoss::kImportanceLoad}) {
    moe::LayerConfig c = SmallConfig(4, true);
    c.aux_loss = aux;
    c.noise =
        aux == moe::AuxLoss::kImportanceLoad ? moe::NoiseKind::kTutelNormal : moe::NoiseKind::kNone;
    const Inputs in = MakeInputs(c, 20, 81);
    const moe::GateResult whole = moe::GateForward(c, in.x, in.params.gate_weight, Tensor(), {});
    const moe::GateResult a =
        moe::GateForward(c, in.x.Slice(0, 7), in.params.gate_weight, Tensor(), {0, 0});
    const moe::GateResult b =
        moe::GateForward(c, in.x.Slice(7, 20), in.params.gate_weight, Tensor(), {7, 0});
    std::vector<double> sa = moe::ComputeGateLossSums(c, a).ToVector();
    std::vector<double> sb = moe::ComputeGateLossSums(c, b).ToVector();
    for (size_t i = 0; i < sa.size(); ++i) sa[i] += sb[i];
    const moe::GateLossSums batch = moe::GateLossSums::FromVector(c, sa);
    const moe::GateLosses expected = moe::ComputeGateLosses(c, whole);
    const moe::GateLosses got = moe::GateLossesFromSums(c, batch);
    EXPECT_NEAR(got.l_aux, expected.l_aux, 1e-6 * std::abs(expected.l_aux) + 1e-7);
    EXPECT_NEAR(got.z_loss, expected.z_loss, 1e-6 * std::abs(expected.z_loss));
    Tensor dw = Tensor::Zeros({20, 4}), da = Tensor::Zeros({7, 4}), db = Tensor::Zeros({13, 4});
    moe::GateLossesBackward(c, whole, 0.5f, 0.25f, dw);
    moe::GateLossesBackward(c, a, 0.5f, 0.25f, da, batch);
    moe::GateLossesBackward(c, b, 0.5f, 0.25f, db, batch);
    for (int64_t i = 0; i < 20 * 4; ++i) {
      float got_i = i < 28 ? da.data<float>()[i] : db.data<float>()[i - 28];
      EXPECT_NEAR(got_i, dw.data<float>()[i], 1e-6 + 1e-5 * std::abs(dw.data<float>()[i]))
          << moe::AuxLossName(aux) << " element " << i;
    }
  }
}

}  // namespace
}  // namespace switchyard::parallel
