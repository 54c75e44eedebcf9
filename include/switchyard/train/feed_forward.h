// The FFN of a transformer block behind one small interface, so that a block's FFN is either
// the dense MLP below or an MoE layer (moe::MoeLayer, adapted in the layer above train's
// dependencies) without the model knowing which.
//
// Contract of every implementation:
// - Parameters are registered in the model's ParameterSet under the prefix the factory gets
//   ("blocks.3.mlp." for dense, "blocks.3.moe." for MoE: "blocks.3.moe.gate.weight",
//   "blocks.3.moe.experts.fc1.weight", ...), expert parameters with ParamGroup::kExpert.
// - Forward(x [num_tokens, model_dim]) returns y of the same shape plus any auxiliary loss the
//   FFN adds to the training objective (`loss`, already multiplied by its coefficients) and
//   routing statistics. Backward(forward, dy) accumulates the gradients of
//   sum(y * dy) + loss_scale * loss into the parameters' grads and returns dx.
// - Thread-safety: as the pieces of layers.h (Backward writes the shared gradients).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/moe/router_load_loss.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

// Wall time an FFN spent in Forward and Backward, and the part of it blocked in communication.
struct FeedForwardTimes {
  double seconds = 0;
  double comm_seconds = 0;
  FeedForwardTimes& operator+=(const FeedForwardTimes& o) {
    seconds += o.seconds;
    comm_seconds += o.comm_seconds;
    return *this;
  }
};

// aux_loss hf_concat: the router sums of the whole concatenation one micro-batch's forward makes
// (every MoE block of every stage, every rank of the batch), which the trainer fills in after
// the forward and before the backward of that micro-batch; the MoE FFNs' Backward reads it.
struct ConcatAuxTotals {
  moe::RouterLoadSums sums;
  bool ready = false;
};

// Per-call settings of a forward pass.
struct FeedForwardContext {
  int64_t global_token_offset = 0;  // global index of local token 0 (keys random routing draws)
  // [num_tokens] the global index of each local token (its place in the one-rank order), where
  // the rows are not a contiguous range of it (context parallelism); null: global_token_offset +
  // row. MoE FFNs route in this order and key their random draws by it.
  std::shared_ptr<const std::vector<int64_t>> token_index;
  // [num_tokens gathered over tp] each row's position in its sequence (global under context
  // parallelism), for the blocks' rotary embeddings; null when the model has none. FFNs ignore it.
  std::shared_ptr<const std::vector<int64_t>> positions;
  uint64_t step = 0;  // training step (keys random routing draws)
  bool training = true;
  bool save_for_backward = true;
  int threads = 1;
  // bfloat16 mixed precision (mixed_precision.h): the dense MLP keeps bfloat16 activations and
  // multiplies bfloat16 operands; MoE FFNs run in float32 whatever this says.
  Precision precision = Precision::kFloat32;
  // aux_loss hf_concat: where this micro-batch's concatenation sums will be (kept by the MoE
  // FFNs' state for Backward); null: each layer's own rows.
  std::shared_ptr<const ConcatAuxTotals> concat_totals;
};

// Routing statistics of one MoE forward (empty for a dense FFN).
struct RoutingStats {
  std::vector<int64_t> expert_loads;   // [num_experts] routed (token, choice) pairs per expert
  std::vector<int64_t> expert_counts;  // [num_experts] pairs kept (after capacity drops)
  int64_t routed = 0;                  // routed pairs (num_tokens * top_k)
  int64_t dropped = 0;                 // pairs dropped for capacity
  int64_t num_tokens = 0;              // tokens routed by this call
  double entropy_sum = 0;  // sum over the tokens of the router entropy (moe/router_stats.h)
  double l_aux = 0;        // the balancing loss, before its coefficient
  double z_loss = 0;       // the z-loss, before its coefficient
  double bias_min = 0;     // the range of the expert bias the call routed with (0, 0: none)
  double bias_max = 0;
  // aux_loss hf_concat: the call's router sums (the whole batch's, over its ranks), its part of
  // the concatenation; empty sums otherwise.
  moe::RouterLoadSums concat_sums;
  // With the layer's check_finite: non-finite elements of the layer's input on this rank
  // (reported, not thrown, so that every rank stops at the same point: Trainer::Step).
  int64_t nonfinite_inputs = 0;
};

struct FeedForwardOutput {
  Tensor y;                           // [num_tokens, model_dim]
  double loss = 0;                    // auxiliary loss term added to the objective (coefs applied)
  double aux_loss = 0;                // load-balancing loss l_aux, before its coefficient (MoE)
  double z_loss = 0;                  // router z-loss, before its coefficient (MoE)
  RoutingStats routing;               // empty for dense
  std::shared_ptr<const void> state;  // what Backward needs (implementation-defined)
};

class RouterTrace;  // router_trace.h

class FeedForward {
 public:
  virtual ~FeedForward() = default;

  // True for an MoE layer (its routing statistics are reported per step).
  virtual bool is_moe() const = 0;
  // Experts of an MoE layer (global), 0 for dense.
  virtual int64_t num_experts() const { return 0; }

  virtual FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) = 0;
  // dy [num_tokens, model_dim]; `forward` from Forward with save_for_backward. `loss_scale`
  // multiplies the gradient of the auxiliary loss term (the objective's weight on it).
  virtual Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                          int threads) = 0;
  // After the optimizer step, with the (token, choice) pairs each expert kept in the step
  // ([num_experts], after capacity drops, summed over every micro-batch and every rank): state
  // updates that are not gradient steps (aux-loss-free expert bias, Megatron-Core's rule).
  virtual void EndStep(std::span<const int64_t> global_expert_counts) {}
  // MoE FFNs: record or replay routes through `trace` (router_trace.h; null: neither). The trace
  // must outlive the FFN's calls.
  virtual void SetRouterTrace(RouterTrace* trace) {}
  // The time spent since the last call (zero for FFNs that do not measure it), then restarts.
  virtual FeedForwardTimes TakeTimes() { return {}; }
  // Appends the tensors `forward` keeps for Backward (for counting saved activation bytes);
  // FFNs whose state is opaque to the train layer (the MoE layers) append nothing.
  virtual void SavedTensors(const FeedForwardOutput& forward, std::vector<Tensor>* out) const {}
};

// Builds the FFN of block `block_index`. `prefix` is where its parameters go (e.g.
// "blocks.3.moe."); `seed` keys its initialization.
using FeedForwardFactory = std::function<std::unique_ptr<FeedForward>(
    int64_t block_index, const std::string& prefix, ParameterSet& params, uint64_t seed)>;

// The dense MLP: y = fc2(act(fc1(x))), "<prefix>fc1.weight" [hidden_dim, model_dim],
// "<prefix>fc1.bias" [hidden_dim], "<prefix>fc2.weight" [model_dim, hidden_dim],
// "<prefix>fc2.bias" [model_dim].
class DenseFeedForward : public FeedForward {
 public:
  DenseFeedForward(ParameterSet& params, const std::string& prefix, int64_t model_dim,
                   int64_t hidden_dim, kernels::Activation activation, float init_std,
                   float out_init_std, uint64_t seed);

  bool is_moe() const override { return false; }
  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override;
  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override;
  void SavedTensors(const FeedForwardOutput& forward, std::vector<Tensor>* out) const override;

 private:
  kernels::Activation activation_;
  Linear fc1_;
  Linear fc2_;
};

}  // namespace switchyard::train
