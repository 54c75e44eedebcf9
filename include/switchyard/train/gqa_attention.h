// Grouped-query causal self-attention of the Hugging Face Llama-style families (Mixtral, Qwen2,
// Qwen2-MoE, OLMoE; multi-head attention is num_kv_heads = num_heads), with Hugging Face's
// parameter names:
//   q = q_proj(x) [T, H * d], k = k_proj(x) [T, KV * d], v = v_proj(x) [T, KV * d]
//   qk_norm (OLMoE): q = q_norm(q), k = k_norm(k), RMSNorm over the whole projected q and k
//   q, k = RoPE(q, positions), RoPE(k, positions)            (train/rope.h, each head)
//   query head h attends with kv head h / (H / KV)           (Hugging Face's repeat_kv)
//   att = softmax(q k^T / sqrt(d), causal) v per sequence and query head
//   y = o_proj(att)
// "<prefix>q_proj.weight" [H * d, M], "<prefix>k_proj.weight" [KV * d, M], "<prefix>v_proj.weight"
// [KV * d, M], "<prefix>o_proj.weight" [M, H * d]; with qkv_bias (Qwen2) also "<prefix>q_proj.bias"
// [H * d], k_proj.bias, v_proj.bias [KV * d]; with qk_norm "<prefix>q_norm.weight" [H * d],
// "<prefix>k_norm.weight" [KV * d].
//
// The attention core is the project's (CausalAttentionForward/Backward of train/layers.h): the
// projections produce the core's q | k | v layout with the kv heads repeated (ProjectQkv) and the
// core's d(qkv) is summed back over the repeats (ProjectQkvBackward), so a caller may run any core
// that takes that layout between them (ContextParallelAttention for cp, with the global
// positions of the rank's tokens).
//
// Conventions as train/layers.h: float32 activations [num_tokens, ...], batch-major rows;
// Backward accumulates the parameters' gradients. Thread-safety: Forward is reentrant; one
// Backward at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

struct GqaOptions {
  int64_t model_dim = 0;     // M
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // KV: divides H (0: H)
  int64_t head_dim = 0;      // d: 0 means model_dim / num_heads (which must divide)
  double rope_theta = 10000.0;
  bool rope = true;
  bool qkv_bias = false;  // Qwen2: biases on q, k and v (never on o)
  bool qk_norm = false;   // OLMoE: RMSNorm of the projected q and k
  float norm_eps = 1e-6f;
  float init_std = 0.02f;
  float o_init_std = 0.02f;
  uint64_t seed = 0;
};

struct GqaCache {
  Tensor x;                        // [T, M]
  NormCache q_norm, k_norm;        // qk_norm only
  Tensor qkv;                      // [T, 3 * H * d] the core's input (kv heads repeated)
  Tensor probs;                    // the core's softmax (CausalAttentionForward)
  Tensor att;                      // [T, H * d] the core's output
  std::vector<int64_t> positions;  // [T]
  int64_t batch_size = 0;
};

class GroupedQueryAttention {
 public:
  // InvalidArgument naming `prefix` and the key when num_kv_heads does not divide num_heads, the
  // head_dim is odd (RoPE) or does not follow from model_dim / num_heads.
  GroupedQueryAttention(ParameterSet& params, const std::string& prefix, GqaOptions options);

  const GqaOptions& options() const { return options_; }
  int64_t q_dim() const { return options_.num_heads * options_.head_dim; }
  int64_t kv_dim() const { return options_.num_kv_heads * options_.head_dim; }

  // x [T, M], positions [T] (each token's position in its sequence; global under cp) ->
  // qkv [T, 3 * H * d] in the core's layout. Fills cache->x, q_norm, k_norm, positions.
  Tensor ProjectQkv(const Tensor& x, std::span<const int64_t> positions, GqaCache* cache,
                    int threads = 1) const;
  // d(qkv) [T, 3 * H * d] (the core's backward) -> dx [T, M]; accumulates the projections' (and
  // norms') gradients.
  Tensor ProjectQkvBackward(const GqaCache& cache, const Tensor& dqkv, int threads = 1) const;

  // The whole layer on one rank: x [batch_size * seq_len, M] -> y [batch_size * seq_len, M].
  // positions empty: 0 .. seq_len - 1 in every sequence.
  Tensor Forward(const Tensor& x, int64_t batch_size, std::span<const int64_t> positions,
                 GqaCache* cache, int threads = 1) const;
  Tensor Backward(const GqaCache& cache, const Tensor& dy, int threads = 1) const;

 private:
  GqaOptions options_;
  Linear q_;
  Linear k_;
  Linear v_;
  Linear o_;
  std::unique_ptr<Norm> q_norm_;
  std::unique_ptr<Norm> k_norm_;
};

}  // namespace switchyard::train
