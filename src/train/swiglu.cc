// SwiGLU MLP: three bias-free Linear layers around silu(gate) * up.
#include "switchyard/train/swiglu.h"

#include <cmath>

#include "switchyard/kernels/ops.h"
#include "train/parallel_for.h"

namespace switchyard::train {

SwiGluMlp::SwiGluMlp(ParameterSet& params, const std::string& prefix, int64_t model_dim,
                     int64_t intermediate_size, float init_std, float down_init_std, uint64_t seed)
    : gate_(params, prefix + "gate_proj.", model_dim, intermediate_size, false, init_std, seed),
      up_(params, prefix + "up_proj.", model_dim, intermediate_size, false, init_std, seed),
      down_(params, prefix + "down_proj.", intermediate_size, model_dim, false, down_init_std,
            seed) {}

Tensor SwiGluMlp::Forward(const Tensor& x, SwiGluCache* cache, int threads) const {
  ExpectDType("SwiGLU x", x, DType::kFloat32);
  Tensor gate = gate_.Forward(x, threads);
  Tensor up = up_.Forward(x, threads);
  const int64_t n = gate.size(0), h_dim = gate.size(1);
  Tensor h = Tensor::Empty({n, h_dim});
  const float* gp = gate.data<float>();
  const float* upp = up.data<float>();
  float* hp = h.data<float>();
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    const int64_t off = begin * h_dim, len = (end - begin) * h_dim;
    kernels::ActivationForward(kernels::Activation::kSilu, gp + off, hp + off, len);
    for (int64_t i = off; i < off + len; ++i) hp[i] *= upp[i];
  });
  Tensor y = down_.Forward(h, threads);
  if (cache != nullptr) *cache = SwiGluCache{x, gate, up, h};
  return y;
}

Tensor SwiGluMlp::Backward(const SwiGluCache& cache, const Tensor& dy, int threads) const {
  ExpectShape("SwiGLU dy", dy, {cache.x.size(0), model_dim()});
  Tensor dh = down_.Backward(cache.h, dy, threads);
  const int64_t n = dh.size(0), h_dim = dh.size(1);
  Tensor dgate = Tensor::Empty({n, h_dim});
  Tensor dup = Tensor::Empty({n, h_dim});
  const float* gp = cache.gate.data<float>();
  const float* upp = cache.up.data<float>();
  const float* dhp = dh.data<float>();
  float* dgp = dgate.data<float>();
  float* dup_p = dup.data<float>();
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    const int64_t off = begin * h_dim, len = (end - begin) * h_dim;
    // d up = dh * silu(gate); d gate = silu'(gate) * (dh * up).
    kernels::ActivationForward(kernels::Activation::kSilu, gp + off, dup_p + off, len);
    for (int64_t i = off; i < off + len; ++i) {
      dup_p[i] *= dhp[i];
      dgp[i] = dhp[i] * upp[i];
    }
    kernels::ActivationBackward(kernels::Activation::kSilu, gp + off, dgp + off, dgp + off, len);
  });
  Tensor dx = gate_.Backward(cache.x, dgate, threads);
  Tensor dx_up = up_.Backward(cache.x, dup, threads);
  float* dxp = dx.data<float>();
  const float* dxu = dx_up.data<float>();
  for (int64_t i = 0; i < dx.numel(); ++i) dxp[i] += dxu[i];
  return dx;
}

GatedSharedExpert::GatedSharedExpert(ParameterSet& params, const std::string& prefix,
                                     int64_t model_dim, int64_t intermediate_size, float init_std,
                                     float down_init_std, uint64_t seed)
    : mlp_(params, prefix + "shared_expert.", model_dim, intermediate_size, init_std, down_init_std,
           seed),
      gate_(params, prefix + "shared_expert_gate.", model_dim, 1, false, init_std, seed) {}

Tensor GatedSharedExpert::Forward(const Tensor& x, GatedSharedExpertCache* cache,
                                  int threads) const {
  GatedSharedExpertCache local;
  GatedSharedExpertCache& c = cache != nullptr ? *cache : local;
  c.mlp_y = mlp_.Forward(x, &c.mlp, threads);
  c.gate = gate_.Forward(x, threads).Reshape({x.size(0)});
  float* g = c.gate.data<float>();
  for (int64_t t = 0; t < x.size(0); ++t) g[t] = 1.0f / (1.0f + std::exp(-g[t]));
  const int64_t m = x.size(1);
  Tensor y = Tensor::Empty({x.size(0), m});
  const float* a = c.mlp_y.data<float>();
  float* yp = y.data<float>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    for (int64_t j = 0; j < m; ++j) yp[t * m + j] = g[t] * a[t * m + j];
  }
  return y;
}

void SigmoidGateBackward(const Tensor& gate, const Tensor& a, const Tensor& dy, Tensor* d_a,
                         Tensor* d_logit) {
  const int64_t n = a.size(0), m = a.size(1);
  ExpectShape("shared expert dy", dy, {n, m});
  const float* g = gate.data<float>();
  const float* ap = a.data<float>();
  const float* dyp = dy.data<float>();
  *d_a = Tensor::Empty({n, m});
  *d_logit = Tensor::Empty({n, 1});
  float* dm = d_a->data<float>();
  float* dl = d_logit->data<float>();
  for (int64_t t = 0; t < n; ++t) {
    double dg = 0;
    for (int64_t j = 0; j < m; ++j) {
      dm[t * m + j] = g[t] * dyp[t * m + j];
      dg += static_cast<double>(dyp[t * m + j]) * ap[t * m + j];
    }
    dl[t] = static_cast<float>(dg) * g[t] * (1.0f - g[t]);  // sigmoid' = g (1 - g)
  }
}

Tensor GatedSharedExpert::Backward(const GatedSharedExpertCache& c, const Tensor& dy,
                                   int threads) const {
  Tensor d_mlp, d_logit;
  SigmoidGateBackward(c.gate, c.mlp_y, dy, &d_mlp, &d_logit);
  Tensor dx = mlp_.Backward(c.mlp, d_mlp, threads);
  Tensor dx_gate = gate_.Backward(c.mlp.x, d_logit, threads);
  float* dxp = dx.data<float>();
  const float* b = dx_gate.data<float>();
  for (int64_t i = 0; i < dx.numel(); ++i) dxp[i] += b[i];
  return dx;
}

}  // namespace switchyard::train
