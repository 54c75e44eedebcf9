// The MoE layer across ranks: expert parallelism in the layouts of DeepSpeed-MoE, Tutel,
// FastMoE/MegaBlocks and Megatron-Core, with forward and backward mirroring moe::MoeLayer
// (docs/parallel.md).
//
// Each rank holds its own tokens x [T_rank, M], the gate (replicated) and its shard of the experts
// (expert_shard.h). The layer uses the run's shared process groups (process_groups.h; build them
// once with MakeLayerGroups) and splits no communicator of its own. A step reads
//   gate -> route -> dispatcher -> experts -> combine
//   gate        moe::GateForward on the rank's own tokens (noise and random routing only in a
//               training call, ParallelForwardOptions::training)
//   route       capacity, slot order and drops (batch scope below), then the plan of the rank's
//               kept rows in the buffer layout its dispatcher asks for
//   dispatcher  moves the kept rows to the ranks holding their experts, runs the experts there and
//               brings the outputs back; the combine weights the plan's outputs into y [T, M]
// Backward runs the same dispatcher backwards through the step's handle, then the gate.
//
// Dispatchers (private, src/parallel/dispatcher.h): one interface, each owning its state.
//   exchange    ParallelOptions::dispatch kAllToAll (fixed capacity, Tutel/DeepSpeed: the buffer
//               [E, C, M] is [P, E_l, C, M] on the wire, optionally the 2DH all-to-all) or
//               kAllToAllV (FastMoE/MegaBlocks/Megatron: counts, then exactly the kept rows).
//               Pipelined when asked, with the same results as the plain path:
//                 overlap_degree D  Tutel's a2a-FFN overlap: the transfer is cut into D chunks;
//                                   while the experts compute chunk i, chunk i + 1 travels to them
//                                   and chunk i - 1 travels back.
//                 smart_group g     FasterMoE's smart schedule: pair-wise exchange between groups
//                                   of g ranks of the expert group, pipelined as above.
//                 shadow            FasterMoE's shadow experts: hot experts' parameters are
//                                   broadcast and every rank computes its own rows of them; their
//                                   gradients are reduced back to the owner (unsharded experts).
//   allgather   kAllGather, Megatron's allgather dispatcher: tokens and routing all-gathered over
//               the expert group, partial outputs reduce-scattered back.
//   local       the steps with Tutel's adaptive r = 0: every rank gathers the weights of all
//               experts and computes its own rows (no token exchange).
// Every rank joins every collective, also with zero tokens. A Tracer (trace.h) set with set_tracer
// records gate, encode, each chunk's send / experts / return, decode and every collective with its
// bytes.
//
// Batch scope (docs/parallel.md, "Batch scope"):
//   kGlobal   capacity, slot order, drops and the losses are those of the global batch (its tokens
//             in global token order: ParallelForwardOptions::token_index, or the ranks' offsets):
//             outputs, l_aux and gradients equal moe::MoeLayer on the whole batch (up to float
//             summation order), however the ranks hold the tokens.
//   kPerRank  Tutel's and DeepSpeed's default: capacity, slots and l_aux from each token shard's
//             own tokens; equal to one moe::MoeLayer per shard (capacity_factor <= 0 takes the
//             largest load over the expert group), parameter gradients summed. The ranks of a
//             context-parallel group hold one shard together (parts of the same sequences): they
//             route it as one batch, in global token order.
// aux_loss global is the loss of the micro-batch on every rank of the stage (the token group) in
// both scopes; in kPerRank each shard's objective holds it whole (the shards' gradients, summed,
// hold it once per shard, as the mean over the shards that training takes holds it once).
//
// Backward returns this rank's contribution to the gradients; SyncGradients sums expert
// gradients over the ranks holding the same shard and gate gradients over the token shards, after
// which every rank holds the gradient of the whole batch's objective (kSum), as moe::MoeLayer on
// the whole batch would report it for the rank's parameters.
//
// Thread-safety: one ParallelMoeLayer per rank thread (several layers may share its groups); its
// calls are collective over the rank's groups and must be made in the same order on every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/parallel/expert_shard.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/process_groups.h"
#include "switchyard/parallel/schedule.h"
#include "switchyard/parallel/trace.h"

namespace switchyard::parallel {

namespace internal {
class Dispatcher;  // src/parallel/dispatcher.h
}  // namespace internal

enum class DispatchKind : uint8_t { kAllToAll, kAllToAllV, kAllGather };
// "alltoall", "alltoallv", "allgather".
std::string_view DispatchKindName(DispatchKind kind);
DispatchKind DispatchKindFromName(std::string_view name);

enum class BatchScope : uint8_t { kGlobal, kPerRank };
// "global", "per_rank".
std::string_view BatchScopeName(BatchScope scope);
BatchScope BatchScopeFromName(std::string_view name);

// Tutel's adaptive r (docs/parallel.md): 0 (ZeRO-style DP of the experts) or a divisor of the
// H-shards n.
inline constexpr int kAdaptiveRDefault = -1;  // Megatron: r = n (EP+MP); otherwise r = 1
inline constexpr int kAdaptiveRAuto = -2;     // the cheapest by PredictedVolume
// "auto", "default" or an integer >= 0.
int AdaptiveRFromString(std::string_view text);

struct ParallelOptions {
  MeshConfig mesh;
  DispatchKind dispatch = DispatchKind::kAllToAll;
  int adaptive_r = kAdaptiveRDefault;
  // > 0: hierarchical (2DH) all-to-all with this many ranks per node (kAllToAll only; must divide
  // the expert group size).
  int hierarchical_ranks_per_node = 0;
  // DeepSpeed's TP de-duplication: with the DeepSpeed arrangement and tp > 1 (tp ranks hold the
  // same tokens), each tp rank sends only its 1 / tp share of every expert's rows and an
  // all-gather over tp restores the rest before the combine. Applies to kAllToAll / kAllToAllV.
  bool tp_dedup = true;
  BatchScope batch_scope = BatchScope::kGlobal;
  // Tutel's a2a-FFN overlap degree D >= 1 (kAllToAll / kAllToAllV; nothing to overlap with r = 0
  // and kAllGather, which reject D > 1). Fixed capacity rounds the rows per expert on the wire up
  // to a multiple of D (padding only: capacity and results do not change).
  int overlap_degree = 1;
  // FasterMoE's smart schedule: kSmartOff, a group size g dividing the expert group size, or
  // kSmartAuto (g from the cost model). kAllToAll / kAllToAllV; not with 2DH.
  int smart_group = kSmartOff;
  // FasterMoE's shadow experts (kAllToAll / kAllToAllV, unsharded experts, no TP de-duplication).
  ShadowOptions shadow;
  // DeepSeek-V3 / DeepEP's dispatch for kAllToAllV: a token travels once per destination rank
  // (with its choices there), the destination combines its experts' outputs locally and returns
  // one row per (token, rank), so limiting a token to fewer ranks (group-limited routing) cuts
  // the token bytes. Same results up to float summation order. Applies when the experts are
  // unsharded, without TP de-duplication, overlap degree 1, no smart schedule and no shadowed
  // experts in the step; otherwise (and when false) one row travels per kept (token, choice).
  bool dispatch_dedup = true;
  // For kSmartAuto and shadow auto; zero fields are measured on first use (collective).
  CostModel cost_model;
};

// Tutel's communication volume per step (elements), for r = 0 (2 P) and r >= 1
// (4 C_g r + 2 P / (E r)), with C_g the capacity volume E * C * M of one rank and P the expert
// parameter count of the layer.
double PredictedVolume(int r, double capacity_volume, double expert_params, int64_t num_experts);
// The r that minimises PredictedVolume over 0 and the divisors of `shards`.
int ChooseAdaptiveR(int shards, double capacity_volume, double expert_params, int64_t num_experts);

struct ParallelForwardOptions {
  int64_t global_token_offset = 0;  // global index of this rank's first token (keys random draws)
  uint64_t step = 0;
  int adaptive_r = kAdaptiveRDefault;  // kAdaptiveRDefault: the layer's option
  int threads = 1;
  bool save_for_backward = true;
  // As moe::ForwardOptions::training: false (evaluation) turns gate noise and random routing off.
  bool training = true;
  // [T] the global index of each of this rank's tokens, as moe::ForwardOptions::token_index: for
  // ranks whose tokens are not a contiguous range of the batch (context parallelism). Routing
  // visits the batch in global order and keys every draw by it. Empty: global_token_offset + t.
  std::span<const int64_t> token_index = {};
  // aux_loss global: as moe::ForwardOptions::aux_counts_so_far (the counts the layer returned in
  // LayerOutput::aux_counts for the step's earlier micro-batches, already over every rank).
  const moe::AuxCountsSoFar* aux_counts_so_far = nullptr;
  bool entropy = false;  // as moe::ForwardOptions::entropy (this rank's tokens)
  // [T, k] replay for this rank's tokens, as moe::ForwardOptions::forced_experts.
  std::span<const int32_t> forced_experts = {};
};

struct ParallelState;  // what the backward needs (opaque)

struct ParallelOutput {
  // As moe::LayerOutput, for this rank's tokens: y [T, M] (x's dtype), routing [T, k]. In the
  // global scope l_aux / z_loss are the whole batch's, capacity and locations the global
  // ones; expert_loads / expert_counts / dropped count this rank's (token, choice) pairs.
  moe::LayerOutput layer;
  int adaptive_r = 1;             // r used
  double predicted_volume = 0;    // PredictedVolume for that r (elements per step)
  int64_t buffer_capacity = 0;    // rows per expert per source on the wire (kAllToAll)
  int overlap_degree = 1;         // D used
  int smart_group = 0;            // g used (0: no smart schedule)
  std::vector<int64_t> shadowed;  // experts shadowed in this step
  CommStats stats;                // of this forward
  std::shared_ptr<const ParallelState> state;
};

struct ParallelGradients {
  Tensor x;                 // [T, M], x's dtype
  moe::LayerParams params;  // gate_weight [E, M]; experts: this rank's shard
  CommStats stats;
};

// The mesh that `options` ask for with `config`'s experts on a world of `world_size` ranks
// (options.mesh.world_size 0 or 1 means `world_size`): expert_shard.h's ExpertMesh, which derives
// the DeepSpeed H-shards from the experts. Throws InvalidArgument as Mesh and CheckExpertsFit do.
Mesh LayerMesh(const moe::LayerConfig& config, const ParallelOptions& options, int world_size);
// The process groups of that mesh over `world`: collective over `world`, which must outlive them.
// Build them once per run and share them between every layer with the same mesh.
std::shared_ptr<ProcessGroups> MakeLayerGroups(comm::Communicator& world,
                                               const moe::LayerConfig& config,
                                               const ParallelOptions& options);

class ParallelMoeLayer {
 public:
  // Validates config and options (InvalidArgument, e.g. a number of experts that the EP size does
  // not divide) and checks that `groups` were built for the mesh the options ask for (the same
  // world, tp, ep, etp, arrangement and H-shards per expert). Not collective: the layer uses the
  // shared groups and splits no communicator of its own (except Tutel's adaptive-r subgroups,
  // which ProcessGroups splits once on first use).
  ParallelMoeLayer(moe::LayerConfig config, ParallelOptions options,
                   std::shared_ptr<ProcessGroups> groups);
  ~ParallelMoeLayer();

  const moe::LayerConfig& config() const { return config_; }
  const ParallelOptions& options() const { return options_; }
  // The layer's own mesh (its expert count); the groups' mesh has the same groups.
  const Mesh& mesh() const { return mesh_; }
  const RankCoords& coords() const { return coords_; }
  const ShardSpec& shard_spec() const { return spec_; }
  ProcessGroups& groups() { return *groups_; }

  // Records the following calls' events into `tracer` (null: none). The tracer must outlive them.
  void set_tracer(Tracer* tracer) { tracer_ = tracer; }
  Tracer* tracer() const { return tracer_; }
  // The cost model the schedules use (measured fields filled after first use).
  const CostModel& cost_model() const;

  // This rank's parameters out of the full ones: gate (shared storage) and its expert shard.
  moe::LayerParams ShardParams(const moe::LayerParams& full) const;

  // x [T, M] float32 or bfloat16; params from ShardParams. Collective.
  ParallelOutput Forward(const moe::LayerParams& params, const Tensor& x,
                         const ParallelForwardOptions& options = {});

  // Gradients of this rank's share of sum(y * dy) + aux_loss_coef * l_aux + z_loss_coef * z_loss
  // (global scope: of the whole batch's losses). dy [T, M]. aux_loss hf_concat: `concat_total`
  // as in moe::MoeLayer::Backward (the concatenation's sums, over the batch's ranks). Collective.
  ParallelGradients Backward(const moe::LayerParams& params, const ParallelOutput& forward,
                             const Tensor& dy, int threads = 1,
                             const moe::RouterLoadSums* concat_total = nullptr);

  // Sums gradients over the ranks that share each parameter (see the top). mean = true divides
  // by the number of token shards (data-parallel averaging). Collective.
  void SyncGradients(moe::LayerParams* grads, bool mean = false, CommStats* stats = nullptr);

  // Routed (token, choice) pairs per expert over the whole batch (summed over the token shards),
  // for the aux-loss-free expert-bias update (moe::UpdateExpertBias). Collective over the token
  // group.
  std::vector<int64_t> BatchExpertLoads(const ParallelOutput& forward, CommStats* stats = nullptr);

  // The adaptive r a forward would use (resolves kAdaptiveRDefault; kAdaptiveRAuto needs the
  // capacity volume, see PredictedVolume).
  int ResolveAdaptiveR(int requested, double capacity_volume) const;

 private:
  moe::LayerConfig config_;
  ParallelOptions options_;
  std::shared_ptr<ProcessGroups> groups_;
  Mesh mesh_;
  RankCoords coords_;
  ShardSpec spec_;
  bool dedup_ = false;  // TP de-duplication active
  Tracer* tracer_ = nullptr;
  std::unique_ptr<internal::Dispatcher> dispatcher_;  // the options' dispatcher
  std::unique_ptr<internal::Dispatcher> local_;       // steps with adaptive r = 0
};

}  // namespace switchyard::parallel
