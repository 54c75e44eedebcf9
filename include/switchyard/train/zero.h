// ZeRO stages 0-3 (docs/training.md, "Distributed training") as a sharded AdamW over parameters
// replicated on every rank of a group: the data-parallel world for dense parameters, an
// expert-data-parallel group for expert parameters (one ShardedAdamW per group).
//
// Buffers. The trainable parameters (buffers, trainable = false, are skipped: never reduced,
// stepped or gathered) are moved into two flat arrays of this object, one for the values and one
// for the gradients (PageArray: their pages can be handed back to the system); every Parameter's
// value and grad become views of them, so the model's layers read and write the arrays. Every
// rank must pass the same names, shapes and options in the same order (checked at construction).
//
// Buckets and ownership. The parameters are cut, in the order given, into buckets: a new bucket
// starts where ZeroOptions::bucket_elements is reached and, with bucket_per_block, where the
// transformer block of the parameter name ("blocks.<i>.") changes (parameters outside blocks form
// their own buckets, unit -1). With g = group.size(), a bucket of n elements is padded to g * c,
// c = ceil(n / g), and rank r owns its elements [r * c, min((r + 1) * c, n)): an equal, padded
// split, so that every reduce-scatter and all-gather has equal counts. The last ranks may own
// fewer elements than c, or none. One bucket (the default) is the whole flat vector. The padding
// is never stored in a parameter or the state.
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
// Freeing. Stages 2 and 3 give back the pages of the gradients outside the own range once a
// bucket is reduced (they read 0 until the next backward writes them); stage 3 gives back the
// pages of the values outside the own range on ReleaseParameters / ReleaseUnit and takes them
// again on GatherParameters / GatherUnit. ZeroGradients gives back every gradient page (the
// gradients read 0; the backward commits the pages it writes). Pages shared by an own and a
// non-owned range stay (their non-owned elements are zeroed), so the memory held is the own
// share rounded up to pages. With ZeroOptions::poison_non_owned, what stops being valid is
// overwritten with NaN instead (tests: a forward that forgot a gather, or a reader of a stale
// gradient, produces NaN instead of a silently wrong result).
//
// Overlap. LaunchUnitReduction starts the reduction of a unit's buckets (asynchronous
// collectives on `group`) while the caller goes on with the backward of the blocks before it;
// ReduceGradients launches the buckets not launched yet, in bucket order, and waits for all.
// Every rank must launch the same buckets in the same order (the trainer launches a block's
// buckets after its backward, in reverse block order, on the last micro-batch). GatherUnit /
// PrefetchUnit do the same for the stage-3 all-gather of a block's values.
//
// Memory accounting (MemoryUse): the resident bytes of the value and gradient arrays (measured:
// the pages the system holds for them; a bucket with a collective in flight counts whole), plus
// the optimizer state and the reduction's receive buffers. With a MemoryMeter in ZeroOptions,
// every optimizer sharing the meter samples the sum of their uses before each release and after
// each reduction, which catches the peak (memory only goes down at releases).
//
// Collectives: the constructor, ReduceGradients, LaunchUnitReduction, Step (stages 1, 2),
// GatherParameters / GatherUnit / PrefetchUnit (stage 3) and FullState (stage >= 1) are
// collectives over `group`: every rank calls them in the same order. A comm failure
// (TimeoutError, PeerError) propagates and leaves this object unusable, like the communicator.
//
// Thread-safety: none; one rank's thread drives its object. `group` must outlive the object; the
// parameters' tensors keep the arrays alive.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/memory_account.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/train/optimizer.h"
#include "switchyard/train/page_array.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

class ShardedAdamW;

// Bytes one rank's optimizer(s) hold (see the file comment).
struct ZeroMemory {
  int64_t values = 0;     // resident pages of the value arrays
  int64_t gradients = 0;  // resident pages of the gradient arrays
  int64_t state = 0;      // optimizer state (exp_avg, exp_avg_sq)
  int64_t scratch = 0;    // receive buffers of reductions in flight, gather staging
  int64_t total() const { return values + gradients + state + scratch; }
};

// The peak of the summed MemoryUse of the optimizers registered with it (one rank's).
//
// The arrays are not Tensors, so the thread's MemoryAccount (core/memory_account.h) does not see
// them: the meter charges the account of the thread that registered the first optimizer with the
// sum it measured last (at Register and every Sample), and gives it back when destroyed. The
// account's peak so covers the rank's tensors and its optimizers' arrays together, as of each
// sample (the figure `switchyard train` reports as the measured peak per rank).
class MemoryMeter {
 public:
  MemoryMeter() = default;
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;
  ~MemoryMeter();
  void Register(const ShardedAdamW* opt);
  // Samples the current sum; keeps the largest total (and its parts).
  void Sample();
  const ZeroMemory& peak() const { return peak_; }
  // Forgets the peak (the next Sample starts it again).
  void Reset() { peak_ = ZeroMemory{}; }
  ZeroMemory Current() const;

 private:
  void ChargeAccount(int64_t total);
  std::vector<const ShardedAdamW*> opts_;
  ZeroMemory peak_;
  std::shared_ptr<MemoryAccount> account_;
  int64_t charged_ = 0;  // bytes charged to account_
};

// Time the reductions of a rank took and how much of it the rank spent blocked waiting for them.
struct ReductionTimes {
  double reduce_seconds = 0;   // sum over buckets of (finished - started)
  double blocked_seconds = 0;  // in ReduceGradients' waits
  int64_t buckets = 0;         // reductions run
  int64_t overlapped = 0;      // of them launched before ReduceGradients
};

struct ZeroOptions {
  // Checking mode: overwrite values and gradients that stop being valid on this rank with NaN
  // (see the file comment). Costs one pass over the non-owned elements; meant for tests.
  bool poison_non_owned = false;
  // Bucket size in elements (0: no limit); see the file comment.
  int64_t bucket_elements = 0;
  // Buckets end where the transformer block of the parameter names changes.
  bool bucket_per_block = false;
  // Shared by the optimizers of one rank to measure their peak together (may be null).
  MemoryMeter* meter = nullptr;
};

class ShardedAdamW {
 public:
  // `params`: the parameters of this group, non-null, float32 values, trainable ones with a
  // gradient of the value's shape; they must outlive the object. `stage` in 0..3. Moves their
  // values and gradients into this object's arrays (the tensors become views). Throws
  // InvalidArgument for a bad stage or parameter, or (on every rank) when the ranks disagree on
  // the names, shapes or options of the parameters. Collective.
  ShardedAdamW(std::vector<Parameter*> params, comm::Communicator& group, int stage,
               AdamWOptions options = {}, ZeroOptions zero = {});
  ~ShardedAdamW();

  ShardedAdamW(const ShardedAdamW&) = delete;
  ShardedAdamW& operator=(const ShardedAdamW&) = delete;

  int stage() const { return stage_; }
  const AdamWOptions& options() const { return options_; }
  // AdamW steps taken (0 before the first), as AdamW::step().
  int64_t step() const { return step_; }
  // N: elements of the trainable parameters.
  int64_t num_elements() const { return total_; }
  // Elements this rank owns (the sum over buckets; over the group they add up to N).
  int64_t owned_elements() const;
  // With one bucket: this rank's range [own_begin, own_end) of the flat vector.
  int64_t own_begin() const;
  int64_t own_end() const;
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Optimizer-state floats held by this rank: 2 N at stage 0, 2 owned_elements() else.
  int64_t state_elements() const { return static_cast<int64_t>(exp_avg_.size() * 2); }
  // Bytes held now (see the file comment).
  ZeroMemory MemoryUse() const;
  // Reduction times since the last call, then restarts.
  ReductionTimes TakeReductionTimes();

  // Gives back every gradient page: the gradients read 0 (ParameterSet::ZeroGrad for these
  // parameters, without touching the pages). Local.
  void ZeroGradients();
  // Starts the reduction of the buckets of `unit` (a block index, -1 for the parameters outside
  // blocks) that are not started yet: their gradients must be final. Collective.
  void LaunchUnitReduction(int64_t unit);
  // Waits for the launched reductions of `unit`'s buckets and finishes them: they get the reduced
  // gradient times `scale` (the `scale` ReduceGradients will be given) and stages 2/3 give back
  // the rest of the bucket's gradients. The buffer calls it for the block after the one whose
  // backward just ended, so that at most two blocks' reductions are in flight and what is freed
  // when does not depend on timing. Issues no collective.
  void FinishUnitReduction(int64_t unit, float scale);
  // Sums every trainable parameter's gradient over the group and multiplies it by `scale` (the
  // trainer passes 1 / data shards). Stages 0/1: all-reduce, every rank then holds the full
  // result. Stages 2/3: reduce-scatter, only the own range holds the result; the rest reads 0
  // (NaN with poison_non_owned). Launches what LaunchUnitReduction did not, waits for all.
  // Collective.
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

  // Stage 3: all-gather the parameter values from their owners (every bucket not gathered), before
  // a forward (or before reading or saving the values). No-op at stages 0-2. Collective.
  void GatherParameters();
  // Stage 3: gives back the non-owned values of every gathered bucket. No-op at stages 0-2.
  void ReleaseParameters();
  // Stage 3, one unit's buckets: start their all-gather (PrefetchUnit), make sure they are
  // gathered (GatherUnit: waits for a prefetch or gathers), give back their non-owned values
  // (ReleaseUnit). No-ops at stages 0-2 and for a unit without buckets. Gather and Prefetch are
  // collective.
  void PrefetchUnit(int64_t unit);
  void GatherUnit(int64_t unit);
  void ReleaseUnit(int64_t unit);
  // Whether this object has buckets of `unit`.
  bool HasUnit(int64_t unit) const;

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
  // A piece of one parameter inside a range of the arrays.
  struct Segment {
    Parameter* param;
    size_t index;          // in params_
    int64_t param_offset;  // first element within the parameter
    int64_t flat_offset;   // first element within the arrays
    int64_t length;
  };
  struct Bucket {
    int64_t unit = -1;                   // block index, -1 outside blocks
    size_t first = 0, last = 0;          // params_[first, last)
    int64_t base = 0;                    // array offset of its first element
    int64_t numel = 0;                   // n
    int64_t chunk = 0;                   // c = ceil(n / g)
    int64_t own_begin = 0, own_end = 0;  // array offsets of this rank's elements
    int64_t state_offset = 0;            // of its stepped range within exp_avg_
    comm::Work reduction;                // in flight when `reducing`
    bool reducing = false;
    bool reduced = false;         // finished since the last ZeroGradients
    std::vector<float> received;  // reduce-scatter output (c), while reducing
    comm::Work gather;            // stage 3 all-gather in flight when `gathering`
    bool gathering = false;
    bool gathered = true;       // stage 3: the non-owned values are valid
    std::vector<float> staged;  // all-gather input (c), while gathering
  };
  // The pieces of the trainable parameters within array range [begin, end), in order.
  std::vector<Segment> Segments(int64_t begin, int64_t end) const;
  // The range this rank steps in a bucket: all of it at stage 0, the own range else.
  int64_t StateBegin(const Bucket& b) const { return stage_ == 0 ? b.base : b.own_begin; }
  int64_t StateEnd(const Bucket& b) const { return stage_ == 0 ? b.base + b.numel : b.own_end; }
  void LaunchReduction(Bucket& b);
  void FinishReduction(Bucket& b, float scale);
  void LaunchGather(Bucket& b);
  void FinishGather(Bucket& b);
  void Release(Bucket& b, bool values);  // the non-owned part of a bucket's values or gradients
  void Sample() const;

  std::vector<Parameter*> params_;  // trainable ones, in the given order
  std::vector<int64_t> offsets_;    // array offset of params_[i]
  std::vector<Bucket> buckets_;
  comm::Communicator& group_;
  int stage_;
  AdamWOptions options_;
  ZeroOptions zero_;
  int64_t total_ = 0;  // N
  int64_t step_ = 0;
  bool has_state_ = false;  // stepped or loaded: FullState is non-empty (as AdamW's)
  std::shared_ptr<PageArray> values_, grads_;
  // State of the stepped ranges (StateBegin..StateEnd of each bucket, in bucket order).
  std::vector<float> exp_avg_;
  std::vector<float> exp_avg_sq_;
  ReductionTimes times_;
};

}  // namespace switchyard::train
