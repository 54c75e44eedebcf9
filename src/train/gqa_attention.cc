// Grouped-query attention: projections, QK-norm, RoPE and the kv-head repeat around the project's
// causal attention core.
#include "switchyard/train/gqa_attention.h"

#include <algorithm>
#include <cstring>

#include "switchyard/core/error.h"
#include "switchyard/train/rope.h"
#include "train/parallel_for.h"
#include "train/qkv_layout.h"

namespace switchyard::train {
namespace {

GqaOptions Resolve(GqaOptions o, const std::string& prefix) {
  SY_REQUIRE(o.model_dim > 0 && o.num_heads > 0, InvalidArgument,
             "{}: model_dim ({}) and num_heads ({}) must be positive", prefix, o.model_dim,
             o.num_heads);
  if (o.num_kv_heads == 0) o.num_kv_heads = o.num_heads;
  SY_REQUIRE(o.num_kv_heads > 0 && o.num_heads % o.num_kv_heads == 0, InvalidArgument,
             "{}: num_key_value_heads {} must be positive and divide num_attention_heads {}",
             prefix, o.num_kv_heads, o.num_heads);
  if (o.head_dim == 0) {
    SY_REQUIRE(o.model_dim % o.num_heads == 0, InvalidArgument,
               "{}: num_attention_heads {} must divide hidden_size {} (or give head_dim)", prefix,
               o.num_heads, o.model_dim);
    o.head_dim = o.model_dim / o.num_heads;
  }
  SY_REQUIRE(o.head_dim > 0 && (!o.rope || o.head_dim % 2 == 0), InvalidArgument,
             "{}: head_dim {} must be positive (and even for RoPE)", prefix, o.head_dim);
  return o;
}

}  // namespace

GroupedQueryAttention::GroupedQueryAttention(ParameterSet& params, const std::string& prefix,
                                             GqaOptions options)
    : options_(Resolve(options, prefix)),
      q_(params, prefix + "q_proj.", options_.model_dim, options_.num_heads * options_.head_dim,
         options_.qkv_bias, options_.init_std, options_.seed),
      k_(params, prefix + "k_proj.", options_.model_dim, options_.num_kv_heads * options_.head_dim,
         options_.qkv_bias, options_.init_std, options_.seed),
      v_(params, prefix + "v_proj.", options_.model_dim, options_.num_kv_heads * options_.head_dim,
         options_.qkv_bias, options_.init_std, options_.seed),
      o_(params, prefix + "o_proj.", options_.num_heads * options_.head_dim, options_.model_dim,
         false, options_.o_init_std, options_.seed) {
  if (options_.qk_norm) {
    q_norm_ = std::make_unique<Norm>(params, prefix + "q_norm.", q_dim(), NormKind::kRmsNorm,
                                     options_.norm_eps);
    k_norm_ = std::make_unique<Norm>(params, prefix + "k_norm.", kv_dim(), NormKind::kRmsNorm,
                                     options_.norm_eps);
  }
}

Tensor GroupedQueryAttention::ProjectQkv(const Tensor& x, std::span<const int64_t> positions,
                                         GqaCache* cache, int threads) const {
  ExpectDType("attention x", x, DType::kFloat32);
  SY_REQUIRE(x.dim() == 2 && x.size(1) == options_.model_dim, InvalidArgument,
             "attention x: expected [num_tokens, {}], got {}", options_.model_dim,
             ShapeToString(x.shape()));
  const int64_t n = x.size(0), d = options_.head_dim, heads = options_.num_heads;
  GqaCache local;
  GqaCache& c = cache != nullptr ? *cache : local;
  c.x = x;
  c.positions.assign(positions.begin(), positions.end());
  Tensor q = q_.Forward(x, threads);
  Tensor k = k_.Forward(x, threads);
  Tensor v = v_.Forward(x, threads);
  if (options_.qk_norm) {
    q = q_norm_->Forward(q, &c.q_norm, threads);
    k = k_norm_->Forward(k, &c.k_norm, threads);
  }
  if (options_.rope) {
    q = RopeForward(q, positions, d, options_.rope_theta, threads);
    k = RopeForward(k, positions, d, options_.rope_theta, threads);
  } else {
    SY_REQUIRE(static_cast<int64_t>(positions.size()) == n, InvalidArgument,
               "attention positions: expected {} (one per token), got {}", n, positions.size());
  }
  Tensor qkv = RepeatKvQkv(q, k, v, heads, options_.num_kv_heads, d);
  return qkv;
}

Tensor GroupedQueryAttention::ProjectQkvBackward(const GqaCache& cache, const Tensor& dqkv,
                                                 int threads) const {
  const int64_t n = cache.x.size(0), d = options_.head_dim, heads = options_.num_heads;
  const int64_t qd = heads * d;
  ExpectShape("attention d(qkv)", dqkv, {n, 3 * qd});
  auto [dq, dk, dv] = RepeatKvQkvBackward(dqkv, heads, options_.num_kv_heads, d);
  if (options_.rope) {
    dq = RopeBackward(dq, cache.positions, d, options_.rope_theta, threads);
    dk = RopeBackward(dk, cache.positions, d, options_.rope_theta, threads);
  }
  if (options_.qk_norm) {
    dq = q_norm_->Backward(cache.q_norm, dq, threads);
    dk = k_norm_->Backward(cache.k_norm, dk, threads);
  }
  Tensor dx = q_.Backward(cache.x, dq, threads);
  Tensor dxk = k_.Backward(cache.x, dk, threads);
  Tensor dxv = v_.Backward(cache.x, dv, threads);
  float* dxp = dx.data<float>();
  const float* a = dxk.data<float>();
  const float* b = dxv.data<float>();
  for (int64_t i = 0; i < dx.numel(); ++i) dxp[i] += a[i] + b[i];
  return dx;
}

Tensor GroupedQueryAttention::Forward(const Tensor& x, int64_t batch_size,
                                      std::span<const int64_t> positions, GqaCache* cache,
                                      int threads) const {
  SY_REQUIRE(batch_size > 0 && x.defined() && x.dim() == 2 && x.size(0) % batch_size == 0,
             InvalidArgument,
             "attention x: expected [batch_size * seq_len, model_dim] with batch_size {}, got {}",
             batch_size, x.defined() ? ShapeToString(x.shape()) : "undefined");
  std::vector<int64_t> default_positions;
  if (positions.empty()) {
    default_positions = SequencePositions(batch_size, x.size(0) / batch_size);
    positions = default_positions;
  }
  GqaCache local;
  GqaCache& c = cache != nullptr ? *cache : local;
  c.batch_size = batch_size;
  c.qkv = ProjectQkv(x, positions, &c, threads);
  c.att = CausalAttentionForward(c.qkv, batch_size, options_.num_heads, threads, &c.probs);
  return o_.Forward(c.att, threads);
}

Tensor GroupedQueryAttention::Backward(const GqaCache& cache, const Tensor& dy, int threads) const {
  ExpectShape("attention dy", dy, {cache.x.size(0), options_.model_dim});
  Tensor datt = o_.Backward(cache.att, dy, threads);
  Tensor dqkv = CausalAttentionBackward(cache.qkv, cache.probs, datt, cache.batch_size,
                                        options_.num_heads, threads);
  return ProjectQkvBackward(cache, dqkv, threads);
}

}  // namespace switchyard::train
