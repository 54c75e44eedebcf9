#include "moe/activation.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "switchyard/kernels/reduce.h"

namespace switchyard::moe {
namespace {

using kernels::Activation;

// e^x for float32, relative error ~2 ulp on [-87.3, 88.3] (Cephes expf polynomial); inputs
// outside are clamped (e^-87.3 ~ 1.2e-38, e^88.3 ~ 2.2e38). Every value is computed
// unconditionally so loops if-convert and vectorize.
inline float ExpF(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  float n = __builtin_rintf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  return y * std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// Phi(x) = (1 + erf(x / sqrt2)) / 2 and, through the same exponential, the normal density
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi). A&S 7.1.26 on |x| / sqrt2.
struct CdfPdf {
  float cdf, pdf;
};
inline CdfPdf NormalCdfPdf(float x) {
  float a = __builtin_fabsf(x) * kInvSqrt2;
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  float e = ExpF(-0.5f * x * x);  // = exp(-a^2)
  float erf_abs = 1.0f - poly * t * e;
  float erf = __builtin_copysignf(erf_abs, x);
  return {0.5f * (1.0f + erf), kInvSqrt2Pi * e};
}

template <Activation kAct>
inline float Act(float x) {
  if constexpr (kAct == Activation::kRelu) return x > 0.0f ? x : 0.0f;
  if constexpr (kAct == Activation::kGelu) return x * NormalCdfPdf(x).cdf;
  if constexpr (kAct == Activation::kSilu) return x * (1.0f / (1.0f + ExpF(-x)));  // as ActAndGrad
  return x;
}

// act(x) and act'(x) together.
struct ValueGrad {
  float value, grad;
};
template <Activation kAct>
inline ValueGrad ActAndGrad(float x) {
  if constexpr (kAct == Activation::kRelu) {
    return {x > 0.0f ? x : 0.0f, x > 0.0f ? 1.0f : 0.0f};
  } else if constexpr (kAct == Activation::kGelu) {
    CdfPdf c = NormalCdfPdf(x);
    return {x * c.cdf, c.cdf + x * c.pdf};
  } else if constexpr (kAct == Activation::kSilu) {
    float s = 1.0f / (1.0f + ExpF(-x));
    return {x * s, s * (1.0f + x * (1.0f - s))};
  } else {
    return {x, 1.0f};
  }
}

template <Activation kAct>
void ForwardRows(int64_t rows, int64_t cols, const float* __restrict bias, float* __restrict pre1,
                 float* __restrict pre3, float* __restrict hidden, bool save_scales) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = pre1 + r * cols;
    float* h = hidden + r * cols;
    float* q = pre3 ? pre3 + r * cols : nullptr;
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
  switch (act) {
    case Activation::kRelu:
      ForwardRows<Activation::kRelu>(rows, cols, bias, pre1, pre3, hidden, save_scales);
      break;
    case Activation::kGelu:
      ForwardRows<Activation::kGelu>(rows, cols, bias, pre1, pre3, hidden, save_scales);
      break;
    case Activation::kSilu:
      ForwardRows<Activation::kSilu>(rows, cols, bias, pre1, pre3, hidden, save_scales);
      break;
    case Activation::kIdentity:
      ForwardRows<Activation::kIdentity>(rows, cols, bias, pre1, pre3, hidden, save_scales);
      break;
  }
}

void ActivationBackwardRows(int64_t rows, int64_t cols, const float* __restrict scale1,
                            const float* __restrict scale3, float* __restrict d,
                            float* __restrict d_pre3, float* __restrict bias_grad) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s1 = scale1 + r * cols;
    float* dr = d + r * cols;
    if (scale3) {
      const float* s3 = scale3 + r * cols;
      float* d3 = d_pre3 + r * cols;
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
    for (int64_t j = 0; j < cols; ++j) e[j] = ExpF(xr[j] - mx);
    const float sum = kernels::Sum(e, cols);
    lse[r] = mx + std::log(sum);
    if (y) {
      float inv = 1.0f / sum;
      for (int64_t k = 0; k < cols; ++k) e[k] *= inv;
    }
  }
}

}  // namespace switchyard::moe
