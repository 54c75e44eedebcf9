// The MoE layer (moe::MoeLayer, docs/moe.md) as the FFN of a transformer block.
//
// Parameters are moe::ParamShapes' tensors under the block's prefix ("blocks.3.moe." +
// "gate.weight", "experts.fc1.weight" [E, H, M], ...), sharing storage with the layer's
// LayerParams: expert tensors ("experts.*") are ParamGroup::kExpert, everything else dense;
// matrices get weight decay, biases do not; "gate.expert_bias" (aux-loss-free balancing) is a
// buffer, updated by EndStep from the step's global expert loads.
//
// The objective term is aux_loss_coef * l_aux + z_loss_coef * z_loss (the layer's config).
// Evaluation passes (context.training = false) run the same layer without gate noise or random
// routing (moe::ForwardOptions::training).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "switchyard/train/aux_counts.h"
#include "switchyard/train/feed_forward.h"

namespace switchyard::train {

class MoeFeedForward : public FeedForward {
 public:
  // Validates the config (InvalidArgument). Parameters are initialized by moe::InitParams with
  // a seed derived from `seed` and `prefix`.
  MoeFeedForward(ParameterSet& params, const std::string& prefix, moe::LayerConfig config,
                 uint64_t seed);

  bool is_moe() const override { return true; }
  int64_t num_experts() const override { return layer_.config().num_experts; }
  const moe::LayerConfig& config() const { return layer_.config(); }

  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override;
  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override;
  void EndStep(std::span<const int64_t> global_expert_counts) override;
  void SetRouterTrace(RouterTrace* trace) override { router_trace_ = trace; }
  FeedForwardTimes TakeTimes() override;

 private:
  moe::MoeLayer layer_;  // training and evaluation passes (the call's flag)
  moe::LayerParams layer_params_;
  std::string prefix_;
  ParameterSet* params_;
  FeedForwardTimes times_;
  StepAuxCounts aux_counts_;  // aux_loss global
  RouterTrace* router_trace_ = nullptr;
};

// Builds MoeFeedForward FFNs from `config` (model_dim etc. as given; seed keys routing draws).
FeedForwardFactory MoeFeedForwardFactory(const moe::LayerConfig& config);
// Builds the MoE FFN of transformer block `block` from config_of_block(block) (per-block expert
// counts, PR-MoE's pyramid).
FeedForwardFactory MoeFeedForwardFactory(
    std::function<moe::LayerConfig(int64_t block)> config_of_block);

// Points the tensors of `layer` at the current values of the parameters "<prefix><name>" of
// `params` (the names moe::ParamsToMap gives). An MoE FFN keeps its weights in a LayerParams that
// shares storage with its parameters; when an optimizer moves the parameters' values into buffers
// of its own (ShardedAdamW), the FFN calls this before using the LayerParams.
void RebindLayerParams(const ParameterSet& params, const std::string& prefix,
                       moe::LayerParams* layer);

// The FFN output of one MoE layer call: y, the loss terms (with the config's coefficients) and
// the routing statistics of the call's `num_tokens` tokens (aux_loss hf_concat: the layer's
// sums in routing.concat_sums and no aux term: the concatenation's is the caller's), with the range
// of `expert_bias` ([E] float32, or undefined) the call routed with. Shared by the single-rank and
// parallel MoE FFNs. aux_loss hf_concat: the sums a Backward uses (null: the layer's own rows).
// InternalError when the trainer has not filled them in yet.
const moe::RouterLoadSums* ConcatTotalsOf(const std::shared_ptr<const ConcatAuxTotals>& totals);

FeedForwardOutput MoeFeedForwardOutput(const moe::LayerConfig& config, const moe::LayerOutput& out,
                                       int64_t num_tokens, const Tensor& expert_bias);

}  // namespace switchyard::train
