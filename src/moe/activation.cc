#include "moe/activation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "switchyard/kernels/reduce.h"
#include "switchyard/kernels/vec_math.h"

namespace switchyard::moe {
namespace {

using kernels::Activation;

using kernels::vec::Exp;
using kernels::vec::NormalCdfPdf;

// act(x) and act'(x) together.
struct ValueGrad {
  float value, grad;
};
template <Activation kAct>
inline ValueGrad ActAndGrad(float x) {
  if constexpr (kAct == Activation::kRelu) {
    return {x > 0.0f ? x : 0.0f, x > 0.0f ? 1.0f : 0.0f};
  } else if constexpr (kAct == Activation::kGelu) {
    kernels::vec::CdfPdf c = NormalCdfPdf(x);
    return {x * c.cdf, c.cdf + x * c.pdf};
  } else if constexpr (kAct == Activation::kSilu) {
    float s = 1.0f / (1.0f + Exp(-x));
    return {x * s, s * (1.0f + x * (1.0f - s))};
  } else {
    return {x, 1.0f};
  }
}

// act(x) alone: the same arithmetic as ActAndGrad's value (the unused derivative is dropped by
// the compiler), so a forward with and without saved derivatives gives the same bits.
template <Activation kAct>
inline float Act(float x) {
  return ActAndGrad<kAct>(x).value;
}

template <Activation kAct>
void ForwardRows(int64_t rows, int64_t cols, int64_t ld, const float* __restrict bias,
                 float* __restrict pre1, float* __restrict pre3, float* __restrict hidden,
                 bool save_scales) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = pre1 + r * ld;
    float* h = hidden + r * ld;
    float* q = pre3 ? pre3 + r * ld : nullptr;
    if (bias) {
      for (int64_t j = 0; j < cols; ++j) p[j] += bias[j];
    }
    if (!save_scales) {
      if (q) {
        for (int64_t j = 0; j < cols; ++j) h[j] = Act<kAct>(p[j]) * q[j];
      } else {
        for (int64_t j = 0; j < cols; ++j) h[j] = Act<kAct>(p[j]);
      }
    } else if (q) {
      for (int64_t j = 0; j < cols; ++j) {
        ValueGrad vg = ActAndGrad<kAct>(p[j]);
        h[j] = vg.value * q[j];
        p[j] = vg.grad * q[j];
        q[j] = vg.value;
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        ValueGrad vg = ActAndGrad<kAct>(p[j]);
        h[j] = vg.value;
        p[j] = vg.grad;
      }
    }
  }
}

}  // namespace

void ActivationForwardRows(Activation act, int64_t rows, int64_t cols, const float* bias,
                           float* pre1, float* pre3, float* hidden, bool save_scales) {
  ActivationForwardBlock(act, rows, cols, cols, bias, pre1, pre3, hidden, save_scales);
}

void ActivationForwardBlock(Activation act, int64_t rows, int64_t cols, int64_t ld,
                            const float* bias, float* pre1, float* pre3, float* hidden,
                            bool save_scales) {
  switch (act) {
    case Activation::kRelu:
      ForwardRows<Activation::kRelu>(rows, cols, ld, bias, pre1, pre3, hidden, save_scales);
      break;
    case Activation::kGelu:
      ForwardRows<Activation::kGelu>(rows, cols, ld, bias, pre1, pre3, hidden, save_scales);
      break;
    case Activation::kSilu:
      ForwardRows<Activation::kSilu>(rows, cols, ld, bias, pre1, pre3, hidden, save_scales);
      break;
    case Activation::kIdentity:
      ForwardRows<Activation::kIdentity>(rows, cols, ld, bias, pre1, pre3, hidden, save_scales);
      break;
  }
}

void ActivationBackwardRows(int64_t rows, int64_t cols, const float* scale1, const float* scale3,
                            float* d, float* d_pre3, float* bias_grad) {
  ActivationBackwardBlock(rows, cols, cols, scale1, scale3, d, d_pre3, bias_grad);
}

void ActivationBackwardBlock(int64_t rows, int64_t cols, int64_t ld, const float* __restrict scale1,
                             const float* __restrict scale3, float* __restrict d,
                             float* __restrict d_pre3, float* __restrict bias_grad) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s1 = scale1 + r * ld;
    float* dr = d + r * ld;
    if (scale3) {
      const float* s3 = scale3 + r * ld;
      float* d3 = d_pre3 + r * ld;
      for (int64_t j = 0; j < cols; ++j) d3[j] = dr[j] * s3[j];
    }
    for (int64_t j = 0; j < cols; ++j) dr[j] *= s1[j];
    if (bias_grad) {
      for (int64_t j = 0; j < cols; ++j) bias_grad[j] += dr[j];
    }
  }
}

void SoftmaxLseRows(const float* x, float* y, float* lse, int64_t rows, int64_t cols) {
  std::vector<float> tmp(y ? 0 : static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* e = y ? y + r * cols : tmp.data();
    const float mx = kernels::Max(xr, cols);
    if (!(mx > -INFINITY && mx < INFINITY)) {  // all -inf, +inf or NaN: undefined
      lse[r] = mx;
      if (y) std::fill_n(e, cols, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    for (int64_t j = 0; j < cols; ++j) e[j] = Exp(xr[j] - mx);
    const float sum = kernels::Sum(e, cols);
    lse[r] = mx + std::log(sum);
    if (y) {
      float inv = 1.0f / sum;
      for (int64_t k = 0; k < cols; ++k) e[k] *= inv;
    }
  }
}

}  // namespace switchyard::moe
