#include "switchyard/moe/variants.h"

#include <cstring>

#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"

namespace switchyard::moe {
namespace {

using kernels::Trans;

// A dense MLP ([H, M] ... layout) as one expert ([1, H, M] ...), sharing storage.
ExpertWeights AsOneExpert(const ExpertWeights& w) {
  auto add_dim = [](const Tensor& t) {
    if (!t.defined()) return Tensor();
    Shape s = t.shape();
    s.insert(s.begin(), 1);
    return t.Reshape(s);
  };
  return {add_dim(w.fc1_weight), add_dim(w.fc1_bias), add_dim(w.fc2_weight), add_dim(w.fc2_bias),
          add_dim(w.fc3_weight)};
}
ExpertWeights DropExpertDim(const ExpertWeights& w) {
  auto drop = [](const Tensor& t) {
    if (!t.defined()) return Tensor();
    Shape s(t.shape().begin() + 1, t.shape().end());
    return t.Reshape(s);
  };
  return {drop(w.fc1_weight), drop(w.fc1_bias), drop(w.fc2_weight), drop(w.fc2_bias),
          drop(w.fc3_weight)};
}

ExpertGroups AllRows(int64_t rows) { return ExpertGroups{{0}, {rows}}; }

// y [T, n] = x [T, M] · W^T [M, n] (+ b).
Tensor Linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t t_num = x.size(0), m = x.size(1), n = w.size(0);
  Tensor y = Tensor::Empty({t_num, n});
  float* yp = y.data<float>();
  if (b.defined()) {
    for (int64_t t = 0; t < t_num; ++t) {
      std::memcpy(yp + t * n, b.data<float>(), static_cast<size_t>(n) * sizeof(float));
    }
  }
  kernels::Gemm(Trans::kNo, Trans::kYes, t_num, n, m, 1.0f, x.data<float>(), m, w.data<float>(), m,
                b.defined() ? 1.0f : 0.0f, yp, n);
  return y;
}

void AddInto(const Tensor& dst, const Tensor& src) {
  float* d = dst.data<float>();
  const float* s = src.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
}

}  // namespace

Tensor VariantsForward(const LayerConfig& c, const LayerParams& params, const Tensor& x,
                       const Tensor& moe_y, VariantState* s, int threads) {
  const int64_t t_num = x.size(0);
  const ExpertOptions eopt{c.activation, c.gated};
  Tensor y = moe_y;
  if (c.residual_moe) {
    s->moe_y = moe_y;
    s->mlp_y = ExpertsForward(eopt, AsOneExpert(params.residual_mlp), x, AllRows(t_num),
                              &s->residual, threads);
    s->coef = Linear(x, params.coefficient_weight, params.coefficient_bias);
    kernels::SoftmaxRows(s->coef.data<float>(), s->coef.data<float>(), t_num, 2);
    y = Tensor::Empty({t_num, c.model_dim});
    const float* a = s->moe_y.data<float>();
    const float* b = s->mlp_y.data<float>();
    const float* cf = s->coef.data<float>();
    float* yp = y.data<float>();
    for (int64_t t = 0; t < t_num; ++t) {
      for (int64_t j = 0; j < c.model_dim; ++j) {
        int64_t i = t * c.model_dim + j;
        yp[i] = cf[2 * t] * a[i] + cf[2 * t + 1] * b[i];
      }
    }
  }
  if (c.shared_expert_hidden > 0) {
    Tensor sy = ExpertsForward(eopt, AsOneExpert(params.shared_mlp), x, AllRows(t_num), &s->shared,
                               threads);
    AddInto(y, sy);
  }
  return y;
}

VariantGradients VariantsBackward(const LayerConfig& c, const LayerParams& params,
                                  const VariantState& s, const Tensor& x, const Tensor& dy,
                                  LayerParams* grads, int threads) {
  const int64_t t_num = x.size(0), m_dim = c.model_dim;
  const ExpertOptions eopt{c.activation, c.gated};
  VariantGradients g;
  g.x = Tensor::Zeros({t_num, m_dim});
  g.d_moe_y = dy;
  if (c.residual_moe) {
    g.d_moe_y = Tensor::Empty({t_num, m_dim});
    Tensor d_mlp = Tensor::Empty({t_num, m_dim});
    Tensor d_coef = Tensor::Empty({t_num, 2});
    const float* dyp = dy.data<float>();
    const float* cf = s.coef.data<float>();
    const float* a = s.moe_y.data<float>();
    const float* b = s.mlp_y.data<float>();
    float* dm = g.d_moe_y.data<float>();
    float* dl = d_mlp.data<float>();
    float* dc = d_coef.data<float>();
    for (int64_t t = 0; t < t_num; ++t) {
      double da = 0, db = 0;
      for (int64_t j = 0; j < m_dim; ++j) {
        int64_t i = t * m_dim + j;
        dm[i] = cf[2 * t] * dyp[i];
        dl[i] = cf[2 * t + 1] * dyp[i];
        da += static_cast<double>(dyp[i]) * a[i];
        db += static_cast<double>(dyp[i]) * b[i];
      }
      dc[2 * t] = static_cast<float>(da);
      dc[2 * t + 1] = static_cast<float>(db);
    }
    kernels::SoftmaxRowsBackward(cf, dc, dc, t_num, 2);
    grads->coefficient_weight = Tensor::Empty({2, m_dim});
    kernels::Gemm(Trans::kYes, Trans::kNo, 2, m_dim, t_num, 1.0f, dc, 2, x.data<float>(), m_dim,
                  0.0f, grads->coefficient_weight.data<float>(), m_dim);
    if (params.coefficient_bias.defined()) {
      grads->coefficient_bias = Tensor::Zeros({2});
      float* bb = grads->coefficient_bias.data<float>();
      for (int64_t t = 0; t < t_num; ++t) {
        bb[0] += dc[2 * t];
        bb[1] += dc[2 * t + 1];
      }
    }
    kernels::Gemm(Trans::kNo, Trans::kNo, t_num, m_dim, 2, 1.0f, dc, 2,
                  params.coefficient_weight.data<float>(), m_dim, 1.0f, g.x.data<float>(), m_dim);
    ExpertGradients rg =
        ExpertsBackward(eopt, AsOneExpert(params.residual_mlp), s.residual, d_mlp, threads);
    AddInto(g.x, rg.input);
    grads->residual_mlp = DropExpertDim(rg.weights);
  }
  if (c.shared_expert_hidden > 0) {
    ExpertGradients sg =
        ExpertsBackward(eopt, AsOneExpert(params.shared_mlp), s.shared, dy, threads);
    AddInto(g.x, sg.input);
    grads->shared_mlp = DropExpertDim(sg.weights);
  }
  return g;
}

}  // namespace switchyard::moe
