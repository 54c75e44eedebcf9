// Distributed training: the trainer of trainer.h on W ranks, with expert parallelism for the MoE
// blocks (parallel::ParallelMoeLayer), data parallelism for everything else and ZeRO stage 0-3
// (zero.h) for the optimizer.
//
// Layout (TrainConfig: ranks, ep, zero_stage, dispatch, tp, sequence_parallel, arrangement, etp).
// The dense layers split over tp ranks (tensor_parallel.h, model.h) and the global batch by rows
// over the ranks / tp data-parallel ranks; each MoE block's experts over expert groups of `ep`
// ranks (E_l = E / ep experts per rank; with E < ep each expert's hidden dimension is split too,
// expert_shard.h), in DeepSpeed's arrangement (expert groups inside the data-parallel ranks of each
// tp rank) or Megatron's (folded over all ranks, sequence-parallel tokens). Capacity, slot order
// and the load-balancing losses are those of the global batch (BatchScope::kGlobal), so a W-rank
// run computes the single-rank run's losses and gradients up to float summation order.
//
// Gradients (every parameter's gradient is that of the global objective
// mean-over-all-tokens cross-entropy + the MoE blocks' loss terms): each rank differentiates its
// own rows' mean cross-entropy and D times its share of the MoE loss terms (D = the number of
// data shards = ranks / tp), then every gradient is summed over the ranks holding that parameter
// (DistributedHooks says which) and divided by D. This equals the single-rank gradient when every
// data shard holds the same number of counted target tokens (batch_size a multiple of D), as with
// PyTorch DDP.
//
// Checkpoints are layout-independent: the writer (world rank 0) saves full tensors with experts
// [E, ...] by global expert id, tensor-parallel shards gathered, and the full optimizer state, so
// a run saved with one (ranks, ep, zero_stage, tp, ...) resumes under any other: resuming with
// another layout is how a run is resharded (there is no separate conversion step).
//
// Ranks come from a comm::Launcher chosen by the program (threads of this process or MPI
// processes).
//
// Thread-safety: one RankTrainer per rank thread; its calls are collective over the world.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/launcher.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/train/aux_counts.h"
#include "switchyard/train/config.h"
#include "switchyard/train/trainer.h"
#include "switchyard/train/zero.h"

namespace switchyard::train {

class ShardedAdamW;
struct ZeroOptions;
namespace internal {
class StepTrace;  // src/train/step_trace.h
}  // namespace internal

// The parallel options of a config's MoE blocks on a world of `world_size` ranks (the run's mesh:
// tp, sequence parallelism, the arrangement, ep, etp). Throws InvalidArgument naming the key (an
// ep that does not divide ranks, an E that ep does not divide and that does not divide ep, an
// unknown dispatch).
parallel::ParallelOptions TrainParallelOptions(const TrainConfig& config, int world_size);
// The config's arrangement ("auto": Megatron with sequence_parallel, else DeepSpeed).
parallel::Arrangement TrainArrangement(const TrainConfig& config);
// ep, or for ep 0 the largest the arrangement allows (DeepSpeed: world / tp; Megatron:
// world / etp).
int TrainExpertParallelSize(const TrainConfig& config, int world_size);

// The MoE block of a distributed run: parallel::ParallelMoeLayer as a FeedForward. Registers
// "<prefix>gate.weight" (dense, replicated) and this rank's shard of the experts under the full
// names ("<prefix>experts.fc1.weight" [E_l, H / n, M], ...; ParamGroup::kExpert). Initial values
// are the single-rank MoeFeedForward's (the full tensors are drawn, then sliced).
class ParallelMoeFeedForward : public FeedForward {
 public:
  // `groups`: the run's process groups (shared by every block and the hooks), built for the
  // mesh `options` ask for. Not collective: the FFN splits no communicator.
  ParallelMoeFeedForward(ParameterSet& params, const std::string& prefix, moe::LayerConfig config,
                         const parallel::ParallelOptions& options,
                         std::shared_ptr<parallel::ProcessGroups> groups, uint64_t seed);

  bool is_moe() const override { return true; }
  int64_t num_experts() const override { return layer_.config().num_experts; }
  const parallel::ParallelMoeLayer& layer() const { return layer_; }
  parallel::ParallelMoeLayer& layer() { return layer_; }
  // The config's adaptive_r text: the r of each step (AdaptiveRAtStep). Default: "default".
  void set_adaptive_r(std::string text) { adaptive_r_ = std::move(text); }

  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override;
  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override;
  void EndStep(std::span<const int64_t> global_expert_counts) override;
  void SetRouterTrace(RouterTrace* trace) override { router_trace_ = trace; }
  // Wall time in Forward/Backward; comm_seconds: blocked in the layer's collectives.
  FeedForwardTimes TakeTimes() override;

 private:
  parallel::ParallelMoeLayer layer_;  // training and evaluation passes (the call's flag)
  moe::LayerParams shard_;            // gate (full) and this rank's experts
  std::string prefix_;
  ParameterSet* params_;
  // The data shards whose mean losses the gradients average (dp x cp; with sequence parallelism
  // the tp ranks of a shard hold parts of its tokens but share its loss).
  int data_shards_ = 1;
  std::string adaptive_r_ = "default";
  FeedForwardTimes times_;
  StepAuxCounts aux_counts_;  // aux_loss global
  RouterTrace* router_trace_ = nullptr;
};

// Data parallelism, ZeRO and expert-parallel checkpoints as TrainHooks (trainer.h).
//
// Buckets, overlap and ZeRO-3 per block (docs/training.md, "Memory and overlap"): the optimizers
// cut their parameters into buckets per transformer block (and by ZeroOptions::bucket_elements).
// As the block observer of the model, the hooks, during a training step: at stage 3 gather a
// block's values just before its forward and its backward, give them back after, and start the
// gather of the block that runs next (prefetch); with overlap_grad_reduce and one pipeline stage,
// start the reduction of a block's buckets as soon as its backward on the step's last
// micro-batch is done. Every rank runs the same blocks in the same order, so the collectives are
// issued in the same order on every rank.
class DistributedHooks : public TrainHooks, public BlockObserver {
 public:
  // `groups`: the run's process groups, those of the MoE blocks (every block the same mesh).
  // Gradients are summed over the ranks holding the same values and divided by the data-parallel
  // size (the loss shards, dp x cp): tensor-parallel shards over the dp x cp group, other dense
  // parameters over the token group (with sequence parallelism each tp rank has its tokens'
  // part), experts over `expert_sync` (the expert-data-parallel group, or with DeepSpeed's TP
  // de-duplication the expert holders over tp too). Not collective. `zero` holds ShardedAdamW's
  // checking options (poison_non_owned). `tp` is the model's tensor-parallel options.
  DistributedHooks(std::shared_ptr<parallel::ProcessGroups> groups, int zero_stage,
                   int ranks_in_process, const ZeroOptions& zero,
                   parallel::GroupKind expert_sync = parallel::GroupKind::kExpertData,
                   TensorParallelOptions tp = {});
  ~DistributedHooks() override;

  // Pipeline parallelism: `stage` is the group of every rank of this rank's stage (world ranks in
  // order; null: the world, pp 1), `tied_embedding` whether the first and last stage hold copies
  // of the tied embedding (their gradients are summed over the embedding group).
  void SetPipeline(std::unique_ptr<comm::Communicator> stage, bool tied_embedding);
  // Reduction of gradient buckets during the backward (see the class comment).
  void SetOverlapGradReduce(bool overlap) { overlap_ = overlap; }
  // The peak memory of this rank's optimizer buffers during the training steps (MemoryMeter).
  const ZeroMemory& peak_memory() const { return meter_.peak(); }
  // The formula bytes for this rank: parameters + gradients + optimizer state as ZeRO shards
  // them (4 bytes per parameter and gradient element, 8 of state), summed over the optimizers.
  int64_t FormulaBytes() const;
  // Reduction times of the optimizers since the last call, summed.
  ReductionTimes TakeReductionTimes();
  // Reduction times and bucket counts summed over the steps so far.
  const ReductionTimes& run_reduction_times() const { return run_times_; }

  // Traces step `step` (1-based) of every rank into `path` (written by world rank 0); the MoE
  // layers given to AddTracedLayer record into it.
  void SetStepTrace(int64_t step, const std::string& path);
  void AddTracedLayer(parallel::ParallelMoeLayer* layer);
  // Records an MoE block built by the factory (its parameter prefix and layer config), for
  // gathering and slicing its experts in checkpoints.
  void AddMoeBlock(const std::string& prefix, const moe::LayerConfig& config);
  // Builds the sharded optimizers over the model's trainable parameters (dense: over the world,
  // experts: over their expert-data-parallel group) with `optimizer`'s options. Call once, after
  // the model is built and before the first step (RankTrainer does). Idempotent.
  void Prepare(ParameterSet& params, const AdamW& optimizer);

  int rank() const override;
  void StepBegins(int64_t step) override;
  void StepEnds(int64_t step) override;
  int world_size() const override;
  int data_rank() const override;
  int data_size() const override;
  bool reports_loss() const override;
  bool reports_routing() const override;
  TensorParallelContext tensor_parallel() override;
  ContextParallelContext context_parallel() override;
  void SetContextParallel(const ContextParallelOptions& options) { cp_options_ = options; }
  int pipeline_rank() const override { return coords_.pp_rank; }
  int pipeline_stages() const override { return mesh_.pp(); }
  comm::Communicator* pipeline_group() override;
  int routing_replicas() const override { return mesh_.data_shards(); }
  int64_t ModelParameterCount(const ParameterSet& params) override;
  std::string LayoutDescription() const override;
  int ranks_in_process() const override { return ranks_in_process_; }
  int zero_stage() const { return zero_stage_; }
  // Optimizer-state floats held by this rank (shows ZeRO's sharding); 0 before the first step.
  int64_t optimizer_state_elements() const;

  void BeginStep(ParameterSet& params) override;
  void BeginMicrobatch(int64_t k, int64_t m) override { last_microbatch_ = k + 1 == m; }
  BlockObserver* block_observer() override { return this; }
  void BeforeBlock(int64_t block, bool backward) override;
  void AfterBlock(int64_t block, bool backward) override;
  void FillSummary(RunSummary* summary) override;
  void ReduceGradients(ParameterSet& params) override;
  double GradSquaredNorm(const ParameterSet& params) override;
  void ScaleGradients(ParameterSet& params, float factor) override;
  void OptimizerStep(AdamW& optimizer, ParameterSet& params, float lr) override;
  int64_t OptimizerStepCount(const AdamW& optimizer) override;
  void GatherParameters(ParameterSet& params) override;
  void ReleaseParameters(ParameterSet& params) override;
  void AllReduceSum(std::span<double> values) override;
  TensorMap ModelValuesForCheckpoint(ParameterSet& params) override;
  TensorMap OptimizerStateForCheckpoint(const AdamW& optimizer, ParameterSet& params) override;
  void LoadModelValues(ParameterSet& params, const TensorMap& values) override;
  void LoadOptimizerState(AdamW& optimizer, const TensorMap& state, int64_t step,
                          ParameterSet& params) override;

 private:
  struct MoeBlock {
    std::string prefix;
    moe::LayerConfig config;
  };
  // Full expert tensors out of every rank's shards (collective), or this rank's shard out of
  // full tensors, for the names "<prefix>experts.<t><suffix>" of every MoE block in `map`.
  void GatherExperts(TensorMap& map, const std::string& suffix);
  void SliceExperts(TensorMap& map, const std::string& suffix) const;
  parallel::Mesh BlockMesh(const MoeBlock& block) const;
  // Every stage's part of a checkpoint map, on every rank (pp > 1: broadcast over the pipeline
  // group, stage by stage). Collective.
  void GatherStages(TensorMap& map);
  // The single-rank tensors of the tensor-parallel shards in `map` ("<name><suffix>"; all-gather
  // over tp, collective), or this rank's shards of them.
  void GatherTensorParallel(ParameterSet& params, TensorMap& map, const std::string& suffix);
  void SliceTensorParallel(ParameterSet& params, TensorMap& map, const std::string& suffix) const;

  std::shared_ptr<parallel::ProcessGroups> groups_;
  comm::Communicator& world_;
  const parallel::Mesh& mesh_;
  int zero_stage_;
  int ranks_in_process_;
  ZeroOptions zero_options_;  // poison_non_owned, buckets (the meter is meter_)
  MemoryMeter meter_;
  bool overlap_ = true;
  bool last_microbatch_ = true;
  bool in_step_ = false;
  int64_t steps_ = 0;
  ReductionTimes run_times_;  // summed over the run's steps
  // The optimizers, in the order every rank calls them (null before Prepare).
  std::vector<ShardedAdamW*> Optimizers() const;
  std::unordered_set<const Parameter*> owned_by_optimizer_;
  comm::Communicator& tp_group_;     // the tensor-parallel group
  comm::Communicator& data_;         // same tp rank (dp x cp): the tensor-parallel shards' replicas
  comm::Communicator& tokens_;       // every rank with tokens of its own (replicated dense)
  comm::Communicator& expert_data_;  // ranks holding the same expert shard (expert_sync)
  TensorParallelOptions tp_options_;
  ContextParallelOptions cp_options_;
  parallel::RankCoords coords_;
  std::vector<MoeBlock> moe_blocks_;
  // How many ranks hold a copy of each element of the three optimizers' parameters.
  double CopiesSplit() const;
  double CopiesDense() const;
  double CopiesExperts() const;
  int64_t split_elements_ = 0, dense_elements_ = 0, expert_elements_ = 0;  // this rank's
  std::unique_ptr<comm::Communicator> stage_owned_;
  comm::Communicator* stage_ = nullptr;  // every rank of this stage (the world with pp 1)
  bool tied_embedding_ = false;
  std::unique_ptr<ShardedAdamW> copy_opt_;    // tied copies (the head stage's embed.weight)
  std::unique_ptr<ShardedAdamW> split_opt_;   // tensor-parallel shards, over data_
  std::unique_ptr<ShardedAdamW> dense_opt_;   // other dense parameters, over tokens_
  std::unique_ptr<ShardedAdamW> expert_opt_;  // over expert_data_
  bool gathered_ = true;
  std::unique_ptr<internal::StepTrace> trace_;  // null: no step traced
};

// One rank of a distributed run: the process groups (built once, here), hooks, the MoE factory
// and the Trainer. Collective over `world`.
class RankTrainer {
 public:
  // `zero`: ShardedAdamW's checking options (tests poison non-owned values with NaN); the bucket
  // options come from the config (bucket_mb).
  RankTrainer(const TrainConfig& config, comm::Communicator& world, int ranks_in_process,
              const ZeroOptions& zero);
  RankTrainer(const TrainConfig& config, comm::Communicator& world, int ranks_in_process);
  ~RankTrainer();

  Trainer& trainer() { return *trainer_; }
  DistributedHooks& hooks() { return *hooks_; }
  parallel::ProcessGroups& groups() { return *groups_; }

 private:
  std::shared_ptr<parallel::ProcessGroups> groups_;
  std::unique_ptr<DistributedHooks> hooks_;
  std::unique_ptr<Trainer> trainer_;
};

struct DistributedRunOptions {
  RunOptions run;  // resume, output stream (rank 0's), progress bar mode
};

// Trains `config` on the launcher's ranks (config.ranks must equal launcher.world_size()) and
// returns rank 0's summary (in the processes of other ranks: their own). When some ranks run in
// other processes, every rank first checks that all got the same config and data
// (comm/agree.h). The run directory's config.json and the checkpoints record the layout that
// ran: ep 0 becomes the number of ranks. Errors on any rank are rethrown (the others fail fast:
// their peer is gone). Sets no process-wide state: the program sets the BLAS threads (one per
// rank thread: kernels::SetBlasThreads(1)) and the allocator's policy.
RunSummary RunDistributedTraining(comm::Launcher& launcher, const TrainConfig& config,
                                  const DistributedRunOptions& options);

}  // namespace switchyard::train
