// The expert parameters one rank holds (its "shard"), and the conversions between shards and the
// full [E, ...] tensors of moe::LayerParams.
//
// A member of an expert group at position q and H-shard i (mesh.h) holds, for its E_l experts
// [q * E_l, (q + 1) * E_l) and with Hs = H / n:
//   fc1_weight [E_l, Hs, M]   rows i * Hs .. of each expert's fc1 (column-parallel)
//   fc1_bias   [E_l, Hs]
//   fc3_weight [E_l, Hs, M]   (gated)
//   fc2_weight [E_l, M, Hs]   columns i * Hs .. of each expert's fc2 (row-parallel)
//   fc2_bias   [E_l, Mc]      columns i * Mc .. of each expert's fc2 bias, Mc = ceil(M / n), zero
//                             padded past M (Tutel's ZeRO-sharded fc2 bias)
// With n = 1 this is simply the rank's E_l experts. The same shard serves every adaptive r
// (docs/parallel.md), so r can change between steps without moving parameters.
#pragma once

#include <cstdint>

#include "switchyard/moe/experts.h"
#include "switchyard/parallel/mesh.h"

namespace switchyard::parallel {

struct ShardSpec {
  int64_t num_experts = 0;                                                  // E
  int64_t local_experts = 0;                                                // E_l
  int64_t first_expert = 0;                                                 // q * E_l
  int64_t model_dim = 0;                                                    // M
  int64_t hidden_dim = 0;                                                   // H
  int shards = 1;                                                           // n
  int shard = 0;                                                            // i
  int64_t shard_hidden() const { return hidden_dim / shards; }              // Hs
  int64_t bias_chunk() const { return (model_dim + shards - 1) / shards; }  // Mc
};

// The shard of world rank `rank`.
ShardSpec ShardOf(const Mesh& mesh, int rank, int64_t model_dim);

// Copies the rank's shard out of full expert weights ([E, H, M] ...). Undefined stays undefined.
moe::ExpertWeights ShardExperts(const moe::ExpertWeights& full, const ShardSpec& spec);

// Writes a shard into full expert weights (which must be allocated with the full shapes).
void PlaceShard(const moe::ExpertWeights& shard, const ShardSpec& spec, moe::ExpertWeights* full);

// Checks a shard's shapes; throws InvalidArgument naming the tensor and both shapes.
void CheckShard(const moe::ExpertWeights& shard, const ShardSpec& spec, bool gated, bool bias);

}  // namespace switchyard::parallel
