// The process mesh: where every rank sits along the five dimensions of parallel training, and
// which ranks form the groups that talk to each other. Pure rank arithmetic, testable without
// threads; process_groups.h turns it into communicators. docs/parallel.md ("The mesh") has the
// rules with a worked example.
//
// The dense mesh: tp x cp x dp x pp = world.
//   tp  tensor parallel: the ranks splitting each dense weight. Sequence parallel is a mode of it
//       (MeshConfig::sequence_parallel): the activations outside the tensor-parallel regions are
//       split along the sequence over the tp ranks, so each tp rank holds tokens of its own.
//   cp  context parallel: the ranks splitting each sequence into chunks.
//   dp  data parallel (derived: world / (tp * cp * pp)): the replicas.
//   pp  pipeline parallel: the stages, each holding a contiguous part of the layers.
// A rank's coordinates come from its number read in mixed radix along the order string
// (MeshConfig::order, Megatron-Core's convention): the first name varies fastest. The default
// "tp-cp-ep-dp-pp" puts tensor-parallel ranks next to each other and pipeline stages farthest
// apart. An order names each of tp, cp, ep, dp, pp at most once, separated by '-'; a dimension
// left out must have size 1 (it is then appended).
//
// The MoE part has its own mesh on the ranks of each pipeline stage, in one of two arrangements:
//   DeepSpeed  EP groups inside the dense data-parallel ranks: the ranks with the same tp rank and
//              stage (the dp-cp group, tp ranks holding identical tokens) are cut into EP groups
//              of `ep` consecutive members (tp 2, 8 ranks, ep 4: [0,2,4,6], [1,3,5,7]); the ranks
//              holding the same experts form the expert-data-parallel (ep_dp) groups. Each expert
//              may be split along H over n = etp consecutive members of its EP group (Tutel's
//              sharded experts; the MoE layer sets etp = ep / E when it has fewer experts than
//              ep, expert_shard.h's ExpertMeshConfig). The ep position of the order is not used.
//   Megatron   "parallel folding": expert-TP x EP x expert-DP x pp, read along the same order
//              string with etp in tp's place, edp (= world / (etp * ep * pp)) in dp's and cp of
//              size 1, independent of the dense tp x cp x dp (default order: rank =
//              ((stage * edp + edp_rank) * ep + ep_rank) * etp + etp_rank).
//              Dense tensor parallelism is sequence parallel, so every rank holds tokens of its
//              own. Each expert is split along H over the `etp` ranks. Both meshes must give the
//              same pipeline groups (true whenever pp is last in the order).
// In both, the ranks that exchange tokens with each other form the "expert group" (DeepSpeed's EP
// group; Megatron's tp_ep group) of n * (number of expert positions) ranks; member m of it is
// expert position m / n and H-shard m % n. The mesh knows only these degrees: which experts a
// position holds and how wide an H-shard is belong to the MoE layer (expert_shard.h).
//
// Thread-safety: immutable after construction.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace switchyard::parallel {

enum class Arrangement : uint8_t { kDeepSpeed, kMegatron };
// "deepspeed", "megatron".
std::string_view ArrangementName(Arrangement arrangement);
// Inverse of ArrangementName; throws InvalidArgument naming the accepted names.
Arrangement ArrangementFromName(std::string_view name);

// The default rank order (first = fastest-varying).
inline constexpr std::string_view kDefaultMeshOrder = "tp-cp-ep-dp-pp";

struct MeshConfig {
  int world_size = 1;
  int tp = 1;  // dense tensor-parallel degree
  int pp = 1;  // pipeline stages
  int cp = 1;  // context-parallel degree
  int ep = 0;  // expert-parallel size; 0 = as large as possible (ResolvedExpertParallel)
  // The experts of an MoE layer, for the default ep (ep 0); 0: not considered.
  int64_t num_experts = 0;
  int etp = 1;  // H-shards per expert: Megatron's expert tensor parallel; DeepSpeed: members of an
                // EP group splitting each expert (a divisor of ep; see ExpertMeshConfig)
  Arrangement arrangement = Arrangement::kDeepSpeed;
  // Sequence parallel as the mode of tp; unset = the arrangement's (DeepSpeed: off, its tp ranks
  // hold identical tokens; Megatron: on). Each arrangement accepts only its own mode when tp > 1.
  std::optional<bool> sequence_parallel;
  std::string order = std::string(kDefaultMeshOrder);
};

// The expert-parallel size of `config`: its `ep`, or for 0 as large as the arrangement allows
// (DeepSpeed: world / (tp * pp), the dp * cp ranks of each tp rank and stage; Megatron:
// world / (etp * pp)), at least 1 -- unless `num_experts` is set and neither it nor that size
// divides the other: then the largest ep dividing both (their gcd; 6 experts on 4 ranks: ep 2).
// When one divides the other the largest size stays (fewer experts than EP ranks: each expert
// split over ep / num_experts ranks). The one place of this default (train's ResolveLayout and
// the mesh use it).
int ResolvedExpertParallel(const MeshConfig& config);

enum class GroupKind : uint8_t {
  kTensor,          // dense tensor-parallel group ("tp")
  kData,            // dense data-parallel group: same tp, cp rank and stage ("dp")
  kTokens,          // ranks of a stage whose tokens make up the global batch: gate and dense
                    // gradients are summed over it (DeepSpeed: = dp_cp; Megatron: tp_cp x dp)
  kExpert,          // the expert group: ranks exchanging tokens (DeepSpeed EP group, Megatron
                    // tp_ep group)
  kExpertParallel,  // Megatron's EP group: expert group members with the same etp rank
                    // (DeepSpeed: = kExpert)
  kExpertTensor,    // the n ranks holding the H-shards of the same experts (etp group)
  kExpertData,      // ranks holding the same expert shard with the same tp rank (ep_dp / edp)
  kExpertHolders,   // every rank of a stage holding the same expert shard (DeepSpeed: ep_dp x tp)
  kPipeline,        // the pp stages of one model replica, in stage order ("pp")
  kContext,         // the cp ranks sharing sequences ("cp")
  kTensorContext,   // tp x cp ("tp_cp")
  kDataContext,     // dp x cp: where dense gradients are reduced ("dp_cp")
  kModel,           // tp x pp: one model replica's ranks ("mp")
  kEmbedding,       // first and last stage of each pipeline group, for tied embeddings; with pp 1
                    // each rank alone. Ranks of middle stages are in no embedding group.
};
// "tp", "dp", "tokens", "expert", "ep", "etp", "ep_dp", "expert_holders", "pp", "cp", "tp_cp",
// "dp_cp", "mp", "embedding".
std::string_view GroupKindName(GroupKind kind);
// Every kind, in declaration order.
inline constexpr std::array<GroupKind, 14> kAllGroupKinds = {
    GroupKind::kTensor,     GroupKind::kData,           GroupKind::kTokens,
    GroupKind::kExpert,     GroupKind::kExpertParallel, GroupKind::kExpertTensor,
    GroupKind::kExpertData, GroupKind::kExpertHolders,  GroupKind::kPipeline,
    GroupKind::kContext,    GroupKind::kTensorContext,  GroupKind::kDataContext,
    GroupKind::kModel,      GroupKind::kEmbedding};

// Where one rank sits in the mesh.
struct RankCoords {
  int rank = 0;
  int tp_rank = 0;          // position in its kTensor group
  int token_shard = 0;      // which part of its stage's batch it holds (0 .. data_shards() - 1)
  int expert_group = 0;     // index of its kExpert group
  int expert_member = 0;    // position in its kExpert group
  int expert_position = 0;  // expert_member / n (holds experts [pos * E_l, (pos + 1) * E_l))
  int expert_shard = 0;     // expert_member % n: H-shard index
  int expert_replica = 0;   // position in its kExpertData group
  int cp_rank = 0;          // position in its kContext group
  int dp_rank = 0;          // position in its kData group
  int pp_rank = 0;          // pipeline stage
};

class Mesh {
 public:
  // Validates the degrees: throws InvalidArgument naming the constraint that fails (e.g. "world
  // 12 is not divisible by tp 2 × pp 4 × cp 1"). Whether a layer's experts fit is the layer's
  // check (expert_shard.h, CheckExpertsFit).
  explicit Mesh(const MeshConfig& config);

  const MeshConfig& config() const { return config_; }
  int world_size() const { return config_.world_size; }
  Arrangement arrangement() const { return config_.arrangement; }
  int tp() const { return config_.tp; }
  int pp() const { return config_.pp; }
  int cp() const { return config_.cp; }
  int dp() const { return dp_; }           // world / (tp * cp * pp)
  int ep() const { return ep_; }           // resolved (never 0)
  int etp() const { return config_.etp; }  // = shards()
  // Megatron: world / (etp * ep * pp); DeepSpeed: the EP groups per tp rank and stage.
  int edp() const;
  bool sequence_parallel() const { return sequence_parallel_; }
  // The order in use: all five names (left-out ones appended).
  const std::string& order() const { return order_; }
  // Ranks in one expert group (P).
  int expert_group_size() const { return expert_group_size_; }
  // H-shards per expert (n): etp.
  int shards() const { return shards_; }
  // Expert positions per expert group (P / n); a layer's E experts split evenly over them.
  int positions() const { return expert_group_size_ / shards_; }
  // Distinct token shards of one stage: dp * cp, times tp with sequence parallel.
  int data_shards() const;
  // True when tp ranks hold identical tokens (tp > 1 without sequence parallel).
  bool tp_duplicates_tokens() const { return config_.tp > 1 && !sequence_parallel_; }
  // True when `other` has the same groups of every kind, arrangement, sequence-parallel mode and
  // H-shards per expert (orders that differ only in dimensions of size 1 are the same layout).
  bool SameLayout(const Mesh& other) const;

  RankCoords Coords(int rank) const;
  // Every group of a kind, each listing world ranks in group-rank order; groups in order of their
  // smallest rank. Every rank is in exactly one group of each kind, except kEmbedding.
  std::vector<std::vector<int>> Groups(GroupKind kind) const;
  // The group of `kind` that contains `rank`, in group-rank order; empty if it is in none (only
  // kEmbedding: a middle pipeline stage).
  std::vector<int> GroupOf(GroupKind kind, int rank) const;
  // The kinds that describe this layout (for printing): the dense ones whose size is above 1 or
  // that the layout relies on, then the MoE part's.
  std::vector<GroupKind> DescribedKinds() const;

  // A multi-line human-readable listing of the groups (`switchyard groups`).
  std::string Describe() const;

 private:
  // Color and key of `rank` in its group of `kind` (ranks with the same color form a group,
  // ordered by key). color -1: in no group of that kind.
  void ColorKey(GroupKind kind, int rank, int* color, int* key) const;

  MeshConfig config_;
  int dp_ = 1;
  int ep_ = 1;
  int expert_group_size_ = 1;
  int shards_ = 1;
  bool sequence_parallel_ = false;
  std::string order_;
  // Dimension sizes in order positions, of the dense and of the expert mesh.
  std::array<int, 5> dense_sizes_{};
  std::array<int, 5> expert_sizes_{};
  std::array<uint8_t, 5> order_dims_{};  // the dimension at each position (0..4: tp cp ep dp pp)
};

}  // namespace switchyard::parallel
