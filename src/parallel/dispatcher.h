// The dispatchers of the parallel MoE layer: how one step's kept (token, choice) rows reach the
// ranks holding their experts, are computed there and come back combined. One interface, four
// strategies, each owning its state (docs/parallel.md, "The layer and its dispatchers"):
//
//   local       Tutel's r = 0: this rank holds the compute weights of every expert, so the rows
//               never leave it (with DeepSpeed's TP de-duplication the tp ranks split the rows
//               and all-gather the outputs).
//   exchange    the token all-to-all of DeepSpeed / Tutel (fixed capacity, padded blocks) or
//               FastMoE / MegaBlocks (all-to-all-v of exactly the kept rows), with Tutel's
//               overlap degree, FasterMoE's smart schedule, the 2DH all-to-all and, when the step
//               shadows experts, FasterMoE's shadow experts computed locally (exchange.h,
//               shadow.h).
//   allgather   Megatron's allgather dispatcher: tokens and routing all-gathered over the expert
//               group, partial outputs reduce-scattered back (allgather_dispatch.h).
//
// A Dispatcher lives as long as its layer and holds what persists between steps (options, the
// cost model of the schedules); Forward returns a DispatchStep, the step's handle (its transfers'
// layout, expert activations, outputs), which the backward reuses. Private to src/parallel.
//
// Thread-safety: as the layer: one rank thread; calls are collective over the expert group (and
// the tp group with de-duplication) and made in the same order on every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/experts.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/parallel/process_groups.h"
#include "switchyard/parallel/schedule.h"

namespace switchyard::parallel::internal {

// The experts as the dispatchers run them: moe::ExpertsForward / ExpertsBackward with the
// layer's activation and this call's thread budget, on whichever weights the dispatcher passes
// (the step's compute weights, or shadowed experts' broadcast weights).
struct ExpertKernels {
  moe::ExpertOptions options;
  int threads = 1;

  Tensor Forward(const moe::ExpertWeights& weights, const Tensor& rows,
                 const moe::ExpertGroups& groups, moe::ExpertActivations* acts) const;
  moe::ExpertGradients Backward(const moe::ExpertWeights& weights,
                                const moe::ExpertActivations& acts, const Tensor& d_out) const;
};

// What one step hands to its dispatcher (forward and backward alike).
struct StepInput {
  const moe::DispatchPlan& plan;      // this rank's plan, in the layout Layout() asked for
  const Tensor& x;                    // [T, M] float32, this rank's tokens
  const moe::ExpertWeights& weights;  // the step's compute weights (expert_weights.h)
  int r = 1;                          // Tutel's adaptive r of the step
};

// The rows per expert of the plan's buffer on the wire, which the layer makes the same on every
// rank of the expert group before it lays out the plan.
struct BufferLayout {
  // The rows per expert must be the largest capacity of the expert group (fixed-size blocks).
  bool group_capacity = false;
  int64_t stride = 0;  // > 0: fixed rows per expert (padding after the kept rows); 0: packed
};

// What a dispatcher reports about the step it ran (ParallelOutput's fields).
struct DispatchInfo {
  int overlap_degree = 1;
  int smart_group = 0;
  std::vector<int64_t> shadowed;
};

// Gradients a dispatcher's backward returns; the layer adds the gate's.
struct DispatchGradients {
  Tensor x;                    // [T, M] float32, through the expert inputs
  std::vector<float> weights;  // [T, k] of the combine weights (post- and pre-score)
  moe::ExpertWeights experts;  // of the step's compute weights, this rank's contribution
};

// One step's state: what the backward needs.
class DispatchStep {
 public:
  virtual ~DispatchStep() = default;
  // dy [T, M] float32 -> the gradients, through the same transfers in reverse. Collective.
  virtual DispatchGradients Backward(const StepInput& in, const ExpertKernels& experts,
                                     const Tensor& dy, CommStats* stats) const = 0;
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;

  // The plan buffer's layout for `capacity` rows per expert (already the group's largest when
  // group_capacity) and adaptive r.
  virtual BufferLayout Layout(int64_t capacity, int r) const = 0;
  // Whether Layout needs the group's largest capacity (asked before r is known).
  virtual bool needs_group_capacity() const { return false; }

  // Forward of one step: dispatch the plan's kept rows of in.x, run `experts` on them where their
  // weights are, combine the outputs with the plan's weights into *y [T, M] float32. Collective.
  virtual std::unique_ptr<DispatchStep> Forward(const StepInput& in, const ExpertKernels& experts,
                                                Tensor* y, DispatchInfo* info,
                                                CommStats* stats) = 0;

  // The cost model the schedules use (measured fields filled after first use).
  virtual const CostModel& cost_model() const = 0;
};

// The step of a dispatcher whose transport computes the rows itself and combines them where the
// experts are (allgather_dispatch.h, dedup_exchange.h): Transport gives expert_input(),
// groups(), Combine, CombineBackward and DispatchBackward (returning x and weights gradients).
template <typename Transport>
class TransportStep : public DispatchStep {
 public:
  template <typename... Args>
  explicit TransportStep(Args&&... args) : transport_(std::forward<Args>(args)...) {}

  Tensor Forward(const StepInput& in, const ExpertKernels& experts, CommStats* stats) {
    expert_out_ =
        experts.Forward(in.weights, transport_.expert_input(), transport_.groups(), &acts_);
    return transport_.Combine(expert_out_, stats);
  }

  DispatchGradients Backward(const StepInput& in, const ExpertKernels& experts, const Tensor& dy,
                             CommStats* stats) const override {
    Tensor d_out = transport_.CombineBackward(dy, expert_out_, stats);
    moe::ExpertGradients eg = experts.Backward(in.weights, acts_, d_out);
    auto tg = transport_.DispatchBackward(eg.input, stats);
    DispatchGradients g;
    g.x = tg.x;
    g.weights = std::move(tg.weights);
    g.experts = eg.weights;
    return g;
  }

 private:
  // CombineBackward keeps the weight gradients that DispatchBackward completes.
  mutable Transport transport_;
  moe::ExpertActivations acts_;
  Tensor expert_out_;  // rows computed by this rank
};

// What every dispatcher is built from.
struct DispatcherSetup {
  std::shared_ptr<ProcessGroups> groups;
  moe::LayerConfig config;
  ParallelOptions options;  // mesh resolved
  int shards = 1;           // n: H-shards per expert
  int64_t local_experts = 1;
  bool dedup = false;  // DeepSpeed's TP de-duplication
};

// r = 0 (every rank computes on the full weights).
std::unique_ptr<Dispatcher> MakeLocalDispatcher(const DispatcherSetup& setup);
// options.dispatch kAllToAll / kAllToAllV.
std::unique_ptr<Dispatcher> MakeExchangeDispatcher(const DispatcherSetup& setup);
// options.dispatch kAllGather.
std::unique_ptr<Dispatcher> MakeAllGatherDispatcher(const DispatcherSetup& setup);

// ---- Shared by the buffer dispatchers (local, exchange): they encode the plan's buffer
// [plan.num_rows, M] (moe::Dispatch), get the experts' outputs back in the same layout and decode
// it (moe::Combine). ----

// DeepSpeed's TP de-duplication: this rank's share of every expert's rows (1 share without it).
struct TpShare {
  int shares = 1;
  int share = 0;
};
TpShare TpShareOf(ProcessGroups& groups, bool dedup);

// The step of a buffer dispatcher. The subclass runs the experts into out_buf_ (the outputs in
// the plan's buffer layout) and Decode() combines them; the backward is decode backward ->
// ExpertsBackward (the subclass's transfers and experts in reverse) -> the other tp shares' rows
// -> encode backward.
class BufferStep : public DispatchStep {
 public:
  BufferStep(ProcessGroups& groups, bool dedup, bool prescore)
      : groups_(groups), dedup_(dedup), prescore_(prescore) {}

  DispatchGradients Backward(const StepInput& in, const ExpertKernels& experts, const Tensor& dy,
                             CommStats* stats) const final;

 protected:
  // With de-duplication the other tp shares' rows are all-gathered into out_buf_; then it is
  // decoded into y [T, M] with the plan's combine weights. Collective over tp.
  Tensor Decode(const StepInput& in, int threads, CommStats* stats) const;
  // Gradient of the outputs -> of the inputs, both in the buffer layout; sets or adds the
  // expert weight gradients into *grads. Collective.
  virtual Tensor ExpertsBackward(const StepInput& in, const ExpertKernels& experts,
                                 const Tensor& d_out, moe::ExpertWeights* grads,
                                 CommStats* stats) const = 0;

  ProcessGroups& groups_;
  bool dedup_, prescore_;
  Tensor out_buf_;  // expert outputs in the plan's buffer layout
};

// dst += src, float32 tensors of the same size.
void AddInto(const Tensor& dst, const Tensor& src);

}  // namespace switchyard::parallel::internal
