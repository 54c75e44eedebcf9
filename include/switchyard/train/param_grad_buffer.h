// The parameters and gradients of one rank of a distributed run, and what happens to them between
// the backward and the next forward: data-parallel reduction in buckets, ZeRO stages 0-3 and the
// reduction overlapped with the backward (docs/training.md, "Memory and overlap"). Megatron-Core's
// ParamAndGradBuffer is the idea; the buckets and shards are ShardedAdamW's (zero.h), one per
// set of parameters replicated over the same group:
//   tied copies     the head stage's copy of a tied embedding (reduced like what it copies)
//   split           tensor-parallel shards, over dp x cp (the ranks with the same tp rank)
//   dense           other dense parameters, over the token group (every rank with tokens of its
//                   own; with sequence parallelism the tp ranks too)
//   experts         over the expert-data-parallel group (or with DeepSpeed's TP de-duplication
//                   the expert holders over tp too)
// Each gradient is summed over its group and divided by the data-parallel size (dp x cp).
//
// Buckets, overlap and ZeRO-3 per block: the optimizers cut their parameters into buckets per
// transformer block (and by ZeroOptions::bucket_elements). As the block observer of the model,
// during a training step the buffer: at stage 3 gathers a block's values just before its forward
// and its backward, gives them back after, and starts the gather of the block that runs next
// (prefetch); with overlap on and one pipeline stage, starts the reduction of a block's buckets
// as soon as its backward on the step's last micro-batch is done. Every rank runs the same blocks
// in the same order, so the collectives are issued in the same order on every rank.
//
// Thread-safety: one per rank, driven by its thread; the collectives follow zero.h's rules.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_set>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/parallel/process_groups.h"
#include "switchyard/train/model.h"
#include "switchyard/train/optimizer.h"
#include "switchyard/train/parameters.h"
#include "switchyard/train/zero.h"

namespace switchyard::train {

struct RunSummary;
namespace internal {
class StepTrace;  // src/train/step_trace.h
}  // namespace internal

class ParamGradBuffer : public BlockObserver {
 public:
  // `groups`: the run's process groups (must outlive the buffer). `zero_stage` 0-3; `zero`:
  // ShardedAdamW's options (buckets, poison_non_owned); `expert_sync`: kExpertData or
  // kExpertHolders (see the file comment). Not collective.
  ParamGradBuffer(std::shared_ptr<parallel::ProcessGroups> groups, int zero_stage,
                  const ZeroOptions& zero, parallel::GroupKind expert_sync);
  ~ParamGradBuffer() override;

  // Whether the first and last pipeline stage hold copies of the tied embedding (their
  // gradients are summed over the embedding group; pp > 1 only).
  void SetTiedEmbedding(bool tied_embedding);
  // Reduction of gradient buckets during the backward (see the file comment).
  void SetOverlapGradReduce(bool overlap) { overlap_ = overlap; }
  // The step trace the phases are recorded into (null: none).
  void SetTrace(internal::StepTrace* trace) { trace_ = trace; }
  // Builds the sharded optimizers over the model's trainable parameters with `optimizer`'s
  // options. Call once, after the model is built and before the first step. Idempotent.
  void Prepare(ParameterSet& params, const AdamW& optimizer);

  // At the start of a training step: the values its forward needs, and zero gradients.
  void BeginStep(ParameterSet& params);
  // Before micro-batch k of m (one pipeline stage): the last one's backward reduces as it goes.
  void BeginMicrobatch(int64_t k, int64_t m) { last_microbatch_ = k + 1 == m; }
  void BeforeBlock(int64_t block, bool backward) override;
  void AfterBlock(int64_t block, bool backward) override;
  // After the backward: every gradient that of the global batch (the buckets not reduced yet).
  void ReduceGradients(ParameterSet& params);
  // The global sum of squared gradients, each distinct element counted once. Collective.
  double GradSquaredNorm();
  void ScaleGradients(float factor);
  // The optimizer step on this rank's shards, then (stages 1, 2) the all-gather of the values.
  void Step(float lr);
  // Optimizer steps taken (`optimizer`'s before Prepare).
  int64_t StepCount(const AdamW& optimizer) const;
  // ZeRO-3: all-gather the values before any use / give back the non-owned ones after the step.
  void GatherParameters();
  void ReleaseParameters();
  // Trainable elements of the whole model (every rank's sets counted once). Collective.
  int64_t ModelParameterCount();
  // The optimizer state as full tensors of this rank's parameters (AdamW's names; empty before
  // the first step), and its inverse. Collective at stage >= 1.
  TensorMap FullState();
  void LoadFullState(const TensorMap& state, int64_t step);
  // Sums `values` over the world in place, in rank order (the same bits on every rank).
  void AllReduceSum(std::span<double> values);

  // The peak memory of this rank's optimizer buffers during the training steps (MemoryMeter).
  const ZeroMemory& peak_memory() const { return meter_.peak(); }
  // The formula bytes for this rank: parameters + gradients + optimizer state as ZeRO shards
  // them (4 bytes per parameter and gradient element, 8 of state), summed over the optimizers.
  int64_t FormulaBytes() const;
  // Reduction times of the optimizers since the last call, summed.
  ReductionTimes TakeReductionTimes();
  // Reduction times and bucket counts summed over the steps so far.
  const ReductionTimes& run_reduction_times() const { return run_times_; }
  // The summary's ZeRO memory and reduction figures (the largest rank's). Collective.
  void FillSummary(RunSummary* summary);
  int zero_stage() const { return zero_stage_; }
  // Optimizer-state floats held by this rank (shows ZeRO's sharding); 0 before the first step.
  int64_t optimizer_state_elements() const;

 private:
  // The optimizers, in the order every rank calls them (null before Prepare).
  std::vector<ShardedAdamW*> Optimizers() const;
  // How many ranks hold a copy of each element of the three optimizers' parameters.
  double CopiesSplit() const;
  double CopiesDense() const;
  double CopiesExperts() const;

  std::shared_ptr<parallel::ProcessGroups> groups_;
  comm::Communicator& world_;
  const parallel::Mesh& mesh_;
  int zero_stage_;
  ZeroOptions zero_options_;  // poison_non_owned, buckets (the meter is meter_)
  MemoryMeter meter_;
  bool overlap_ = true;
  bool last_microbatch_ = true;
  bool in_step_ = false;
  int64_t steps_ = 0;
  ReductionTimes run_times_;  // summed over the run's steps
  std::unordered_set<const Parameter*> owned_by_optimizer_;
  comm::Communicator& data_;         // same tp rank (dp x cp): the tensor-parallel shards' replicas
  comm::Communicator& tokens_;       // every rank with tokens of its own (replicated dense)
  comm::Communicator& expert_data_;  // ranks holding the same expert shard (expert_sync)
  int64_t split_elements_ = 0, dense_elements_ = 0, expert_elements_ = 0;  // this rank's
  bool tied_embedding_ = false;
  std::unique_ptr<ShardedAdamW> copy_opt_;    // tied copies (the head stage's embed.weight)
  std::unique_ptr<ShardedAdamW> split_opt_;   // tensor-parallel shards, over data_
  std::unique_ptr<ShardedAdamW> dense_opt_;   // other dense parameters, over tokens_
  std::unique_ptr<ShardedAdamW> expert_opt_;  // over expert_data_
  bool gathered_ = true;
  internal::StepTrace* trace_ = nullptr;  // null: no step traced
};

}  // namespace switchyard::train
