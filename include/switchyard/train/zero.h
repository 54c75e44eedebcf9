// ZeRO stages 0-3 (docs/training.md, "Distributed training") as a sharded AdamW over parameters
// replicated on every rank of a group: the data-parallel world for dense parameters, an
// expert-data-parallel group for expert parameters (one ShardedAdamW per group).
//
// Flat view and ownership. The trainable parameters (buffers, trainable = false, are skipped:
// never reduced, stepped or gathered) are viewed as one flat vector of N floats in the order
// given; every rank must pass the same names, shapes and options in the same order (checked at
// construction). With g = group.size(), the vector is padded to g * c floats, c = ceil(N / g),
// and rank r owns the contiguous range [r * c, min((r + 1) * c, N)): an equal, padded split, so
// that every reduce-scatter and all-gather has equal counts. The last ranks may own fewer
// elements than c, or none (N < g). The padding is never stored in a parameter or the state.
//
// Per stage:
//   stage  gradients after ReduceGradients   optimizer state     values after Step
//   0      full, on every rank (all-reduce)  full (2 N floats)   full (every rank steps all)
//   1      full, on every rank (all-reduce)  own range only      full (all-gather)
//   2      own range (reduce-scatter)        own range only      full (all-gather)
//   3      own range (reduce-scatter)        own range only      own range (GatherParameters)
// The update is AdamWUpdate, elementwise, so every stage equals AdamW::Step on the averaged
// gradients up to the summation order of the reduction; the step count and the state names
// ("<param>.exp_avg", "<param>.exp_avg_sq", full shapes) are AdamW's, so checkpoints of any stage
// and of a plain AdamW are interchangeable (FullState / LoadFullState).
//
// What ZeRO-3 "free" means here. Memory is NOT freed: the model's modules (and structures such
// as the MoE layer's LayerParams) hold handles to each Parameter's full value and gradient
// tensors, so those stay allocated at full size on every rank. What is sharded for real is the
// optimizer state (2 N / g floats instead of 2 N, stages 1-3). ReleaseParameters() marks the
// non-owned values dead: with ZeroOptions::poison_non_owned they are overwritten with NaN (and
// so are non-owned gradients after a stage-2/3 ReduceGradients, and non-owned values after a
// stage-3 Step), so a forward that forgot GatherParameters, or a reader of a stale gradient,
// produces NaN instead of a silently wrong result. Without it they keep stale values.
//
// Scratch: one flat float buffer of g * c elements (plus c for the own shard), reused by every
// collective of this object.
//
// Collectives: the constructor, ReduceGradients, Step (stages 1, 2), GatherParameters (stage 3)
// and FullState (stage >= 1) are collectives over `group`: every rank calls them in the same
// order. They wait for completion before returning; a comm failure (TimeoutError, PeerError)
// propagates and leaves this object unusable, like the communicator.
//
// Thread-safety: none; one rank's thread drives its object. `group` must outlive the object.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/train/optimizer.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

struct ZeroOptions {
  // Checking mode: overwrite values and gradients that stop being valid on this rank with NaN
  // (see the file comment). Costs one pass over the non-owned elements; meant for tests.
  bool poison_non_owned = false;
};

class ShardedAdamW {
 public:
  // `params`: the parameters of this group, non-null, float32 values, trainable ones with a
  // gradient of the value's shape; they must outlive the object. `stage` in 0..3. Throws
  // InvalidArgument for a bad stage or parameter, or (on every rank) when the ranks disagree on
  // the names, shapes or options of the parameters. Collective.
  ShardedAdamW(std::vector<Parameter*> params, comm::Communicator& group, int stage,
               AdamWOptions options = {}, ZeroOptions zero = {});

  ShardedAdamW(const ShardedAdamW&) = delete;
  ShardedAdamW& operator=(const ShardedAdamW&) = delete;

  int stage() const { return stage_; }
  const AdamWOptions& options() const { return options_; }
  // AdamW steps taken (0 before the first), as AdamW::step().
  int64_t step() const { return step_; }
  // N: elements of the trainable parameters.
  int64_t num_elements() const { return total_; }
  // This rank's range [own_begin, own_end) of the flat vector (see the file comment).
  int64_t own_begin() const { return own_begin_; }
  int64_t own_end() const { return own_end_; }
  // Optimizer-state floats held by this rank: 2 N at stage 0, 2 (own_end - own_begin) else.
  int64_t state_elements() const { return static_cast<int64_t>(exp_avg_.size() * 2); }

  // Sums every trainable parameter's gradient over the group and multiplies it by `scale` (the
  // trainer passes 1 / data shards). Stages 0/1: all-reduce, every rank then holds the full
  // result. Stages 2/3: reduce-scatter, only the own range holds the result; the rest keeps this
  // rank's local gradient (NaN with poison_non_owned). Collective.
  void ReduceGradients(float scale);
  // Sum of the squared gradients of the own range (double): adding the parts over the group counts
  // every element once (what GradSquaredNorm gives for the whole set). Local.
  double OwnGradSquaredNorm() const;
  // grad *= factor (clipping) on every element that holds the reduced gradient: all of them at
  // stages 0/1, the own range at 2/3. Local.
  void ScaleGradients(float factor);
  // One AdamW step with learning rate `lr`: stage 0 steps every element with full state; stages
  // 1-3 step the own range with the own state. Stages 1/2 then all-gather the values (collective),
  // so every rank holds the full updated parameters; stage 3 does not (call GatherParameters).
  void Step(float lr);

  // Stage 3: all-gather the parameter values from their owners, before a forward (or before
  // reading or saving the values). No-op at stages 0-2. Collective at stage 3.
  void GatherParameters();
  // Stage 3: after backward, the non-owned values are no longer needed (overwritten with NaN
  // with poison_non_owned; memory is not freed, see the file comment). No-op at stages 0-2.
  void ReleaseParameters();

  // The full optimizer state as AdamW::StateTensors names it ("<param>.exp_avg",
  // "<param>.exp_avg_sq", full shapes, float32), every trainable parameter; empty before the
  // first step (as AdamW). Stage >= 1: assembled by an all-gather, every rank gets it
  // (collective). The tensors are new, not shared with this object.
  TensorMap FullState();
  // Loads a full state (as FullState or AdamW::StateTensors give it, float32 or bfloat16),
  // keeping only the own range at stages 1-3; `step` the AdamW step count (>= 0). Extra tensors
  // are ignored. Throws InvalidArgument naming a missing tensor or a wrong shape or dtype,
  // before changing anything. Local.
  void LoadFullState(const TensorMap& tensors, int64_t step);

 private:
  // A piece of one parameter inside a flat range.
  struct Segment {
    Parameter* param;
    int64_t param_offset;  // first element within the parameter
    int64_t flat_offset;   // first element within the flat vector
    int64_t length;
  };
  // The pieces of the trainable parameters that lie within flat [begin, end), in flat order.
  std::vector<Segment> Segments(int64_t begin, int64_t end) const;
  // Own values -> shard_ (padded with zeros), all-gather into scratch_, scratch_ -> every value.
  void AllGatherValues();
  // Fills the values (or gradients) outside the own range with NaN.
  void PoisonNonOwned(bool values);
  // The flat range stepped by this rank: everything at stage 0, the own range else.
  int64_t state_begin() const { return stage_ == 0 ? 0 : own_begin_; }
  int64_t state_end() const { return stage_ == 0 ? total_ : own_end_; }

  std::vector<Parameter*> params_;  // trainable ones, in the given order
  std::vector<int64_t> offsets_;    // flat offset of params_[i]
  comm::Communicator& group_;
  int stage_;
  AdamWOptions options_;
  ZeroOptions zero_;
  int64_t total_ = 0;  // N
  int64_t chunk_ = 0;  // c = ceil(N / g)
  int64_t own_begin_ = 0;
  int64_t own_end_ = 0;
  int64_t step_ = 0;
  bool has_state_ = false;  // stepped or loaded: FullState is non-empty (as AdamW's)
  // State of flat [state_begin(), state_end()), allocated (zeros) at construction.
  std::vector<float> exp_avg_;
  std::vector<float> exp_avg_sq_;
  std::vector<float> scratch_;  // g * c (stage 0/1 reductions use the first N)
  std::vector<float> shard_;    // c
};

}  // namespace switchyard::train
