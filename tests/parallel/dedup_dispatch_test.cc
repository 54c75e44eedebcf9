// The per-destination-rank dispatch of the all-to-all-v exchange (DeepSeek-V3 / DeepEP,
// src/parallel/dedup_exchange.h): with top-k > 1 and group-limited routing every layout equals the
// single-rank layer, and the token bytes each rank moves are exactly one row per (token, other
// destination rank), there and back, in the forward and in the backward.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "parallel/parallel_cases.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::parallel {
namespace {

using testing::Inputs;
using testing::MakeInputs;
using testing::MatchesReference;
using testing::SmallConfig;

// E = 8, k = 4, 4 groups of 2 experts of which each token may use 2 (DeepSeek-V3's router in
// miniature); capacity factor 1 drops some pairs, dropless none.
moe::LayerConfig GroupLimitedConfig(bool dropless, bool prescore) {
  moe::LayerConfig c = SmallConfig(8, dropless, 1.0f);
  c.top_k = 4;
  c.num_groups = 4;
  c.group_topk = 2;
  c.score_function = moe::ScoreFunction::kSigmoid;
  c.topk_scaling_factor = 2.5f;
  c.prescore = prescore;
  return c;
}

// Token bytes of each rank by the formula: per token, the distinct other ranks (of its expert
// group) holding one of its kept choices, one float32 row of M there and one back.
std::vector<double> DedupFormula(const LayerRunResult& run, int64_t num_tokens, int64_t k,
                                 int64_t local_experts, int64_t model_dim) {
  const size_t ranks = run.ranks.size();
  int shards = 0;
  for (const RankReport& r : run.ranks) shards = std::max(shards, r.coords.token_shard + 1);
  const std::vector<int64_t> split = EvenSplit(num_tokens, shards);
  std::vector<int64_t> rows(ranks, 0);
  const int32_t* experts = run.output.topk_idx.data<int32_t>();
  const int32_t* locations = run.output.locations.data<int32_t>();
  for (size_t src = 0; src < ranks; ++src) {
    const RankCoords& me = run.ranks[src].coords;
    int64_t begin = 0;
    for (int s = 0; s < me.token_shard; ++s) begin += split[static_cast<size_t>(s)];
    for (int64_t t = begin; t < begin + split[static_cast<size_t>(me.token_shard)]; ++t) {
      std::set<int> positions;
      for (int64_t j = 0; j < k; ++j) {
        if (locations[t * k + j] < 0) continue;
        const int position = static_cast<int>(experts[t * k + j] / local_experts);
        if (position != me.expert_position) positions.insert(position);
      }
      for (int position : positions) {
        ++rows[src];  // sent, and its partial output received back
        for (size_t dst = 0; dst < ranks; ++dst) {
          const RankCoords& c = run.ranks[dst].coords;
          if (c.expert_group == me.expert_group && c.expert_position == position) ++rows[dst];
        }
      }
    }
  }
  std::vector<double> bytes(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    bytes[r] = static_cast<double>(rows[r]) * static_cast<double>(model_dim) * 4.0;
  }
  return bytes;
}

// dp x ep and ep layouts, capacity with drops and dropless, post- and pre-score: outputs, l_aux,
// routing and every gradient equal the single-rank layer; each rank's token bytes (forward and
// backward alike) equal the formula; the per-pair exchange of the same run moves more; 3 threads
// per rank give the same bits as one.
TEST(DedupDispatch, GroupLimitedTopKEqualsOneRankAndMovesOneRowPerTokenAndRank) {
  const int64_t t_num = 48;
  for (const bool dropless : {false, true}) {
    for (const bool prescore : {false, true}) {
      const moe::LayerConfig config = GroupLimitedConfig(dropless, prescore);
      const Inputs in = MakeInputs(config, t_num, 83);
      const testing::Reference ref = testing::WholeBatchReference(config, in);
      if (!dropless) {
        ASSERT_GT(ref.output.dropped, 0);
      }
      for (const auto& [world, ep] : {std::pair{4, 4}, std::pair{4, 2}, std::pair{2, 2}}) {
        const std::string what =
            fmt::format("dropless {} prescore {} world {} ep {}", dropless, prescore, world, ep);
        double dedup_total = 0, pair_total = 0;
        for (const bool dedup : {true, false}) {
          DriverOptions o;
          o.parallel.mesh.world_size = world;
          o.parallel.mesh.ep = ep;
          o.parallel.dispatch = DispatchKind::kAllToAllV;
          o.parallel.dispatch_dedup = dedup;
          o.threads = 1;
          LayerRunResult run;
          ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << what;
          EXPECT_TRUE(MatchesReference(run, ref)) << what << " dedup " << dedup;
          const std::vector<double> formula =
              DedupFormula(run, t_num, config.top_k, config.num_experts / ep, config.model_dim);
          for (size_t r = 0; r < run.ranks.size(); ++r) {
            const double fwd = run.ranks[r].forward.Bytes(Traffic::kTokens);
            const double bwd = run.ranks[r].backward.Bytes(Traffic::kTokens);
            EXPECT_EQ(bwd, fwd) << what << " dedup " << dedup << " rank " << r;
            if (dedup) {
              EXPECT_EQ(fwd, formula[r]) << what << " rank " << r;
              dedup_total += fwd + bwd;
            } else {
              pair_total += fwd + bwd;
            }
          }
        }
        // The per-row loops on 3 threads per rank (512 tokens: several chunks of 64 rows) give
        // the same bits as on one.
        {
          const Inputs big = MakeInputs(config, 512, 89);
          DriverOptions o;
          o.parallel.mesh.world_size = world;
          o.parallel.mesh.ep = ep;
          o.parallel.dispatch = DispatchKind::kAllToAllV;
          LayerRunResult one, three;
          o.threads = 1;
          ASSERT_NO_THROW(one = RunLayerOnRanks(config, big.params, big.x, big.dy, o)) << what;
          o.threads = 3;
          ASSERT_NO_THROW(three = RunLayerOnRanks(config, big.params, big.x, big.dy, o)) << what;
          ASSERT_EQ(one.output.y.numel(), three.output.y.numel());
          for (int64_t i = 0; i < one.output.y.numel(); ++i) {
            ASSERT_EQ(one.output.y.data<float>()[i], three.output.y.data<float>()[i]) << what;
          }
          for (int64_t i = 0; i < one.grad_x.numel(); ++i) {
            ASSERT_EQ(one.grad_x.data<float>()[i], three.grad_x.data<float>()[i]) << what;
          }
        }
        // k = 4 choices in 2 groups of 2 experts: with ep 4 each token has 2 choices on each of
        // its 2 ranks.
        EXPECT_GT(dedup_total, 0) << what;
        EXPECT_LT(dedup_total, pair_total) << what;
      }
    }
  }
}

}  // namespace
}  // namespace switchyard::parallel
