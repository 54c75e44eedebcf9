// The process mesh of expert parallelism (SPEC §2.1): which ranks exchange tokens, which hold the
// same experts, which hold the same tokens. Pure rank arithmetic; process_groups.h turns it into
// communicators.
//
// Two arrangements of the field:
//   DeepSpeed  the dense part is tensor parallel over `tp` consecutive ranks, whose members hold
//              identical tokens; the EP groups are built from the ranks with the same tp rank, in
//              chunks of `ep` (tp 2, 8 ranks, ep 4: EP groups [0,2,4,6], [1,3,5,7]); the ranks
//              holding the same experts form the expert-data-parallel (ep_dp) groups. With fewer
//              experts than `ep` (Tutel's sharded experts), each expert is split along H over
//              n = ep / E consecutive members of its EP group.
//   Megatron   "parallel folding": the MoE part has its own mesh expert-TP x EP x expert-DP with
//              expert-TP fastest (rank = (edp * ep + ep_rank) * etp + etp_rank), independent of
//              the dense tp x dp mesh. Dense tensor parallelism is sequence parallel, so every rank
//              holds tokens of its own. Each expert is split along H over the `etp` ranks.
// In both, the ranks that exchange tokens with each other form the "expert group" (DeepSpeed's EP
// group; Megatron's tp_ep group) of n * (number of expert positions) ranks; member m of it is
// expert position m / n (it holds experts [pos * E_l, (pos + 1) * E_l)) and H-shard m % n.
//
// Thread-safety: immutable after construction.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace switchyard::parallel {

enum class Arrangement : uint8_t { kDeepSpeed, kMegatron };
// "deepspeed", "megatron".
std::string_view ArrangementName(Arrangement arrangement);
// Inverse of ArrangementName; throws InvalidArgument naming the accepted names.
Arrangement ArrangementFromName(std::string_view name);

struct MeshConfig {
  int world_size = 1;
  int tp = 1;   // dense tensor-parallel degree
  int ep = 0;   // expert-parallel size; 0 = as large as possible (DeepSpeed: W / tp, Megatron:
                // W / etp)
  int etp = 1;  // expert tensor parallel (Megatron only; DeepSpeed derives the H split from E)
  Arrangement arrangement = Arrangement::kDeepSpeed;
};

enum class GroupKind : uint8_t {
  kTensor,          // dense tensor-parallel group (tp consecutive ranks)
  kData,            // dense data-parallel group: the ranks with the same tp rank
  kTokens,          // ranks whose tokens make up the global batch: gate and dense gradients are
                    // summed over it (DeepSpeed: = kData; Megatron, sequence parallel: the world)
  kExpert,          // the expert group: ranks exchanging tokens (DeepSpeed EP group, Megatron
                    // tp_ep group)
  kExpertParallel,  // Megatron's EP group: expert group members with the same etp rank
                    // (DeepSpeed: = kExpert)
  kExpertTensor,    // the n ranks holding the H-shards of the same experts (etp group)
  kExpertData,      // ranks holding the same expert shard with the same tp rank (ep_dp / edp)
  kExpertHolders,   // every rank holding the same expert shard (DeepSpeed: ep_dp x tp)
};
// "tp", "dp", "tokens", "expert", "ep", "etp", "ep_dp", "expert_holders".
std::string_view GroupKindName(GroupKind kind);

// Where one rank sits in the mesh.
struct RankCoords {
  int rank = 0;
  int tp_rank = 0;          // position in its kTensor group
  int token_shard = 0;      // which part of the global batch it holds (0 .. data_shards() - 1)
  int expert_group = 0;     // index of its kExpert group
  int expert_member = 0;    // position in its kExpert group
  int expert_position = 0;  // expert_member / n: holds experts [pos * E_l, (pos + 1) * E_l)
  int expert_shard = 0;     // expert_member % n: H-shard index
  int expert_replica = 0;   // position in its kExpertData group
};

class Mesh {
 public:
  // Validates the config against the experts: throws InvalidArgument naming what does not divide
  // what (e.g. "num_experts 7 is not divisible by ep 2: every EP rank must hold the same number
  // of experts").
  Mesh(const MeshConfig& config, int64_t num_experts, int64_t hidden_dim);

  const MeshConfig& config() const { return config_; }
  int world_size() const { return config_.world_size; }
  Arrangement arrangement() const { return config_.arrangement; }
  int tp() const { return config_.tp; }
  int ep() const { return ep_; }  // resolved (never 0)
  int64_t num_experts() const { return num_experts_; }
  int64_t hidden_dim() const { return hidden_dim_; }

  // Ranks in one expert group (P).
  int expert_group_size() const { return expert_group_size_; }
  // H-shards per expert (n): etp (Megatron) or max(1, ep / E) (DeepSpeed).
  int shards() const { return shards_; }
  // Expert positions per expert group (P / n).
  int positions() const { return expert_group_size_ / shards_; }
  // Experts held per position (E_l).
  int64_t local_experts() const { return num_experts_ / positions(); }
  // Distinct token shards (DeepSpeed: W / tp; Megatron: W).
  int data_shards() const;
  // True when tp ranks hold identical tokens (DeepSpeed arrangement with tp > 1).
  bool tp_duplicates_tokens() const {
    return config_.arrangement == Arrangement::kDeepSpeed && config_.tp > 1;
  }

  RankCoords Coords(int rank) const;
  // Every group of a kind, each listing world ranks in group-rank order; groups in order of their
  // smallest rank.
  std::vector<std::vector<int>> Groups(GroupKind kind) const;
  // The group of `kind` that contains `rank`, in group-rank order.
  std::vector<int> GroupOf(GroupKind kind, int rank) const;
  // The kinds that describe this arrangement (for printing).
  std::vector<GroupKind> DescribedKinds() const;

  // A multi-line human-readable listing of the groups (`switchyard groups`).
  std::string Describe() const;

 private:
  // Color and key of `rank` in its group of `kind` (ranks with the same color form a group,
  // ordered by key).
  void ColorKey(GroupKind kind, int rank, int* color, int* key) const;

  MeshConfig config_;
  int64_t num_experts_ = 0;
  int64_t hidden_dim_ = 0;
  int ep_ = 1;
  int expert_group_size_ = 1;
  int shards_ = 1;
};

}  // namespace switchyard::parallel
