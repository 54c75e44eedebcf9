// The dense pieces of the transformer, each with its forward and backward written with the
// project's kernels (kernels/gemm.h, kernels/ops.h).
//
// Conventions shared by every piece:
// - Activations are float32 tensors [num_tokens, dim] (batch and sequence flattened, sequence
//   fastest: token t of sequence b is row b * seq_len + t).
// - Parameters live in a ParameterSet under "<prefix><name>" with PyTorch's names and layouts
//   (Linear.weight [out_dim, in_dim]), so "blocks.0.attn." + "qkv.weight".
// - Forward returns the output and, when given a cache pointer, keeps what Backward needs in it.
//   Backward *accumulates* (+=) the parameter gradients into Parameter::grad and returns the
//   gradient of the input. Gradients are zeroed by ParameterSet::ZeroGrad at the start of a step.
// - Thread-safety: Forward may run concurrently on different inputs; Backward writes the shared
//   gradients, so one Backward at a time per module. `threads` is the caller's compute budget
//   (core/threading.h); BLAS threading is the process's setting (kernels::SetBlasThreads).
#pragma once

#include <cstdint>
#include <string>

#include "switchyard/core/tensor.h"
#include "switchyard/train/mixed_precision.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

// y [num_tokens, out_dim] = x [num_tokens, in_dim] · weight^T + bias.
// "<prefix>weight" [out_dim, in_dim] ~ N(0, init_std^2) (weight decay on), "<prefix>bias"
// [out_dim] = 0 (when `bias`).
class Linear {
 public:
  Linear(ParameterSet& params, const std::string& prefix, int64_t in_dim, int64_t out_dim,
         bool bias, float init_std, uint64_t seed);

  int64_t in_dim() const { return in_dim_; }
  int64_t out_dim() const { return out_dim_; }
  Parameter& weight() const { return *weight_; }
  Parameter* bias() const { return bias_; }

  // x float32 or bfloat16. With a bfloat16 x or Precision::kBFloat16 the product takes x and the
  // weight as bfloat16 values and accumulates in float32 (mixed_precision.h); y is float32.
  Tensor Forward(const Tensor& x, int threads = 1, Precision precision = Precision::kFloat32) const;
  // dy [num_tokens, out_dim], x the forward's input (float32, or bfloat16: then dy and the weight
  // enter the products as bfloat16 values too). Accumulates weight/bias gradients (float32) and
  // returns dx [num_tokens, in_dim] (float32).
  Tensor Backward(const Tensor& x, const Tensor& dy, int threads = 1) const;

 private:
  Tensor BackwardBFloat16(const Tensor& x, const Tensor& dy, int threads) const;

  int64_t in_dim_;
  int64_t out_dim_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

// Rows of a table selected by token id: y[t] = weight[ids[t]].
// "<prefix>weight" [num_embeddings, dim] ~ N(0, init_std^2).
class Embedding {
 public:
  Embedding(ParameterSet& params, const std::string& prefix, int64_t num_embeddings, int64_t dim,
            float init_std, uint64_t seed);

  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t dim() const { return dim_; }
  Parameter& weight() const { return *weight_; }

  // ids int32 [num_tokens], each in [0, num_embeddings) (InvalidArgument naming the position
  // otherwise) -> [num_tokens, dim].
  Tensor Forward(const Tensor& ids) const;
  // weight.grad[ids[t]] += dy[t], in order of t (deterministic).
  void Backward(const Tensor& ids, const Tensor& dy) const;

 private:
  int64_t num_embeddings_;
  int64_t dim_;
  Parameter* weight_;
};

enum class NormKind : uint8_t {
  kLayerNorm,  // (x - mean) / sqrt(var + eps) * weight + bias
  kRmsNorm     // x / sqrt(mean(x^2) + eps) * weight
};
// "layernorm" | "rmsnorm"; InvalidArgument otherwise.
NormKind NormKindFromName(std::string_view name);
std::string_view NormKindName(NormKind kind);

struct NormCache {
  Tensor x;     // [num_tokens, dim] input (float32, or bfloat16 under mixed precision)
  Tensor mean;  // [num_tokens] (LayerNorm only)
  Tensor rstd;  // [num_tokens] 1 / sqrt(var + eps) or 1 / rms
};

// Normalization over the last dimension. "<prefix>weight" [dim] = 1, and for LayerNorm
// "<prefix>bias" [dim] = 0 (no weight decay on either). `eps` is added to the variance (mean
// square for RMSNorm): kEps by default, the model's `rms_norm_eps` for the Hugging Face families.
class Norm {
 public:
  static constexpr float kEps = 1e-5f;

  Norm(ParameterSet& params, const std::string& prefix, int64_t dim, NormKind kind,
       float eps = kEps);

  float eps() const { return eps_; }
  NormKind kind() const { return kind_; }
  Tensor Forward(const Tensor& x, NormCache* cache, int threads = 1) const;
  Tensor Backward(const NormCache& cache, const Tensor& dy, int threads = 1) const;

 private:
  int64_t dim_;
  NormKind kind_;
  float eps_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

// Under bfloat16 mixed precision every tensor here is bfloat16. Selective recomputation keeps x
// and qkv only (probs and att undefined, recomputed from qkv in backward).
struct AttentionCache {
  Tensor x;      // [num_tokens, model_dim] input
  Tensor qkv;    // [num_tokens, 3 * model_dim]: q | k | v, head h at columns h * head_dim
  Tensor probs;  // [batch_size, num_heads, seq_len, seq_len] causal softmax (zero above diagonal)
  Tensor att;    // [num_tokens, model_dim] heads' outputs, concatenated, before the projection
  int64_t batch_size = 0;
};

// The attention core on num_heads heads: qkv [batch_size * seq_len, 3 * D] laid out q | k | v
// (D = num_heads * head_dim; head h at columns [h * head_dim, (h + 1) * head_dim) of each part).
// Per sequence and head: att = softmax(q k^T / sqrt(head_dim), causal) v. Returns att
// [num_tokens, D] and, when `probs` is non-null, the causal softmax [batch_size, num_heads,
// seq_len, seq_len] (zero above the diagonal) Backward needs.
Tensor CausalAttentionForward(const Tensor& qkv, int64_t batch_size, int64_t num_heads, int threads,
                              Tensor* probs);
// d(qkv) [num_tokens, 3 * D] (float32) from datt [num_tokens, D], the forward's qkv and probs
// (bfloat16 qkv and probs: every product's operands rounded to bfloat16 values, float32 sums).
Tensor CausalAttentionBackward(const Tensor& qkv, const Tensor& probs, const Tensor& datt,
                               int64_t batch_size, int64_t num_heads, int threads);

// Causal multi-head self-attention (GPT-2 layout):
//   qkv = x · qkv.weight^T + qkv.bias, split into q, k, v and into num_heads heads of head_dim;
//   per sequence and head: att = softmax(q k^T / sqrt(head_dim), causal) v;
//   y = att · proj.weight^T + proj.bias.
// "<prefix>qkv.weight" [3 * model_dim, model_dim], "<prefix>qkv.bias" [3 * model_dim],
// "<prefix>proj.weight" [model_dim, model_dim] (init std `proj_init_std`), "<prefix>proj.bias".
class CausalSelfAttention {
 public:
  CausalSelfAttention(ParameterSet& params, const std::string& prefix, int64_t model_dim,
                      int64_t num_heads, float init_std, float proj_init_std, uint64_t seed);

  int64_t num_heads() const { return num_heads_; }
  // The projections, for a caller that runs another attention core between them (context
  // parallelism).
  const Linear& qkv() const { return qkv_; }
  const Linear& proj() const { return proj_; }

  // x [batch_size * seq_len, model_dim]; num_tokens must divide by batch_size. With
  // Precision::kBFloat16 the cache holds bfloat16 tensors (mixed_precision.h).
  Tensor Forward(const Tensor& x, int64_t batch_size, int threads, AttentionCache* cache,
                 Precision precision = Precision::kFloat32) const;
  Tensor Backward(const AttentionCache& cache, const Tensor& dy, int threads) const;

 private:
  int64_t model_dim_;
  int64_t num_heads_;
  Linear qkv_;
  Linear proj_;
};

// Mean softmax cross-entropy over the tokens whose target is >= 0 (targets < 0 are ignored, as
// PyTorch's ignore_index).
struct CrossEntropyResult {
  double loss = 0;    // mean over counted tokens (0 if none)
  int64_t count = 0;  // counted tokens
};
// logits [num_tokens, vocab_size], targets int32 [num_tokens] (< vocab_size). With `dlogits`
// non-null it is set to scale * d(loss)/d(logits) = scale * (softmax - onehot) / count
// ([num_tokens, vocab_size], zero rows for ignored tokens).
CrossEntropyResult SoftmaxCrossEntropy(const Tensor& logits, const Tensor& targets, Tensor* dlogits,
                                       float scale = 1.0f, int threads = 1);

}  // namespace switchyard::train
