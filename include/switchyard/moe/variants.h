// The dense parts of an MoE layer around its experts (docs/moe.md, "Variants"):
//   residual_moe (PR-MoE, DeepSpeed)      y = moe(x) * c0 + mlp(x) * c1, c = softmax(x Wc^T + bc)
//   shared_expert_hidden > 0 (DeepSeek)   y += shared_mlp(x)
// Both are per token and dense: every rank holds their full parameters and applies them to its
// own tokens, so moe::MoeLayer and the parallel layer run the same code. On several ranks their
// parameter gradients are summed over the token shards, like the gate's.
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/experts.h"
#include "switchyard/moe/layer.h"

namespace switchyard::moe {

// True when the config has a residual MLP or a shared expert.
inline bool HasVariants(const LayerConfig& config) {
  return config.residual_moe || config.shared_expert_hidden > 0;
}

// What the variants' backward needs.
struct VariantState {
  Tensor moe_y, mlp_y, coef;  // residual_moe: [T, M], [T, M], [T, 2] softmax coefficients
  ExpertActivations residual, shared;
};

// x [T, M] float32 (the layer's input), moe_y [T, M] float32 (the experts' combined output) ->
// the layer's output y [T, M] float32 (moe_y itself without variants). `params` holds the
// variants' parameters (residual_mlp, coefficient_*, shared_mlp as ParamShapes names them).
Tensor VariantsForward(const LayerConfig& config, const LayerParams& params, const Tensor& x,
                       const Tensor& moe_y, VariantState* state, int threads);

struct VariantGradients {
  Tensor d_moe_y;  // [T, M] gradient of the experts' combined output (dy without residual_moe)
  Tensor x;        // [T, M] the variants' part of the input gradient (zeros without variants)
};

// dy [T, M] float32 -> the gradients; sets grads->residual_mlp, coefficient_weight,
// coefficient_bias and shared_mlp (those the config has).
VariantGradients VariantsBackward(const LayerConfig& config, const LayerParams& params,
                                  const VariantState& state, const Tensor& x, const Tensor& dy,
                                  LayerParams* grads, int threads);

}  // namespace switchyard::moe
