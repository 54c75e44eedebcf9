// The Megatron-Core router options across ranks (docs/moe.md), against the single-rank layer on
// the whole micro-batch: aux_loss global (the statistics of the micro-batch on every rank and the
// running mean of the step's counts) in both batch scopes, and forced routes (replay).
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "parallel/parallel_cases.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/losses.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::parallel {
namespace {

using testing::Inputs;
using testing::MakeInputs;
using testing::SmallConfig;

struct RankResult {
  std::vector<float> l_aux;                 // per micro-batch
  std::vector<std::vector<double>> counts;  // per micro-batch, LayerOutput::aux_counts
  Tensor gate_grad;                         // summed over the micro-batches, after SyncGradients
};

// Two micro-batches of 16 tokens on `ranks` ranks (each rank its even share of both), the second
// fed the counts of the first; rank 0's results (the others' l_aux and counts must be the same).
RankResult RunOnRanks(const moe::LayerConfig& config, const ParallelOptions& options,
                      const std::vector<Inputs>& micro) {
  RankResult result;
  std::mutex mu;
  comm::RunInProcess(options.mesh.world_size, [&](comm::Communicator& world) {
    ParallelMoeLayer layer(config, options, MakeLayerGroups(world, config, options));
    const moe::LayerParams shard = layer.ShardParams(micro[0].params);
    const int shards = layer.mesh().data_shards();
    const int64_t share = micro[0].x.size(0) / shards;
    const int64_t begin = layer.coords().token_shard * share;
    moe::AuxCountsSoFar so_far;
    RankResult r;
    moe::LayerParams sum;
    for (size_t mb = 0; mb < micro.size(); ++mb) {
      ParallelForwardOptions o;
      o.global_token_offset = static_cast<int64_t>(mb) * 1000 + begin;
      o.aux_counts_so_far = &so_far;
      const ParallelOutput out = layer.Forward(shard, micro[mb].x.Slice(begin, begin + share), o);
      ParallelGradients g = layer.Backward(shard, out, micro[mb].dy.Slice(begin, begin + share), 1);
      layer.SyncGradients(&g.params, false, nullptr);
      r.l_aux.push_back(out.layer.l_aux);
      r.counts.push_back(out.layer.aux_counts);
      if (so_far.counts.empty()) so_far.counts.assign(out.layer.aux_counts.size(), 0.0);
      for (size_t e = 0; e < so_far.counts.size(); ++e) {
        so_far.counts[e] += out.layer.aux_counts[e];
      }
      ++so_far.micro_batches;
      if (!r.gate_grad.defined()) {
        r.gate_grad = g.params.gate_weight.Clone();
      } else {
        for (int64_t i = 0; i < r.gate_grad.numel(); ++i) {
          r.gate_grad.data<float>()[i] += g.params.gate_weight.data<float>()[i];
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    if (world.rank() == 0) {
      result = r;
    } else if (!result.l_aux.empty()) {
      EXPECT_EQ(r.l_aux, result.l_aux) << "rank " << world.rank();
      EXPECT_EQ(r.counts, result.counts) << "rank " << world.rank();
    }
  });
  return result;
}

// The single-rank layer on each whole micro-batch, fed the counts of the earlier ones; the gate
// gradient summed over the micro-batches. `objective` adds per-shard y terms: with shards > 0 the
// y part of the gradient comes from one layer per shard (the per-rank scope routes each shard on
// its own) and the loss's from the whole micro-batch, once per shard.
RankResult Reference(const moe::LayerConfig& config, const std::vector<Inputs>& micro,
                     int shards_per_rank_scope) {
  RankResult r;
  moe::LayerConfig no_loss = config, loss_alone = config;
  no_loss.aux_loss = moe::AuxLoss::kNone;  // each shard's y terms and z-loss
  loss_alone.z_loss_coef = 0.0f;           // the global loss, without the whole batch's z-loss
  const moe::MoeLayer whole(config), plain(no_loss), global_loss(loss_alone);
  moe::AuxCountsSoFar so_far;
  Tensor grad = Tensor::Zeros(micro[0].params.gate_weight.shape());
  auto add = [&](const Tensor& g, float scale) {
    for (int64_t i = 0; i < g.numel(); ++i) grad.data<float>()[i] += scale * g.data<float>()[i];
  };
  for (size_t mb = 0; mb < micro.size(); ++mb) {
    const Inputs& in = micro[mb];
    moe::ForwardOptions o;
    o.global_token_offset = static_cast<int64_t>(mb) * 1000;
    o.aux_counts_so_far = &so_far;
    const moe::LayerOutput out = whole.Forward(in.params, in.x, o);
    r.l_aux.push_back(out.l_aux);
    r.counts.push_back(out.aux_counts);
    if (shards_per_rank_scope == 0) {
      add(whole.Backward(in.params, out, in.dy).params.gate_weight, 1.0f);
    } else {
      // The loss alone (dy = 0), once per shard, plus each shard's own y terms.
      const moe::LayerOutput lo = global_loss.Forward(in.params, in.x, o);
      add(global_loss.Backward(in.params, lo, Tensor::Zeros(in.dy.shape())).params.gate_weight,
          static_cast<float>(shards_per_rank_scope));
      const int64_t share = in.x.size(0) / shards_per_rank_scope;
      for (int s = 0; s < shards_per_rank_scope; ++s) {
        moe::ForwardOptions so;
        so.global_token_offset = o.global_token_offset + s * share;
        const Tensor xs = in.x.Slice(s * share, (s + 1) * share);
        const moe::LayerOutput os = plain.Forward(in.params, xs, so);
        add(plain.Backward(in.params, os, in.dy.Slice(s * share, (s + 1) * share))
                .params.gate_weight,
            1.0f);
      }
    }
    if (so_far.counts.empty()) so_far.counts.assign(out.aux_counts.size(), 0.0);
    for (size_t e = 0; e < so_far.counts.size(); ++e) so_far.counts[e] += out.aux_counts[e];
    ++so_far.micro_batches;
  }
  r.gate_grad = grad;
  return r;
}

TEST(GlobalAuxLoss, EveryLayoutAndScopeEqualsTheWholeMicroBatch) {
  moe::LayerConfig config = SmallConfig(4, /*dropless=*/true);
  config.aux_loss = moe::AuxLoss::kGlobal;
  config.aux_loss_coef = 1.0f;  // the loss's gradient is a visible part of the gate's
  config.z_loss_coef = 0.1f;    // the per-rank scope keeps each shard's own z-loss
  std::vector<Inputs> micro = {MakeInputs(config, 16, 51), MakeInputs(config, 16, 52)};
  micro[1].params = micro[0].params;  // one set of parameters for the step
  struct Case {
    int world, ep;
    BatchScope scope;
    DispatchKind dispatch = DispatchKind::kAllToAll;
  };
  for (const Case& k :
       {Case{2, 2, BatchScope::kGlobal}, Case{4, 2, BatchScope::kGlobal},
        Case{4, 4, BatchScope::kGlobal}, Case{4, 4, BatchScope::kGlobal, DispatchKind::kAllToAllV},
        Case{4, 4, BatchScope::kGlobal, DispatchKind::kAllGather}, Case{2, 2, BatchScope::kPerRank},
        Case{4, 2, BatchScope::kPerRank},
        Case{4, 4, BatchScope::kPerRank, DispatchKind::kAllToAllV}}) {
    ParallelOptions o;
    o.mesh.world_size = k.world;
    o.mesh.ep = k.ep;
    o.batch_scope = k.scope;
    o.dispatch = k.dispatch;
    const std::string what = fmt::format("world {} ep {} {} {}", k.world, k.ep,
                                         BatchScopeName(k.scope), DispatchKindName(k.dispatch));
    const RankResult want = Reference(config, micro, k.scope == BatchScope::kPerRank ? k.world : 0);
    // The running mean matters: the second micro-batch's counts differ from the first's.
    ASSERT_EQ(want.counts.size(), 2u);
    EXPECT_NE(want.counts[0], want.counts[1]);
    const RankResult got = RunOnRanks(config, o, micro);
    ASSERT_EQ(got.l_aux.size(), 2u) << what;
    for (size_t mb = 0; mb < 2; ++mb) {
      EXPECT_NEAR(got.l_aux[mb], want.l_aux[mb], 1e-5 * want.l_aux[mb]) << what << " mb " << mb;
      EXPECT_EQ(got.counts[mb], want.counts[mb]) << what << " mb " << mb;
    }
    for (int64_t i = 0; i < want.gate_grad.numel(); ++i) {
      const float w = want.gate_grad.data<float>()[i];
      EXPECT_NEAR(got.gate_grad.data<float>()[i], w, 2e-5 + 2e-4 * std::abs(w))
          << what << " gate.weight " << i;
    }
  }
}

// Forced routes (replay) across ranks: each rank forces its own tokens' experts; the outputs and
// the gate gradient equal the single-rank layer forced to the same routes on the whole batch, in
// layouts that exchange tokens (with drops: capacity factor 1).
TEST(ForcedRoutes, EveryLayoutEqualsTheWholeBatch) {
  const moe::LayerConfig config = SmallConfig(4, /*dropless=*/false, 1.0f);
  const Inputs in = MakeInputs(config, 24, 61);
  const moe::MoeLayer whole(config);
  const moe::LayerOutput natural = whole.Forward(in.params, in.x);
  std::vector<int32_t> forced(natural.topk_idx.data<int32_t>(),
                              natural.topk_idx.data<int32_t>() + natural.topk_idx.numel());
  for (int32_t& e : forced) e = (e + 1) % 4;  // routes the gate would not choose
  moe::ForwardOptions fo;
  fo.forced_experts = forced;
  const moe::LayerOutput want = whole.Forward(in.params, in.x, fo);
  const moe::LayerGradients want_g = whole.Backward(in.params, want, in.dy);
  ASSERT_GT(want.dropped, 0);
  for (const auto& [world, ep] : {std::pair{2, 2}, std::pair{4, 4}, std::pair{4, 2}}) {
    ParallelOptions o;
    o.mesh.world_size = world;
    o.mesh.ep = ep;
    std::mutex mu;
    comm::RunInProcess(world, [&](comm::Communicator& comm) {
      ParallelMoeLayer layer(config, o, MakeLayerGroups(comm, config, o));
      const int64_t share = in.x.size(0) / layer.mesh().data_shards();
      const int64_t begin = layer.coords().token_shard * share;
      ParallelForwardOptions po;
      po.global_token_offset = begin;
      po.forced_experts = std::span<const int32_t>(forced).subspan(static_cast<size_t>(begin * 2),
                                                                   static_cast<size_t>(share * 2));
      const moe::LayerParams shard = layer.ShardParams(in.params);
      const ParallelOutput out = layer.Forward(shard, in.x.Slice(begin, begin + share), po);
      ParallelGradients g = layer.Backward(shard, out, in.dy.Slice(begin, begin + share), 1);
      layer.SyncGradients(&g.params, false, nullptr);
      std::lock_guard<std::mutex> lock(mu);
      const std::string what = fmt::format("world {} ep {} rank {}", world, ep, comm.rank());
      for (int64_t i = 0; i < share * config.model_dim; ++i) {
        const float w = want.y.data<float>()[begin * config.model_dim + i];
        EXPECT_NEAR(out.layer.y.data<float>()[i], w, 2e-5 + 2e-4 * std::abs(w)) << what;
      }
      for (int64_t i = 0; i < share * 2; ++i) {
        EXPECT_EQ(out.layer.topk_idx.data<int32_t>()[i], forced[static_cast<size_t>(begin * 2 + i)])
            << what;
      }
      for (int64_t i = 0; i < want_g.params.gate_weight.numel(); ++i) {
        const float w = want_g.params.gate_weight.data<float>()[i];
        EXPECT_NEAR(g.params.gate_weight.data<float>()[i], w, 2e-5 + 2e-4 * std::abs(w)) << what;
      }
    });
  }
}

}  // namespace
}  // namespace switchyard::parallel
