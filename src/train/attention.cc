// Causal multi-head self-attention: per (sequence, head) GEMMs on strided views of qkv.
#include <algorithm>
#include <cmath>
#include <vector>

#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/train/layers.h"
#include "train/parallel_for.h"

namespace switchyard::train {

using kernels::Trans;

CausalSelfAttention::CausalSelfAttention(ParameterSet& params, const std::string& prefix,
                                         int64_t model_dim, int64_t num_heads, float init_std,
                                         float proj_init_std, uint64_t seed)
    : model_dim_(model_dim),
      num_heads_(num_heads),
      qkv_(params, prefix + "qkv.", model_dim, 3 * model_dim, true, init_std, seed),
      proj_(params, prefix + "proj.", model_dim, model_dim, true, proj_init_std, seed) {
  SY_REQUIRE(num_heads > 0 && model_dim % num_heads == 0, InvalidArgument,
             "{}: num_heads {} must be positive and divide model_dim {}", prefix, num_heads,
             model_dim);
}

Tensor CausalAttentionForward(const Tensor& qkv, int64_t batch_size, int64_t num_heads, int threads,
                              Tensor* probs_out) {
  SY_REQUIRE(batch_size > 0 && num_heads > 0 && qkv.defined() && qkv.dim() == 2 &&
                 qkv.size(0) % batch_size == 0 && qkv.size(1) % (3 * num_heads) == 0,
             InvalidArgument,
             "attention qkv: expected [batch_size * seq_len, 3 * num_heads * head_dim] with "
             "batch_size {} and num_heads {}, got {}",
             batch_size, num_heads, qkv.defined() ? ShapeToString(qkv.shape()) : "undefined");
  const bool bf16 = qkv.dtype() == DType::kBFloat16;  // mixed precision
  const Tensor qkv_values = ToFloat32(qkv, threads);
  const int64_t m = qkv.size(1) / 3, heads = num_heads, hd = m / heads;
  const int64_t seq = qkv.size(0) / batch_size;
  Tensor probs = Tensor::Empty({batch_size, heads, seq, seq});
  Tensor att = Tensor::Empty({qkv.size(0), m});
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qkvp = qkv_values.data<float>();
  float* pp = probs.data<float>();
  float* ap = att.data<float>();
  ParallelFor(batch_size * heads, threads, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      int64_t b = bh / heads, h = bh % heads;
      const float* q = qkvp + b * seq * 3 * m + h * hd;
      const float* k = q + m;
      const float* v = q + 2 * m;
      float* p = pp + bh * seq * seq;
      // scores = q k^T * scale; only the causal (lower) triangle is used.
      kernels::Gemm(Trans::kNo, Trans::kYes, seq, seq, hd, scale, q, 3 * m, k, 3 * m, 0.0f, p, seq);
      for (int64_t i = 0; i < seq; ++i) {
        float* row = p + i * seq;
        kernels::SoftmaxRows(row, row, 1, i + 1);
        if (bf16) RoundToBFloat16(row, i + 1);  // the product's operand (and what is kept)
        std::fill(row + i + 1, row + seq, 0.0f);
      }
      kernels::Gemm(Trans::kNo, Trans::kNo, seq, hd, seq, 1.0f, p, seq, v, 3 * m, 0.0f,
                    ap + b * seq * m + h * hd, m);
    }
  });
  if (probs_out != nullptr) *probs_out = bf16 ? ToBFloat16(probs, threads) : probs;
  return att;
}

Tensor CausalAttentionBackward(const Tensor& qkv, const Tensor& probs, const Tensor& datt,
                               int64_t batch_size, int64_t num_heads, int threads) {
  const int64_t num_tokens = qkv.size(0), m = qkv.size(1) / 3, heads = num_heads, hd = m / heads;
  const int64_t seq = num_tokens / batch_size;
  ExpectShape("attention probs", probs, {batch_size, heads, seq, seq});
  ExpectShape("attention datt", datt, {num_tokens, m});
  Tensor dqkv = Tensor::Empty({num_tokens, 3 * m});
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // Mixed precision: bfloat16 qkv and probs, datt and dS enter the products as bfloat16 values.
  const bool bf16 = qkv.dtype() == DType::kBFloat16;
  const Tensor qkv_values = ToFloat32(qkv, threads), probs_values = ToFloat32(probs, threads);
  const Tensor datt_values = bf16 ? BFloat16Values(datt, threads) : datt;
  const float* qkvp = qkv_values.data<float>();
  const float* pp = probs_values.data<float>();
  const float* dap = datt_values.data<float>();
  float* dqkvp = dqkv.data<float>();
  ParallelFor(batch_size * heads, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> dp(static_cast<size_t>(seq * seq));
    for (int64_t bh = begin; bh < end; ++bh) {
      int64_t b = bh / heads, h = bh % heads;
      int64_t off = b * seq * 3 * m + h * hd;
      const float* q = qkvp + off;
      const float* k = q + m;
      const float* v = q + 2 * m;
      float* dq = dqkvp + off;
      float* dk = dq + m;
      float* dv = dq + 2 * m;
      const float* p = pp + bh * seq * seq;
      const float* da = dap + b * seq * m + h * hd;
      // dP = dA v^T; dV = P^T dA.
      kernels::Gemm(Trans::kNo, Trans::kYes, seq, seq, hd, 1.0f, da, m, v, 3 * m, 0.0f, dp.data(),
                    seq);
      kernels::Gemm(Trans::kYes, Trans::kNo, seq, hd, seq, 1.0f, p, seq, da, m, 0.0f, dv, 3 * m);
      // dS = softmax backward over the causal part of each row (zero above the diagonal).
      for (int64_t i = 0; i < seq; ++i) {
        float* row = dp.data() + i * seq;
        kernels::SoftmaxRowsBackward(p + i * seq, row, row, 1, i + 1);
        if (bf16) RoundToBFloat16(row, i + 1);
        std::fill(row + i + 1, row + seq, 0.0f);
      }
      // dQ = dS k * scale; dK = dS^T q * scale.
      kernels::Gemm(Trans::kNo, Trans::kNo, seq, hd, seq, scale, dp.data(), seq, k, 3 * m, 0.0f, dq,
                    3 * m);
      kernels::Gemm(Trans::kYes, Trans::kNo, seq, hd, seq, scale, dp.data(), seq, q, 3 * m, 0.0f,
                    dk, 3 * m);
    }
  });
  return dqkv;
}

Tensor CausalSelfAttention::Forward(const Tensor& x, int64_t batch_size, int threads,
                                    AttentionCache* cache, Precision precision) const {
  SY_REQUIRE(batch_size > 0 && x.defined() && x.dim() == 2 && x.size(0) % batch_size == 0,
             InvalidArgument,
             "attention x: expected [batch_size * seq_len, model_dim] with batch_size {}, got {}",
             batch_size, x.defined() ? ShapeToString(x.shape()) : "undefined");
  if (precision == Precision::kBFloat16) {
    // Every tensor the backward keeps is bfloat16; the products see bfloat16 values.
    Tensor xb = ToBFloat16(x, threads);
    Tensor qkv = ToBFloat16(qkv_.Forward(xb, threads), threads);
    Tensor probs;
    Tensor att = ToBFloat16(
        CausalAttentionForward(qkv, batch_size, num_heads_, threads, cache ? &probs : nullptr),
        threads);
    Tensor y = proj_.Forward(att, threads);
    if (cache != nullptr) *cache = AttentionCache{xb, qkv, probs, att, batch_size};
    return y;
  }
  Tensor qkv = qkv_.Forward(x, threads);
  Tensor probs;
  Tensor att = CausalAttentionForward(qkv, batch_size, num_heads_, threads, &probs);
  Tensor y = proj_.Forward(att, threads);
  if (cache != nullptr) *cache = AttentionCache{x, qkv, probs, att, batch_size};
  return y;
}

Tensor CausalSelfAttention::Backward(const AttentionCache& cache, const Tensor& dy,
                                     int threads) const {
  ExpectShape("attention dy", dy, {cache.x.size(0), model_dim_});
  Tensor datt = proj_.Backward(cache.att, dy, threads);
  Tensor dqkv =
      CausalAttentionBackward(cache.qkv, cache.probs, datt, cache.batch_size, num_heads_, threads);
  return qkv_.Backward(cache.x, dqkv, threads);
}

}  // namespace switchyard::train
