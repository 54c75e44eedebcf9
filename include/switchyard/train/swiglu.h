// The SwiGLU MLP of Llama-style models (Llama, Mixtral's experts, Qwen2(-MoE), OLMoE), with Hugging
// Face's parameter names and no biases:
//   y = down_proj( silu(gate_proj(x)) * up_proj(x) )
// "<prefix>gate_proj.weight" [intermediate_size, model_dim], "<prefix>up_proj.weight" [same],
// "<prefix>down_proj.weight" [model_dim, intermediate_size]. Conventions as train/layers.h
// (float32 activations, Backward accumulates into the parameters' gradients).
#pragma once

#include <cstdint>
#include <string>

#include "switchyard/core/tensor.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

struct SwiGluCache {
  Tensor x;     // [num_tokens, model_dim] the input
  Tensor gate;  // [num_tokens, intermediate_size] gate_proj(x), before silu
  Tensor up;    // [num_tokens, intermediate_size] up_proj(x)
  Tensor h;     // [num_tokens, intermediate_size] silu(gate) * up, down_proj's input
};

class SwiGluMlp {
 public:
  // Weights ~ N(0, init_std^2) (down_proj: down_init_std), each keyed by its name and `seed`.
  SwiGluMlp(ParameterSet& params, const std::string& prefix, int64_t model_dim,
            int64_t intermediate_size, float init_std, float down_init_std, uint64_t seed);

  int64_t model_dim() const { return gate_.in_dim(); }
  int64_t intermediate_size() const { return gate_.out_dim(); }

  // x [num_tokens, model_dim] float32 -> [num_tokens, model_dim].
  Tensor Forward(const Tensor& x, SwiGluCache* cache, int threads = 1) const;
  // dy [num_tokens, model_dim] -> dx; accumulates the three weights' gradients.
  Tensor Backward(const SwiGluCache& cache, const Tensor& dy, int threads = 1) const;

 private:
  Linear gate_;
  Linear up_;
  Linear down_;
};

struct GatedSharedExpertCache {
  SwiGluCache mlp;
  Tensor mlp_y;  // [num_tokens, model_dim] the shared expert's output
  Tensor gate;   // [num_tokens] sigmoid(x · shared_expert_gate.weight^T)
};

// The backward of the shared expert's per-token gate y = g * a (g [n] the sigmoid values, a
// [n, M]): d_a = g * dy and d_logit [n, 1] = (dy · a) g (1 - g), the gradient of the gate's logit.
void SigmoidGateBackward(const Tensor& gate, const Tensor& a, const Tensor& dy, Tensor* d_a,
                         Tensor* d_logit);

// Qwen2-MoE's shared expert: a SwiGLU MLP every token passes through, scaled per token by a
// sigmoid gate (the layer adds this to the routed experts' output):
//   y = sigmoid(x · w_g^T) * SwiGLU(x)
// "<prefix>shared_expert.gate_proj.weight" [Hs, M], ".up_proj.weight" [Hs, M],
// ".down_proj.weight" [M, Hs], "<prefix>shared_expert_gate.weight" [1, M] (prefix: the block's
// "mlp.", as Hugging Face's Qwen2MoeSparseMoeBlock). The MoE layer's own shared expert
// (moe::LayerConfig::shared_expert_hidden, DeepSeek's) has no gate and the routed experts'
// activation; this is the gated form, kept beside the MoE layer so its parameters carry Hugging
// Face's names.
class GatedSharedExpert {
 public:
  GatedSharedExpert(ParameterSet& params, const std::string& prefix, int64_t model_dim,
                    int64_t intermediate_size, float init_std, float down_init_std, uint64_t seed);

  Tensor Forward(const Tensor& x, GatedSharedExpertCache* cache, int threads = 1) const;
  Tensor Backward(const GatedSharedExpertCache& cache, const Tensor& dy, int threads = 1) const;

 private:
  SwiGluMlp mlp_;
  Linear gate_;
};

}  // namespace switchyard::train
