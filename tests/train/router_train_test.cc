// The Megatron-Core router options in training (docs/moe.md):
// - the aux-loss-free expert bias: after each step every MoE block's bias moves by
//   rate * sign(mean - count) with Megatron-Core's counts (the pairs each expert kept after drops,
//   over every micro-batch and every rank). A distributed run's bias trajectory equals the
//   one-rank run's bit for bit, on every rank, in every layout.
// - aux_loss global: the running mean of the counts over the step's micro-batches, on every rank:
//   every layout gives the one-rank run's losses, gradient norms and parameters.
// - router_group_by ep_rank | node: device- and node-limited routing; every token's experts sit on
//   at most group_topk ranks (nodes), and the run equals one rank with num_groups set alike.
// - aux_loss sequence: the sequence length is seq_len; every layout equals one rank.
// - router trace and replay: a run replaying its own trace reproduces its losses bit for bit, and
//   the trace replays in other layouts and on other weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/gate.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/trainer.h"
#include "train/run_compare.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using testing::TempDir;

// Every MoE block's bias this rank holds, by parameter name.
std::map<std::string, std::vector<float>> Biases(const TransformerLm& model, int64_t num_layers) {
  std::map<std::string, std::vector<float>> all;
  for (int64_t b = 0; b < num_layers; ++b) {
    const std::string name = "blocks." + std::to_string(b) + ".moe.gate.expert_bias";
    const Parameter* p = model.parameters().Find(name);
    if (p == nullptr) continue;
    all[name].assign(p->value.data<float>(), p->value.data<float>() + p->value.numel());
  }
  return all;
}

// Per step, the biases by name.
using Trajectory = std::vector<std::map<std::string, std::vector<float>>>;

struct Recorded {
  Trajectory bias;
  std::vector<double> drop_rate;  // first block's, per step
};

Recorded OneRank(const TrainConfig& c, int steps) {
  Trainer t(c);
  Recorded r;
  for (int s = 0; s < steps; ++s) {
    StepMetrics m = t.Step();
    r.drop_rate.push_back(m.drop_rate.empty() ? 0.0 : m.drop_rate[0]);
    r.bias.push_back(Biases(t.model(), c.model.num_layers));
  }
  return r;
}

// Every rank's biases after every step must be the one-rank run's, bit for bit, for the blocks
// the rank holds (a pipeline stage holds its own).
void ExpectSameTrajectoryOnEveryRank(const TrainConfig& c, int steps, const Trajectory& want,
                                     const std::string& what) {
  std::vector<Trajectory> per_rank(static_cast<size_t>(c.ranks));
  comm::RunInProcess(static_cast<int>(c.ranks), [&](comm::Communicator& world) {
    RankTrainer rt(c, world, world.size());
    Trajectory t;
    for (int s = 0; s < steps; ++s) {
      rt.trainer().Step();
      t.push_back(Biases(rt.trainer().model(), c.model.num_layers));
    }
    per_rank[static_cast<size_t>(world.rank())] = std::move(t);
  });
  for (size_t r = 0; r < per_rank.size(); ++r) {
    ASSERT_EQ(per_rank[r].size(), want.size()) << what;
    for (size_t s = 0; s < want.size(); ++s) {
      ASSERT_FALSE(per_rank[r][s].empty()) << what << ": rank " << r << " holds no MoE block";
      for (const auto& [name, bias] : per_rank[r][s]) {
        EXPECT_EQ(bias, want[s].at(name)) << what << ": rank " << r << " step " << s << " " << name;
      }
    }
  }
}

class RouterTrainTest : public ::testing::Test {
 protected:
  void SetUp() override { kernels::SetBlasThreads(1); }
  TrainConfig Config(int64_t microbatches, int64_t num_layers) {
    TrainConfig c = testing::TinyMoeConfig(dir_);
    c.sample_tokens = 0;
    c.model.num_layers = num_layers;
    c.model.num_heads = 4;
    c.microbatches = microbatches;
    WriteTextFileAtomic(dir_ / "layer.json",
                        R"({"expert_bias": true, "expert_bias_update_rate": 0.01})");
    c.moe_layer_config = dir_ / "layer.json";
    // The run's key, as ResolveTrainConfig takes it from the file (MoeLayerConfig hands the
    // run's value to the layer).
    c.expert_bias_update_rate = 0.01;
    return c;
  }
  // Config(2, 4) with a layer file of its own (layer_<name>.json: Config rewrites layer.json)
  // and the run's key set to aux_loss `name` (as ResolveTrainConfig takes it from the file).
  TrainConfig WithAuxLoss(const std::string& name) {
    TrainConfig c = Config(2, 4);
    const std::string file = dir_ / fmt::format("layer_{}.json", name);
    WriteTextFileAtomic(file, fmt::format(R"({{"aux_loss": "{}"}})", name));
    c.moe_layer_config = file;
    c.aux_loss = name;
    return c;
  }
  struct RunLayout {
    int ranks, ep, tp, pp, cp;
    const char* recompute;
  };
  // Every layout's run of c equals `want` (c on one rank).
  static void ExpectLayoutsEqual(const TrainConfig& c, int steps, const testing::RunRecord& want,
                                 std::initializer_list<RunLayout> layouts) {
    for (const RunLayout& l : layouts) {
      TrainConfig d = c;
      d.ranks = l.ranks, d.ep = l.ep, d.tp = l.tp, d.pp = l.pp, d.cp = l.cp;
      d.model.recompute = RecomputeFromName(l.recompute);
      const std::string what = fmt::format("ranks {} ep {} tp {} pp {} cp {} recompute {}", l.ranks,
                                           l.ep, l.tp, l.pp, l.cp, l.recompute);
      testing::ExpectSameRun(want, testing::OnRanks(d, steps), what);
    }
  }
  TempDir dir_;
};

TEST_F(RouterTrainTest, DistributedTrajectoryEqualsOneRank) {
  const int kSteps = 4;
  struct Layout {
    int ranks, ep, tp, pp, cp;
    int64_t microbatches;
  };
  const Layout layouts[] = {
      {2, 0, 1, 1, 1, 1}, {4, 2, 1, 1, 1, 1}, {4, 4, 1, 1, 1, 2},
      {4, 0, 2, 1, 1, 2}, {4, 0, 1, 2, 1, 4}, {4, 2, 1, 1, 2, 2},
  };
  for (const Layout& l : layouts) {
    TrainConfig c = Config(l.microbatches, 4);  // blocks 1 and 3 are MoE blocks
    const Recorded want = OneRank(c, kSteps);
    // The reference exercises the rule: drops happen and the bias moves every step, in both
    // blocks.
    ASSERT_EQ(want.bias.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(want.bias[0].size(), 2u);
    EXPECT_GT(want.drop_rate[0], 0.0);
    for (int s = 0; s < kSteps; ++s) {
      for (const auto& [name, bias] : want.bias[s]) {
        double moved = 0;
        for (size_t e = 0; e < bias.size(); ++e) {
          moved += std::abs(bias[e] - (s == 0 ? 0.0f : want.bias[s - 1].at(name)[e]));
        }
        EXPECT_GT(moved, 0.0) << "step " << s << " " << name;
      }
    }
    c.ranks = l.ranks;
    c.ep = l.ep;
    c.tp = l.tp;
    c.pp = l.pp;
    c.cp = l.cp;
    ExpectSameTrajectoryOnEveryRank(c, kSteps, want.bias,
                                    fmt::format("ranks {} ep {} tp {} pp {} cp {} microbatches {}",
                                                l.ranks, l.ep, l.tp, l.pp, l.cp, l.microbatches));
  }
}

// The counts are the pairs each expert KEPT (Megatron's routing_map after token dropping), not
// the routed loads. With capacity factor 0.5 every expert's capacity is half the mean load, and
// when every expert is asked for more than that, each keeps exactly its capacity: the kept counts
// are equal and the bias does not move, where the routed loads (unequal) would move it.
TEST_F(RouterTrainTest, CountsAreThePairsKeptAfterDrops) {
  TrainConfig c = Config(1, 2);
  c.capacity_factor = 0.5;  // C = k floor(0.5 ceil(T / E)) = 2 x 16 = 32 of 128 tokens, 4 experts
  Trainer t(c);
  const StepMetrics m = t.Step();
  ASSERT_EQ(m.expert_load.size(), 1u);
  bool unequal = false;
  for (int64_t load : m.expert_load[0]) {
    ASSERT_GT(load, 32) << "an expert under its capacity: the case does not apply";
    unequal = unequal || load != m.expert_load[0][0];
  }
  EXPECT_TRUE(unequal);  // the routed loads alone would move the bias
  for (const auto& [name, bias] : Biases(t.model(), c.model.num_layers)) {
    for (float b : bias) EXPECT_EQ(b, 0.0f) << name;
  }
}

// aux_loss global with 2 micro-batches per step: the loss of a micro-batch uses the running mean
// of the counts of the step so far, which the FFN keeps per step (also through recomputation and
// pipeline schedules); every layout equals one rank, and the loss differs from the per-micro-batch
// all-choices loss it equals on the first micro-batch.
TEST_F(RouterTrainTest, GlobalAuxLossEveryLayoutEqualsOneRank) {
  TrainConfig c = WithAuxLoss("global");
  const int kSteps = 3;
  const testing::RunRecord want = testing::SingleRank(c, kSteps);
  const testing::RunRecord all_choices = testing::SingleRank(WithAuxLoss("gshard_all_choices"), 1);
  EXPECT_GT(want.aux_loss[0], 0.5);
  EXPECT_NE(want.aux_loss[0], all_choices.aux_loss[0]);  // the second micro-batch's mean counts
  ExpectLayoutsEqual(c, kSteps, want,
                     {{2, 0, 1, 1, 1, "none"},
                      {4, 4, 1, 1, 1, "full"},
                      {4, 0, 2, 1, 1, "none"},
                      {4, 0, 1, 2, 1, "none"},
                      {4, 2, 1, 1, 2, "none"}});
  // The per-rank scope routes each rank's tokens alone (its own capacity and drops), so it equals
  // one rank only without drops (capacity factor 0); the global loss is still the whole
  // micro-batch's, counted once in the objective.
  TrainConfig no_drops = c;
  no_drops.capacity_factor = 0;
  const testing::RunRecord want_no_drops = testing::SingleRank(no_drops, kSteps);
  for (int ep : {2, 4}) {
    TrainConfig d = no_drops;
    d.ranks = 4, d.ep = ep;
    d.routing_scope = "per_rank";
    testing::ExpectSameRun(want_no_drops, testing::OnRanks(d, kSteps),
                           fmt::format("ranks 4 ep {} per_rank, no drops", ep));
  }
}

// Runs f, which must throw InvalidArgument with `needle` in its message.
template <typename F>
void ExpectError(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming " << needle;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Per token of a router trace (every rank's file of `step`, blocks by prefix), the number of
// distinct groups of `experts_per_group` consecutive experts its choices fall in; the largest.
int64_t MostGroupsOfAToken(const std::string& dir, int64_t step, int64_t experts_per_group) {
  int64_t most = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(RouterTrace::StepDirectory(dir, step))) {
    const TensorMap file = ReadSafetensors(entry.path());
    for (const auto& [name, stored] : file) {
      if (!name.ends_with(".experts")) continue;
      const Tensor t = TraceExpertIdsAsInt32(stored);
      const int64_t k = t.size(1);
      const int32_t* e = t.data<int32_t>();
      for (int64_t i = 0; i < t.size(0); ++i) {
        std::vector<int64_t> groups;
        for (int64_t j = 0; j < k; ++j) groups.push_back(e[i * k + j] / experts_per_group);
        std::sort(groups.begin(), groups.end());
        const auto distinct = std::unique(groups.begin(), groups.end()) - groups.begin();
        most = std::max<int64_t>(most, distinct);
      }
    }
  }
  return most;
}

// router_group_by: the groups are the ep ranks' experts (ep_rank) or the nodes' (node). With
// group_topk 1 every token's 2 experts sit on one rank (one node) in the trace of the run, where
// the same run without the limit sends some token to two; and the run equals one rank routing
// with num_groups set to the same groups, step for step.
TEST_F(RouterTrainTest, GroupByLimitsTheRanksOfEveryTokenAndEqualsOneRank) {
  TrainConfig c = Config(2, 4);
  WriteTextFileAtomic(dir_ / "layer.json", "{}");
  c.num_experts = 8;
  const int kSteps = 2;
  struct Case {
    const char* group_by;
    int ranks, ep, ranks_per_node;
    int64_t groups;
  };
  for (const Case& k :
       {Case{"ep_rank", 4, 4, 0, 4}, Case{"ep_rank", 4, 2, 0, 2}, Case{"node", 4, 4, 2, 2}}) {
    const std::string what =
        fmt::format("{} ranks {} ep {} nodes of {}", k.group_by, k.ranks, k.ep, k.ranks_per_node);
    TrainConfig one = c;
    one.num_groups = k.groups;
    one.group_topk = 1;
    const testing::RunRecord want = testing::SingleRank(one, kSteps);
    TrainConfig d = c;
    d.ranks = k.ranks, d.ep = k.ep, d.a2a_ranks_per_node = k.ranks_per_node;
    d.router_group_by = k.group_by;
    d.group_topk = 1;
    d.router_trace = dir_ / fmt::format("trace_{}_{}", k.group_by, k.ep);
    EXPECT_EQ(RouterGroupCount(d), k.groups) << what;
    testing::ExpectSameRun(want, testing::OnRanks(d, kSteps), what);
    const int64_t per_group = c.num_experts / k.groups;
    for (int64_t step = 1; step <= kSteps; ++step) {
      EXPECT_EQ(MostGroupsOfAToken(d.router_trace, step, per_group), 1) << what << " step " << step;
    }
    TrainConfig free = d;
    free.router_group_by = "none";
    free.group_topk = 0;
    free.router_trace = dir_ / fmt::format("free_{}_{}", k.group_by, k.ep);
    (void)testing::OnRanks(free, 1);
    EXPECT_EQ(MostGroupsOfAToken(free.router_trace, 1, per_group), 2) << what << " (no limit)";
  }
  // The keys it needs, named.
  TrainConfig d = c;
  d.ranks = 4;
  d.router_group_by = "ep_rank";
  ExpectError([&] { (void)RouterGroupCount(d); }, "'group_topk'");
  d.group_topk = 1;
  d.num_groups = 2;
  ExpectError([&] { (void)RouterGroupCount(d); }, "leave 'num_groups' unset");
  d.num_groups = 1;
  d.router_group_by = "node";
  ExpectError([&] { (void)RouterGroupCount(d); }, "'a2a_ranks_per_node'");
  d.a2a_ranks_per_node = 3;
  ExpectError([&] { (void)RouterGroupCount(d); }, "divide the expert-parallel size 4");
  d.router_group_by = "ep_rank";
  d.ranks = 2;
  d.ep = 2;  // explicit: the default ep of 5 experts on 2 ranks is their gcd, 1
  d.num_experts = 5;
  ExpectError([&] { (void)RouterGroupCount(d); }, "5 experts do not divide by 'ep' 2");
}

// aux_loss sequence in training: the layer's sequence_length is seq_len (a batch's rows are its
// samples' positions in turn), the loss is the mean over the micro-batch's sequences of
// E / (k S^2) sum_e P_e N_e, and every layout (data parallelism, expert parallelism, context
// parallelism splitting each sequence over 2 ranks, pipeline stages, micro-batches) equals one
// rank. With 8 sequences per micro-batch it differs from the batch-level all-choices loss.
TEST_F(RouterTrainTest, SequenceAuxLossEveryLayoutEqualsOneRank) {
  TrainConfig c = WithAuxLoss("sequence");
  EXPECT_EQ(MoeLayerConfig(c).sequence_length, c.model.seq_len);
  const int kSteps = 3;
  const testing::RunRecord want = testing::SingleRank(c, kSteps);
  const testing::RunRecord all_choices = testing::SingleRank(WithAuxLoss("gshard_all_choices"), 1);
  EXPECT_GT(want.aux_loss[0], 0.5);
  EXPECT_NE(want.aux_loss[0], all_choices.aux_loss[0]);  // the statistics per sequence
  ExpectLayoutsEqual(c, kSteps, want,
                     {{2, 0, 1, 1, 1, "none"},
                      {4, 4, 1, 1, 1, "full"},
                      {4, 0, 2, 1, 1, "none"},
                      {4, 0, 1, 2, 1, "none"},
                      {4, 2, 1, 1, 2, "none"},
                      {2, 2, 1, 1, 2, "none"}});
  // The layer file's own sequence_length must be the run's.
  WriteTextFileAtomic(dir_ / "layer_len.json", R"({"aux_loss": "sequence", "sequence_length": 8})");
  c.moe_layer_config = dir_ / "layer_len.json";
  ExpectError([&] { (void)MoeLayerConfig(c); }, "'seq_len' 16");
}

// Router trace and replay. A run records its routes; the same run replaying them reproduces every
// loss, gradient norm and expert load bit for bit; a model with other initial weights, which
// routes otherwise by itself, takes the recorded routes; 2 and 4 ranks replaying the one-rank
// trace equal the one-rank run. A step that was not recorded and another top_k are errors.
TEST_F(RouterTrainTest, ReplayingItsOwnTraceReproducesTheRunBitForBit) {
  const TrainConfig c = Config(2, 4);
  const std::string dir = dir_ / "trace";
  const int kSteps = 3;
  auto trace = [&](bool record, int rank) {
    RouterTraceOptions o;
    (record ? o.record_dir : o.replay_dir) = dir;
    return std::make_shared<RouterTrace>(o, rank);
  };
  testing::RunRecord recorded, replayed;
  {
    Trainer t(c);
    t.SetRouterTrace(trace(true, 0));
    for (int s = 0; s < kSteps; ++s) recorded.Add(t.Step());
    recorded.model = t.model().parameters().Values();
  }
  const std::string first = RouterTrace::StepDirectory(dir, 1) + "/rank_00000.safetensors";
  ASSERT_TRUE(std::filesystem::exists(first));
  const TensorMap file = ReadSafetensors(first);
  ASSERT_EQ(file.at("blocks.1.moe.experts").shape(), (Shape{8 * 16, 2}));  // both micro-batches
  EXPECT_EQ(file.at("blocks.3.moe.weights").dtype(), DType::kBFloat16);
  EXPECT_EQ(file.at("blocks.3.moe.tokens").data<int64_t>()[8 * 16 - 1], 8 * 16 - 1);
  {
    Trainer t(c);
    t.SetRouterTrace(trace(false, 0));
    for (int s = 0; s < kSteps; ++s) replayed.Add(t.Step());
  }
  EXPECT_EQ(replayed.loss, recorded.loss);
  EXPECT_EQ(replayed.grad_norm, recorded.grad_norm);
  EXPECT_EQ(replayed.loads, recorded.loads);

  TrainConfig other = c;
  other.seed = c.seed + 7;  // other initial weights
  {
    Trainer free_run(other);
    EXPECT_NE(free_run.Step().expert_load, recorded.loads[0]);
    Trainer t(other);
    t.SetRouterTrace(trace(false, 0));
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(t.Step().expert_load, recorded.loads[static_cast<size_t>(s)]) << "step " << s;
    }
    try {
      t.Step();
      FAIL() << "step 4 replayed without a trace";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("no routes of step 4"), std::string::npos) << e.what();
    }
  }
  for (const auto& [ranks, ep] : {std::pair{2, 2}, std::pair{4, 0}}) {
    TrainConfig d = c;
    d.ranks = ranks, d.ep = ep;
    testing::RunRecord got;
    std::mutex mu;
    comm::RunInProcess(ranks, [&](comm::Communicator& world) {
      RankTrainer rt(d, world, world.size());
      rt.trainer().SetRouterTrace(trace(false, world.rank()));
      testing::RunRecord r;
      for (int s = 0; s < kSteps; ++s) r.Add(rt.trainer().Step());
      CheckpointData snap = rt.trainer().Snapshot();
      std::lock_guard<std::mutex> lock(mu);
      if (world.rank() == 0) {
        got = r;
        got.model = snap.model;
      }
    });
    testing::ExpectSameRun(recorded, got, fmt::format("replay on {} ranks ep {}", ranks, ep));
  }
  TrainConfig top1 = c;
  top1.top_k = 1;
  Trainer t(top1);
  t.SetRouterTrace(trace(false, 0));
  try {
    t.Step();
    FAIL() << "a top-2 trace replayed into top-1 layers";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("records top-2 routes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace switchyard::train
