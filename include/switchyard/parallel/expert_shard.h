// The expert parameters one rank holds (its "shard"), and the conversions between shards and the
// full [E, ...] tensors of moe::LayerParams. Expert sharding is the MoE layer's: the mesh knows
// only the degrees (expert positions, H-shards per expert); which experts a position holds and
// where an H-shard starts come from the layer's sizes here.
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
#include <string>

#include "switchyard/moe/config.h"
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

// The mesh degrees for a layer of `num_experts` experts: the DeepSpeed arrangement with fewer
// experts than EP ranks splits each expert along H over etp = ep / E members of its EP group
// (Tutel's sharded experts; etp 1 otherwise); Megatron's etp is given. InvalidArgument when the
// experts cannot split so ("ep 6 is not a multiple of num_experts 4 ..."; a DeepSpeed etp other
// than 1 or that ep / E).
MeshConfig ExpertMeshConfig(MeshConfig mesh, int64_t num_experts);
// Whether `num_experts` experts of `hidden_dim` split over `mesh`: the same number of experts at
// every expert position, whole H-shards, and for DeepSpeed the H-shards ExpertMeshConfig derives.
// InvalidArgument naming the constraint ("num_experts 7 is not divisible by ep 2 ...").
void CheckExpertsFit(const Mesh& mesh, int64_t num_experts, int64_t hidden_dim);
// ExpertMeshConfig, the mesh, CheckExpertsFit: the mesh of a layer with these experts.
Mesh ExpertMesh(const MeshConfig& mesh, int64_t num_experts, int64_t hidden_dim);
// Experts held per expert position (E_l = E / positions; the experts must fit).
int64_t LocalExperts(const Mesh& mesh, int64_t num_experts);
// The shard of world rank `rank` for a layer of `config`'s sizes (num_experts, hidden_dim,
// model_dim), which must fit the mesh.
ShardSpec ShardOf(const Mesh& mesh, int rank, const moe::LayerConfig& config);
// The experts and H-shard of every expert-group member, one line ("experts of each expert-group
// member ...: 0:e0-1 1:e2-3 ..."; `switchyard groups`).
std::string DescribeExperts(const Mesh& mesh, int64_t num_experts);

// Copies the rank's shard out of full expert weights ([E, H, M] ...). Undefined stays undefined.
moe::ExpertWeights ShardExperts(const moe::ExpertWeights& full, const ShardSpec& spec);

// Writes a shard into full expert weights (which must be allocated with the full shapes).
void PlaceShard(const moe::ExpertWeights& shard, const ShardSpec& spec, moe::ExpertWeights* full);

// Checks a shard's shapes; throws InvalidArgument naming the tensor and both shapes.
void CheckShard(const moe::ExpertWeights& shard, const ShardSpec& spec, bool gated, bool bias);

}  // namespace switchyard::parallel
