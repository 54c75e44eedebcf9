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
// (ParamGradBuffer says which) and divided by D. This equals the single-rank gradient when every
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
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/launcher.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/train/aux_counts.h"
#include "switchyard/train/checkpoint_layout.h"
#include "switchyard/train/config.h"
#include "switchyard/train/param_grad_buffer.h"
#include "switchyard/train/trainer.h"
#include "switchyard/train/zero.h"

namespace switchyard::train {

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
  // `groups`: the run's process groups (shared by every block and the buffer), built for the
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

// One rank of a distributed run: the Trainer over `world` (trainer.h: it builds the process
// groups, buffer and checkpoint layout of its rank). Collective over `world`.
class RankTrainer {
 public:
  // `zero`: ShardedAdamW's checking options (tests poison non-owned values with NaN); the bucket
  // options come from the config (bucket_mb).
  RankTrainer(const TrainConfig& config, comm::Communicator& world, int ranks_in_process,
              const ZeroOptions& zero = {})
      : trainer_(config, world, ranks_in_process, zero) {}

  Trainer& trainer() { return trainer_; }
  // The rank's parameter-and-gradient buffer (its ZeRO memory and reduction figures; the model's
  // block observer).
  ParamGradBuffer& buffer() { return trainer_.buffer(); }
  parallel::ProcessGroups& groups() { return trainer_.groups(); }

 private:
  Trainer trainer_;
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
