// Linear, Embedding, Norm and the softmax cross-entropy (attention is in attention.cc).
#include "switchyard/train/layers.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/kernels/reduce.h"
#include "switchyard/train/weight_grad.h"
#include "train/parallel_for.h"

namespace switchyard::train {

using kernels::Trans;

namespace {

int64_t Rows(std::string_view what, const Tensor& t, int64_t cols) {
  SY_REQUIRE(t.defined() && t.dim() == 2, InvalidArgument,
             "{}: expected a 2-d tensor [num_tokens, {}], got {}", what, cols,
             t.defined() ? ShapeToString(t.shape()) : "undefined");
  ExpectShape(what, t, {kAnySize, cols});
  SY_REQUIRE(t.dtype() == DType::kFloat32 || t.dtype() == DType::kBFloat16, InvalidArgument,
             "{}: expected float32 or bfloat16, got {}", what, DTypeName(t.dtype()));
  return t.size(0);
}

}  // namespace

// ---- Linear ----

Linear::Linear(ParameterSet& params, const std::string& prefix, int64_t in_dim, int64_t out_dim,
               bool bias, float init_std, uint64_t seed)
    : in_dim_(in_dim), out_dim_(out_dim) {
  SY_REQUIRE(in_dim > 0 && out_dim > 0, InvalidArgument,
             "{}: Linear sizes must be positive, got in_dim {} out_dim {}", prefix, in_dim,
             out_dim);
  Tensor w = Tensor::Empty({out_dim, in_dim});
  InitNormal(w, init_std, seed, prefix + "weight");
  weight_ = &params.Add(prefix + "weight", w, {.weight_decay = true});
  if (bias) bias_ = &params.Add(prefix + "bias", Tensor::Zeros({out_dim}));
}

Tensor Linear::Forward(const Tensor& x, int threads, Precision precision) const {
  int64_t n = Rows("Linear x", x, in_dim_);
  Tensor y = Tensor::Empty({n, out_dim_});
  float* yp = y.data<float>();
  float beta = 0.0f;
  if (bias_ != nullptr) {
    const float* b = bias_->value.data<float>();
    for (int64_t i = 0; i < n; ++i) std::copy_n(b, out_dim_, yp + i * out_dim_);
    beta = 1.0f;
  }
  if (precision == Precision::kBFloat16 || x.dtype() == DType::kBFloat16) {
    // Mixed precision: bfloat16 operands (the weight's working copy), float32 accumulation.
    Tensor xb = ToBFloat16(x, threads), wb = ToBFloat16(weight_->value, threads);
    ParallelGemmBFloat16(Trans::kNo, Trans::kYes, n, out_dim_, in_dim_, 1.0f, xb.data<BFloat16>(),
                         in_dim_, wb.data<BFloat16>(), in_dim_, beta, yp, out_dim_, threads);
    return y;
  }
  ParallelGemm(Trans::kNo, Trans::kYes, n, out_dim_, in_dim_, 1.0f, x.data<float>(), in_dim_,
               weight_->value.data<float>(), in_dim_, beta, yp, out_dim_, threads);
  return y;
}

Tensor Linear::Backward(const Tensor& x, const Tensor& dy, int threads) const {
  int64_t n = Rows("Linear x", x, in_dim_);
  ExpectShape("Linear dy", dy, {n, out_dim_});
  ExpectDType("Linear dy", dy, DType::kFloat32);
  if (x.dtype() == DType::kBFloat16) return BackwardBFloat16(x, dy, threads);
  const float* dyp = dy.data<float>();
  Tensor dx = Tensor::Empty({n, in_dim_});
  ParallelGemm(Trans::kNo, Trans::kNo, n, in_dim_, out_dim_, 1.0f, dyp, out_dim_,
               weight_->value.data<float>(), in_dim_, 0.0f, dx.data<float>(), in_dim_, threads);
  // dW += dy^T x: split over the rows of dW (out_dim), each a sum over all tokens. Deferred to a
  // zero-bubble W when the caller asks (train/weight_grad.h); dy is the caller's, so the deferred
  // work keeps its own copy.
  RunOrDeferWeightGrad([this, n, threads, x, dy = DeferringWeightGrads() ? dy.Clone() : dy] {
    const float* g = dy.data<float>();
    ParallelGemm(Trans::kYes, Trans::kNo, out_dim_, in_dim_, n, 1.0f, g, out_dim_, x.data<float>(),
                 in_dim_, 1.0f, weight_->grad.data<float>(), in_dim_, threads);
    if (bias_ != nullptr) {
      float* db = bias_->grad.data<float>();
      for (int64_t i = 0; i < n; ++i) {
        const float* row = g + i * out_dim_;
        for (int64_t j = 0; j < out_dim_; ++j) db[j] += row[j];
      }
    }
  });
  return dx;
}

Tensor Linear::BackwardBFloat16(const Tensor& x, const Tensor& dy, int threads) const {
  const int64_t n = x.size(0);
  Tensor dyb = ToBFloat16(dy, threads), wb = ToBFloat16(weight_->value, threads);
  const BFloat16* dyp = dyb.data<BFloat16>();
  Tensor dx = Tensor::Empty({n, in_dim_});
  ParallelGemmBFloat16(Trans::kNo, Trans::kNo, n, in_dim_, out_dim_, 1.0f, dyp, out_dim_,
                       wb.data<BFloat16>(), in_dim_, 0.0f, dx.data<float>(), in_dim_, threads);
  // The weight gradient, deferred to a zero-bubble W when asked (dyb is this call's own copy).
  RunOrDeferWeightGrad([this, n, threads, x, dyb] {
    const BFloat16* g = dyb.data<BFloat16>();
    ParallelGemmBFloat16(Trans::kYes, Trans::kNo, out_dim_, in_dim_, n, 1.0f, g, out_dim_,
                         x.data<BFloat16>(), in_dim_, 1.0f, weight_->grad.data<float>(), in_dim_,
                         threads);
    if (bias_ != nullptr) {
      float* db = bias_->grad.data<float>();
      for (int64_t i = 0; i < n; ++i) {
        const BFloat16* row = g + i * out_dim_;
        for (int64_t j = 0; j < out_dim_; ++j) db[j] += static_cast<float>(row[j]);
      }
    }
  });
  return dx;
}

// ---- Embedding ----

Embedding::Embedding(ParameterSet& params, const std::string& prefix, int64_t num_embeddings,
                     int64_t dim, float init_std, uint64_t seed)
    : num_embeddings_(num_embeddings), dim_(dim) {
  SY_REQUIRE(num_embeddings > 0 && dim > 0, InvalidArgument,
             "{}: Embedding sizes must be positive, got {} x {}", prefix, num_embeddings, dim);
  Tensor w = Tensor::Empty({num_embeddings, dim});
  InitNormal(w, init_std, seed, prefix + "weight");
  weight_ = &params.Add(prefix + "weight", w, {.weight_decay = true});
}

Tensor Embedding::Forward(const Tensor& ids) const {
  SY_REQUIRE(ids.defined() && ids.dim() == 1, InvalidArgument,
             "Embedding ids: expected a 1-d int32 tensor [num_tokens], got {}",
             ids.defined() ? ids.ToString() : "undefined");
  ExpectDType("Embedding ids", ids, DType::kInt32);
  const int32_t* id = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    SY_REQUIRE(id[i] >= 0 && id[i] < num_embeddings_, InvalidArgument,
               "Embedding ids[{}] = {}: expected a value in [0, {})", i, id[i], num_embeddings_);
  }
  Tensor y = Tensor::Empty({ids.numel(), dim_});
  kernels::GatherRows(weight_->value.data<float>(), num_embeddings_, dim_, id, nullptr, ids.numel(),
                      y.data<float>());
  return y;
}

void Embedding::Backward(const Tensor& ids, const Tensor& dy) const {
  ExpectShape("Embedding dy", dy, {ids.numel(), dim_});
  kernels::ScatterAddRows(dy.data<float>(), ids.numel(), dim_, ids.data<int32_t>(), nullptr,
                          weight_->grad.data<float>(), num_embeddings_);
}

// ---- Norm ----

NormKind NormKindFromName(std::string_view name) {
  if (name == "layernorm") return NormKind::kLayerNorm;
  if (name == "rmsnorm") return NormKind::kRmsNorm;
  throw InvalidArgument(fmt::format("norm: expected 'layernorm' or 'rmsnorm', got '{}'", name));
}

std::string_view NormKindName(NormKind kind) {
  return kind == NormKind::kLayerNorm ? "layernorm" : "rmsnorm";
}

Norm::Norm(ParameterSet& params, const std::string& prefix, int64_t dim, NormKind kind, float eps)
    : dim_(dim), kind_(kind), eps_(eps) {
  SY_REQUIRE(dim > 0, InvalidArgument, "{}: Norm dim must be positive, got {}", prefix, dim);
  SY_REQUIRE(eps > 0 && std::isfinite(eps), InvalidArgument,
             "{}: Norm eps must be a positive finite number, got {}", prefix, eps);
  weight_ = &params.Add(prefix + "weight", Tensor::Full({dim}, 1.0));
  if (kind == NormKind::kLayerNorm) bias_ = &params.Add(prefix + "bias", Tensor::Zeros({dim}));
}

Tensor Norm::Forward(const Tensor& x, NormCache* cache, int threads) const {
  int64_t n = Rows("Norm x", x, dim_);
  ExpectDType("Norm x", x, DType::kFloat32);
  Tensor y = Tensor::Empty({n, dim_});
  Tensor mean = kind_ == NormKind::kLayerNorm ? Tensor::Empty({n}) : Tensor();
  Tensor rstd = Tensor::Empty({n});
  const float* xp = x.data<float>();
  const float* w = weight_->value.data<float>();
  const float* b = bias_ ? bias_->value.data<float>() : nullptr;
  float* yp = y.data<float>();
  float* mp = mean.defined() ? mean.data<float>() : nullptr;
  float* rp = rstd.data<float>();
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = xp + i * dim_;
      float* yr = yp + i * dim_;
      float mu = 0.0f;
      if (mp != nullptr) {
        mu = kernels::Sum(xr, dim_) / static_cast<float>(dim_);
        mp[i] = mu;
      }
      const float ss = kernels::SumSquaredDeviation(xr, mu, dim_);
      float rs = 1.0f / std::sqrt(ss / static_cast<float>(dim_) + eps_);
      rp[i] = rs;
      if (b != nullptr) {
        for (int64_t j = 0; j < dim_; ++j) yr[j] = (xr[j] - mu) * rs * w[j] + b[j];
      } else {
        for (int64_t j = 0; j < dim_; ++j) yr[j] = xr[j] * rs * w[j];
      }
    }
  });
  if (cache != nullptr) *cache = NormCache{x, mean, rstd};
  return y;
}

Tensor Norm::Backward(const NormCache& cache, const Tensor& dy, int threads) const {
  int64_t n = Rows("Norm x", cache.x, dim_);
  ExpectShape("Norm dy", dy, {n, dim_});
  const Tensor x = ToFloat32(cache.x, threads);  // kept as bfloat16 under mixed precision
  const float* xp = x.data<float>();
  const float* dyp = dy.data<float>();
  const float* w = weight_->value.data<float>();
  const float* mp = kind_ == NormKind::kLayerNorm ? cache.mean.data<float>() : nullptr;
  const float* rp = cache.rstd.data<float>();
  Tensor dx = Tensor::Empty({n, dim_});
  float* dxp = dx.data<float>();
  const float inv_dim = 1.0f / static_cast<float>(dim_);
  // The weight/bias gradients are sums over rows: one partial sum per chunk, added in chunk
  // order afterwards (deterministic for a thread count).
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  std::vector<float> partial(static_cast<size_t>(chunks * 2 * dim_), 0.0f);
  ParallelFor(chunks, chunks, [&](int64_t c0, int64_t c1) {
    std::vector<float> xhat(static_cast<size_t>(dim_)), g(static_cast<size_t>(dim_));
    for (int64_t c = c0; c < c1; ++c) {
      float* pdw = partial.data() + c * 2 * dim_;
      float* pdb = pdw + dim_;
      for (int64_t i = n * c / chunks; i < n * (c + 1) / chunks; ++i) {
        const float* xr = xp + i * dim_;
        const float* dyr = dyp + i * dim_;
        float mu = mp != nullptr ? mp[i] : 0.0f;
        float rs = rp[i];
        for (int64_t j = 0; j < dim_; ++j) {
          xhat[j] = (xr[j] - mu) * rs;
          g[j] = dyr[j] * w[j];
          pdw[j] += dyr[j] * xhat[j];
          pdb[j] += dyr[j];
        }
        const float sum_g = kernels::Sum(g.data(), dim_);
        const float sum_gx = kernels::Dot(g.data(), xhat.data(), dim_);
        // LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); RMSNorm: no mean(g).
        float mean_g = mp != nullptr ? sum_g * inv_dim : 0.0f;
        float mean_gx = sum_gx * inv_dim;
        float* dxr = dxp + i * dim_;
        for (int64_t j = 0; j < dim_; ++j) dxr[j] = rs * (g[j] - mean_g - xhat[j] * mean_gx);
      }
    }
  });
  float* dw = weight_->grad.data<float>();
  float* db = bias_ ? bias_->grad.data<float>() : nullptr;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* pdw = partial.data() + c * 2 * dim_;
    for (int64_t j = 0; j < dim_; ++j) dw[j] += pdw[j];
    if (db != nullptr) {
      for (int64_t j = 0; j < dim_; ++j) db[j] += pdw[dim_ + j];
    }
  }
  return dx;
}

// ---- Cross-entropy ----

CrossEntropyResult SoftmaxCrossEntropy(const Tensor& logits, const Tensor& targets, Tensor* dlogits,
                                       float scale, int threads) {
  SY_REQUIRE(logits.defined() && logits.dim() == 2, InvalidArgument,
             "cross-entropy logits: expected [num_tokens, vocab_size], got {}",
             logits.defined() ? ShapeToString(logits.shape()) : "undefined");
  ExpectDType("cross-entropy logits", logits, DType::kFloat32);
  int64_t n = logits.size(0), vocab = logits.size(1);
  ExpectShape("cross-entropy targets", targets, {n});
  ExpectDType("cross-entropy targets", targets, DType::kInt32);
  const float* lp = logits.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    SY_REQUIRE(tp[i] < vocab, InvalidArgument, "cross-entropy targets[{}] = {}: expected < {}", i,
               tp[i], vocab);
  }
  CrossEntropyResult r;
  for (int64_t i = 0; i < n; ++i) r.count += tp[i] >= 0 ? 1 : 0;
  // Per-chunk sums of -log p(target), added in chunk order (deterministic for a thread count).
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  std::vector<double> totals(static_cast<size_t>(chunks), 0.0);
  float coef = r.count > 0 ? scale / static_cast<float>(r.count) : 0.0f;
  if (dlogits != nullptr) *dlogits = Tensor::Empty({n, vocab});
  float* d = dlogits != nullptr ? dlogits->data<float>() : nullptr;
  ParallelFor(chunks, chunks, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
      std::vector<float> lse(static_cast<size_t>(end - begin));
      kernels::LogSumExpRows(lp + begin * vocab, lse.data(), end - begin, vocab);
      for (int64_t i = begin; i < end; ++i) {
        if (tp[i] >= 0) totals[c] += static_cast<double>(lse[i - begin]) - lp[i * vocab + tp[i]];
      }
      if (d == nullptr) continue;
      // d(loss)/d(logits) = coef * (softmax - onehot).
      kernels::SoftmaxRows(lp + begin * vocab, d + begin * vocab, end - begin, vocab);
      for (int64_t i = begin; i < end; ++i) {
        float* dr = d + i * vocab;
        if (tp[i] < 0) {
          std::fill_n(dr, vocab, 0.0f);
          continue;
        }
        for (int64_t j = 0; j < vocab; ++j) dr[j] *= coef;
        dr[tp[i]] -= coef;
      }
    }
  });
  double total = 0;
  for (double t : totals) total += t;
  r.loss = r.count > 0 ? total / static_cast<double>(r.count) : 0.0;
  return r;
}

}  // namespace switchyard::train
