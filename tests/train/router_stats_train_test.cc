// Per MoE layer router statistics of a training step (StepMetrics::router, "router" in
// metrics.jsonl; docs/observability.md). They are global: over every rank and micro-batch of the
// step, whatever the layout.
// - On one rank and on distributed layouts (dp 2 x ep 2, pp 2, tp 2), every step's loads, least
//   and most loaded expert, max/mean, CV, tokens and dropped share equal a plain recount of the
//   router trace the same run recorded (every rank's file, each token once).
// - Every rank of a layout logs the same statistics, and they equal the one-rank run's: the counts
//   exactly, the entropy and the losses up to float summation order, the expert bias bit for bit.
// - The mean over the layers of l_aux and z_loss are the step's aux_loss and z_loss; the entropy
//   lies in (0, log E]; the bias range is the bias the step routed with (0 at step 1, moving
//   after).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/trainer.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using testing::TempDir;

// Per step, per MoE layer, the logged statistics.
using StatsRun = std::vector<std::vector<moe::RouterStats>>;

// The same statistics recounted from a router trace: per layer (by parameter prefix, in block
// order for fewer than 10 blocks) the routed pairs per expert and the pairs with a zero combine
// weight (dropped), each token counted once over the step's rank files.
struct Recount {
  int64_t tokens = 0, dropped = 0;
  std::vector<double> loads;
};

std::map<std::string, Recount> RecountTrace(const std::string& dir, int64_t step,
                                            int64_t num_experts) {
  std::map<std::string, Recount> out;
  std::map<std::string, std::set<int64_t>> seen;
  for (const auto& entry :
       std::filesystem::directory_iterator(RouterTrace::StepDirectory(dir, step))) {
    const TensorMap file = ReadSafetensors(entry.path());
    for (const auto& [name, stored] : file) {
      if (!name.ends_with(".experts")) continue;
      // Compact ids: int16 for any layer of <= 32768 experts.
      EXPECT_EQ(stored.dtype(), DType::kInt16) << name;
      const Tensor experts = TraceExpertIdsAsInt32(stored);
      const std::string prefix = name.substr(0, name.size() - std::string("experts").size());
      const Tensor& tokens = file.at(prefix + "tokens");
      const Tensor weights = file.at(prefix + "weights").To(DType::kFloat32);
      Recount& r = out[prefix];
      r.loads.resize(static_cast<size_t>(num_experts), 0.0);
      const int64_t k = experts.size(1);
      for (int64_t i = 0; i < experts.size(0); ++i) {
        if (!seen[prefix].insert(tokens.data<int64_t>()[i]).second) continue;  // tp replicas
        ++r.tokens;
        for (int64_t j = 0; j < k; ++j) {
          r.loads[static_cast<size_t>(experts.data<int32_t>()[i * k + j])] += 1;
          r.dropped += weights.data<float>()[i * k + j] == 0.0f ? 1 : 0;
        }
      }
    }
  }
  return out;
}

// The statistics of the loads written out plainly (population CV).
void ExpectStatsOfRecount(const moe::RouterStats& got, const Recount& r, const std::string& what) {
  double routed = 0, lo = r.loads[0], hi = r.loads[0];
  for (double l : r.loads) routed += l, lo = std::min(lo, l), hi = std::max(hi, l);
  const double mean = routed / static_cast<double>(r.loads.size());
  double var = 0;
  for (double l : r.loads) var += (l - mean) * (l - mean);
  var /= static_cast<double>(r.loads.size());
  EXPECT_EQ(got.num_tokens, r.tokens) << what;
  EXPECT_EQ(got.routed, static_cast<int64_t>(routed)) << what;
  EXPECT_EQ(got.min_load, static_cast<int64_t>(lo)) << what;
  EXPECT_EQ(got.max_load, static_cast<int64_t>(hi)) << what;
  EXPECT_NEAR(got.max_over_mean, hi / mean, 1e-12) << what;
  EXPECT_NEAR(got.cv, std::sqrt(var) / mean, 1e-12) << what;
  EXPECT_NEAR(got.dropped_share, static_cast<double>(r.dropped) / routed, 1e-12) << what;
}

class RouterStatsTrainTest : public ::testing::Test {
 protected:
  void SetUp() override { kernels::SetBlasThreads(1); }

  // 4 blocks (MoE blocks 1 and 3), 2 micro-batches, capacity drops, the expert bias on.
  TrainConfig Config() {
    TrainConfig c = testing::TinyMoeConfig(dir_);
    c.sample_tokens = 0;
    c.model.num_layers = 4;
    c.model.num_heads = 4;
    c.microbatches = 2;
    WriteTextFileAtomic(dir_ / "layer.json",
                        R"({"expert_bias": true, "expert_bias_update_rate": 0.01})");
    c.moe_layer_config = dir_ / "layer.json";
    c.expert_bias_update_rate = 0.01;
    return c;
  }

  // `steps` steps of c (on c.ranks in-process ranks) recording a trace into `trace`; every
  // rank's statistics, which must agree, and the step metrics of rank 0.
  static std::vector<StepMetrics> Run(TrainConfig c, int steps, const std::string& trace) {
    c.router_trace = trace;
    if (c.ranks == 1) {
      Trainer t(c);
      std::vector<StepMetrics> out;
      for (int s = 0; s < steps; ++s) out.push_back(t.Step());
      return out;
    }
    std::vector<std::vector<StepMetrics>> per_rank(static_cast<size_t>(c.ranks));
    std::mutex mu;
    comm::RunInProcess(static_cast<int>(c.ranks), [&](comm::Communicator& world) {
      RankTrainer rt(c, world, world.size());
      std::vector<StepMetrics> mine;
      for (int s = 0; s < steps; ++s) mine.push_back(rt.trainer().Step());
      std::lock_guard<std::mutex> lock(mu);
      per_rank[static_cast<size_t>(world.rank())] = std::move(mine);
    });
    for (size_t r = 1; r < per_rank.size(); ++r) {
      for (int s = 0; s < steps; ++s) {
        const auto& a = per_rank[0][static_cast<size_t>(s)].router;
        const auto& b = per_rank[r][static_cast<size_t>(s)].router;
        EXPECT_EQ(a.size(), b.size()) << "rank " << r;
        for (size_t l = 0; l < a.size() && l < b.size(); ++l) {
          EXPECT_EQ(a[l].max_load, b[l].max_load) << "rank " << r << " step " << s;
          EXPECT_EQ(a[l].entropy, b[l].entropy) << "rank " << r << " step " << s;
          EXPECT_EQ(a[l].l_aux, b[l].l_aux) << "rank " << r << " step " << s;
          EXPECT_EQ(a[l].bias_max, b[l].bias_max) << "rank " << r << " step " << s;
        }
      }
    }
    return per_rank[0];
  }

  TempDir dir_;
};

TEST_F(RouterStatsTrainTest, LoggedStatsAreARecountOfTheTraceAndEqualOneRankInEveryLayout) {
  const TrainConfig c = Config();
  const int kSteps = 3;
  const double log_e = std::log(static_cast<double>(c.num_experts));
  struct Layout {
    int ranks, ep, tp, pp;
  };
  std::vector<StepMetrics> want;
  for (const Layout& lay :
       {Layout{1, 0, 1, 1}, Layout{4, 2, 1, 1}, Layout{2, 0, 1, 2}, Layout{4, 0, 2, 1}}) {
    TrainConfig d = c;
    d.ranks = lay.ranks, d.ep = lay.ep, d.tp = lay.tp, d.pp = lay.pp;
    const std::string what =
        fmt::format("ranks {} ep {} tp {} pp {}", lay.ranks, lay.ep, lay.tp, lay.pp);
    const std::string trace =
        dir_ / fmt::format("trace_{}_{}_{}_{}", lay.ranks, lay.ep, lay.tp, lay.pp);
    const std::vector<StepMetrics> got = Run(d, kSteps, trace);
    if (want.empty()) want = got;
    for (int s = 0; s < kSteps; ++s) {
      const StepMetrics& m = got[static_cast<size_t>(s)];
      const std::string at = fmt::format("{} step {}", what, s + 1);
      const auto recount = RecountTrace(trace, s + 1, c.num_experts);
      ASSERT_EQ(m.router.size(), 2u) << at;
      ASSERT_EQ(recount.size(), 2u) << at;
      size_t l = 0;
      double aux = 0, z = 0;
      for (const auto& [prefix, r] : recount) {
        const moe::RouterStats& st = m.router[l];
        ExpectStatsOfRecount(st, r, at + " " + prefix);
        EXPECT_EQ(st.num_tokens, c.batch_size * c.model.seq_len) << at;
        EXPECT_GT(st.entropy, 0.0) << at;
        EXPECT_LE(st.entropy, log_e + 1e-12) << at;
        // The bias the step routed with: 0 before the first update, then moved by the rule.
        EXPECT_EQ(st.bias_min == 0 && st.bias_max == 0, s == 0) << at;
        const moe::RouterStats& one = want[static_cast<size_t>(s)].router[l];
        EXPECT_EQ(st.routed, one.routed) << at;
        EXPECT_EQ(st.max_load, one.max_load) << at;
        EXPECT_EQ(st.min_load, one.min_load) << at;
        EXPECT_EQ(st.dropped_share, one.dropped_share) << at;
        EXPECT_NEAR(st.entropy, one.entropy, 1e-5 * one.entropy) << at;
        EXPECT_NEAR(st.l_aux, one.l_aux, 2e-5 * one.l_aux) << at;
        EXPECT_NEAR(st.z_loss, one.z_loss, 2e-5 * one.z_loss) << at;
        EXPECT_EQ(st.bias_min, one.bias_min) << at;
        EXPECT_EQ(st.bias_max, one.bias_max) << at;
        aux += st.l_aux / 2;
        z += st.z_loss / 2;
        ++l;
      }
      EXPECT_NEAR(aux, m.aux_loss, 1e-9 * m.aux_loss) << at;
      EXPECT_NEAR(z, m.z_loss, 1e-9 * m.z_loss) << at;
    }
    // The case exercises the statistics: drops, imbalance, a moving bias.
    EXPECT_GT(got[0].router[0].dropped_share, 0.0) << what;
    EXPECT_GT(got[0].router[0].max_over_mean, 1.0) << what;
    EXPECT_LT(got[2].router[0].bias_min, got[2].router[0].bias_max) << what;
  }
}

// The aux-loss-free expert bias is state: a checkpoint holds it and a resumed run routes as the
// run that went straight on (every loss and the logged bias range bit for bit).
TEST_F(RouterStatsTrainTest, ExpertBiasIsCheckpointedAndResumesBitForBit) {
  const TrainConfig c = Config();
  const std::string bias = "blocks.1.moe.gate.expert_bias";
  std::vector<StepMetrics> straight;
  {
    Trainer t(c);
    for (int s = 0; s < 4; ++s) straight.push_back(t.Step());
  }
  std::vector<StepMetrics> resumed;
  {
    Trainer t(c);
    for (int s = 0; s < 2; ++s) resumed.push_back(t.Step());
    (void)SaveCheckpoint(dir_ / "ckpts", t.Snapshot());
    t.Step();  // the interrupted run went on; must not matter
  }
  const CheckpointData saved = LoadCheckpoint(dir_ / "ckpts");
  ASSERT_TRUE(saved.model.contains(bias));
  const Tensor& b = saved.model.at(bias);
  EXPECT_EQ(*std::min_element(b.data<float>(), b.data<float>() + b.numel()),
            straight[2].router[0].bias_min);  // the bias step 3 routed with
  EXPECT_EQ(*std::max_element(b.data<float>(), b.data<float>() + b.numel()),
            straight[2].router[0].bias_max);
  EXPECT_LT(straight[2].router[0].bias_min, straight[2].router[0].bias_max);
  {
    Trainer t(c);
    t.Restore(saved);
    for (int s = 0; s < 2; ++s) resumed.push_back(t.Step());
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t s = 0; s < straight.size(); ++s) {
    EXPECT_EQ(resumed[s].loss, straight[s].loss) << "step " << s + 1;
    EXPECT_EQ(resumed[s].expert_load, straight[s].expert_load) << "step " << s + 1;
    for (size_t l = 0; l < straight[s].router.size(); ++l) {
      EXPECT_EQ(resumed[s].router[l].bias_min, straight[s].router[l].bias_min) << "step " << s + 1;
      EXPECT_EQ(resumed[s].router[l].bias_max, straight[s].router[l].bias_max) << "step " << s + 1;
    }
  }
}

// metrics.jsonl holds them: a line written and read back gives the same statistics.
TEST_F(RouterStatsTrainTest, MetricsLineRoundTripsTheStatistics) {
  StepMetrics m;
  m.step = 7;
  m.expert_load = {{3, 5}};
  m.drop_rate = {0.25};
  moe::RouterStats st;
  st.num_tokens = 4, st.routed = 8, st.min_load = 3, st.max_load = 5;
  st.max_over_mean = 1.25, st.cv = 0.25, st.dropped_share = 0.125, st.entropy = 0.6931;
  st.l_aux = 1.0625, st.z_loss = 0.5, st.bias_min = -0.01f, st.bias_max = 0.02f;
  m.router = {st};
  const StepMetrics back = MetricsFromJson(MetricsToJson(m), "line");
  ASSERT_EQ(back.router.size(), 1u);
  const moe::RouterStats& b = back.router[0];
  EXPECT_EQ(b.num_tokens, 4);
  EXPECT_EQ(b.routed, 8);
  EXPECT_EQ(b.min_load, 3);
  EXPECT_EQ(b.max_load, 5);
  EXPECT_EQ(b.max_over_mean, 1.25);
  EXPECT_EQ(b.cv, 0.25);
  EXPECT_EQ(b.dropped_share, 0.125);
  EXPECT_EQ(b.entropy, 0.6931);
  EXPECT_EQ(b.l_aux, 1.0625);
  EXPECT_EQ(b.z_loss, 0.5);
  EXPECT_EQ(b.bias_min, st.bias_min);
  EXPECT_EQ(b.bias_max, st.bias_max);
}

}  // namespace
}  // namespace switchyard::train
