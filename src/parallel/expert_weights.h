// The expert weights a rank computes with under Tutel's adaptive r (docs/parallel.md, "Tutel's
// adaptive r"), gathered from the shards of expert_shard.h, and the way back for their gradients.
// Private to src/parallel.
//
//   r = 0   every rank gathers the full weights of all E experts over its expert group (ZeRO-3
//           style); gradients are reduce-scattered back to the shards.
//   r >= 1  (r divides n) the n H-shards of an expert form r parts of H / r; the g = n / r
//           consecutive shards of part j = shard / g gather it. fc2's bias is gathered over the n
//           shards and scaled by 1 / r, so the r partial outputs of a token add up to one bias.
//           Gradients go back by reduce-scatter over the same groups.
#pragma once

#include "switchyard/moe/experts.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/parallel/expert_shard.h"
#include "switchyard/parallel/process_groups.h"

namespace switchyard::parallel::internal {

// r = 0: [E, H, M] ...; r >= 1: [E_l, H / r, M] ..., fc2_bias [E_l, M].
moe::ExpertWeights GatherComputeWeights(ProcessGroups& groups, const moe::ExpertWeights& shard,
                                        const ShardSpec& spec, int r, CommStats* stats);

// Gradients of the weights GatherComputeWeights returned -> this rank's part of the gradients of
// its shard, summed over the ranks that computed with it (shapes of the shard).
moe::ExpertWeights ReduceComputeGrads(ProcessGroups& groups, const moe::ExpertWeights& grads,
                                      const ShardSpec& spec, int r, CommStats* stats);

}  // namespace switchyard::parallel::internal
