#include "switchyard/moe/dispatch.h"

#include <cstring>

#include "moe/activation.h"
#include "moe/parallel_for.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/reduce.h"

namespace switchyard::moe {
namespace {

// Rows per thread below which a loop stays on one thread.
constexpr int64_t kRowGrain = 64;

void CheckRows(std::string_view name, const Tensor& t, int64_t rows, int64_t cols) {
  ExpectDType(name, t, DType::kFloat32);
  ExpectShape(name, t, {rows, cols});
}

inline void Scale(float* __restrict dst, const float* __restrict src, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = s * src[i];
}
inline void Axpy(float* __restrict dst, const float* __restrict src, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += s * src[i];
}

}  // namespace

Tensor Dispatch(const DispatchPlan& plan, const Tensor& x, bool prescore, int threads) {
  ExpectDType("x", x, DType::kFloat32);
  ExpectShape("x", x, {plan.num_tokens, kAnySize});
  const int64_t m_dim = x.size(1);
  Tensor out = Tensor::Empty({plan.num_rows, m_dim});
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  ParallelFor(plan.num_rows, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t t = plan.row_tokens[static_cast<size_t>(r)];
      float* dst = op + r * m_dim;
      if (t < 0) {
        std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
      } else if (prescore) {
        Scale(dst, xp + int64_t{t} * m_dim,
              plan.weights[static_cast<size_t>(plan.row_pairs[static_cast<size_t>(r)])], m_dim);
      } else {
        std::memcpy(dst, xp + int64_t{t} * m_dim, static_cast<size_t>(m_dim) * sizeof(float));
      }
    }
  });
  return out;
}

Tensor Combine(const DispatchPlan& plan, const Tensor& expert_out, bool prescore, int threads) {
  ExpectDType("expert_out", expert_out, DType::kFloat32);
  ExpectShape("expert_out", expert_out, {plan.num_rows, kAnySize});
  const int64_t m_dim = expert_out.size(1), k = plan.top_k;
  Tensor y = Tensor::Empty({plan.num_tokens, m_dim});
  const float* ep = expert_out.data<float>();
  float* yp = y.data<float>();
  ParallelFor(plan.num_tokens, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = yp + t * m_dim;
      bool first = true;
      for (int64_t j = 0; j < k; ++j) {
        auto i = static_cast<size_t>(t * k + j);
        int32_t r = plan.rows[i];
        if (r < 0) continue;
        float w = prescore ? 1.0f : plan.weights[i];
        if (first) {
          Scale(dst, ep + int64_t{r} * m_dim, w, m_dim);
          first = false;
        } else {
          Axpy(dst, ep + int64_t{r} * m_dim, w, m_dim);
        }
      }
      if (first) std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
    }
  });
  return y;
}

CombineGradients CombineBackward(const DispatchPlan& plan, const Tensor& dy,
                                 const Tensor& expert_out, bool prescore, int threads) {
  ExpectDType("dy", dy, DType::kFloat32);
  ExpectShape("dy", dy, {plan.num_tokens, kAnySize});
  const int64_t m_dim = dy.size(1), k = plan.top_k;
  CheckRows("expert_out", expert_out, plan.num_rows, m_dim);
  CombineGradients g;
  g.expert_out = Tensor::Empty({plan.num_rows, m_dim});
  g.weights.assign(static_cast<size_t>(plan.num_tokens * k), 0.0f);
  const float* dyp = dy.data<float>();
  const float* ep = expert_out.data<float>();
  float* dp = g.expert_out.data<float>();
  ParallelFor(plan.num_rows, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t t = plan.row_tokens[static_cast<size_t>(r)];
      float* dst = dp + r * m_dim;
      if (t < 0) {
        std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
        continue;
      }
      auto pair = static_cast<size_t>(plan.row_pairs[static_cast<size_t>(r)]);
      if (prescore) {
        std::memcpy(dst, dyp + int64_t{t} * m_dim, static_cast<size_t>(m_dim) * sizeof(float));
      } else {
        Scale(dst, dyp + int64_t{t} * m_dim, plan.weights[pair], m_dim);
        g.weights[pair] = kernels::Dot(dyp + int64_t{t} * m_dim, ep + r * m_dim, m_dim);
      }
    }
  });
  return g;
}

DispatchGradients DispatchBackward(const DispatchPlan& plan, const Tensor& d_expert_in,
                                   const Tensor& x, bool prescore, int threads) {
  ExpectDType("x", x, DType::kFloat32);
  ExpectShape("x", x, {plan.num_tokens, kAnySize});
  const int64_t m_dim = x.size(1), k = plan.top_k;
  CheckRows("d_expert_in", d_expert_in, plan.num_rows, m_dim);
  DispatchGradients g;
  g.x = Tensor::Empty({plan.num_tokens, m_dim});
  g.weights.assign(static_cast<size_t>(plan.num_tokens * k), 0.0f);
  const float* dp = d_expert_in.data<float>();
  const float* xp = x.data<float>();
  float* dxp = g.x.data<float>();
  ParallelFor(plan.num_tokens, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = dxp + t * m_dim;
      bool first = true;
      for (int64_t j = 0; j < k; ++j) {
        auto i = static_cast<size_t>(t * k + j);
        int32_t r = plan.rows[i];
        if (r < 0) continue;
        const float* src = dp + int64_t{r} * m_dim;
        float w = prescore ? plan.weights[i] : 1.0f;
        if (prescore) g.weights[i] = kernels::Dot(xp + t * m_dim, src, m_dim);
        if (first) {
          Scale(dst, src, w, m_dim);
          first = false;
        } else {
          Axpy(dst, src, w, m_dim);
        }
      }
      if (first) std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
    }
  });
  return g;
}

}  // namespace switchyard::moe
