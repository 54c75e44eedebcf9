#include "moe/activation.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace switchyard::moe {
namespace {

using kernels::Activation;

// e^x for float32, relative error ~2 ulp on [-87.3, 88.3] (Cephes expf polynomial); inputs
// outside are clamped (e^-87.3 ~ 1.2e-38, e^88.3 ~ 2.2e38).
inline float ExpF(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// erf(x), Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7.
inline float ErfF(float x) {
  float a = std::fabs(x);
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  float y = 1.0f - poly * t * ExpF(-a * a);
  return std::copysign(y, x);
}

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

inline float Act(Activation act, float x) {
  switch (act) {
    case Activation::kRelu: return x > 0.0f ? x : 0.0f;
    case Activation::kGelu: return 0.5f * x * (1.0f + ErfF(x * kInvSqrt2));
    case Activation::kSilu: return x / (1.0f + ExpF(-x));
    case Activation::kIdentity: return x;
  }
  return x;
}

// act'(x)
inline float ActGrad(Activation act, float x) {
  switch (act) {
    case Activation::kRelu: return x > 0.0f ? 1.0f : 0.0f;
    case Activation::kGelu:
      return 0.5f * (1.0f + ErfF(x * kInvSqrt2)) + x * kInvSqrt2Pi * ExpF(-0.5f * x * x);
    case Activation::kSilu: {
      float s = 1.0f / (1.0f + ExpF(-x));
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::kIdentity: return 1.0f;
  }
  return 1.0f;
}

// One loop per activation, so the switch is outside the loop and each loop vectorizes.
template <Activation kAct>
void Forward(const float* __restrict pre1, const float* __restrict pre3, float* __restrict h,
             int64_t n) {
  if (pre3) {
    for (int64_t i = 0; i < n; ++i) h[i] = Act(kAct, pre1[i]) * pre3[i];
  } else {
    for (int64_t i = 0; i < n; ++i) h[i] = Act(kAct, pre1[i]);
  }
}

template <Activation kAct>
void Backward(const float* __restrict pre1, const float* __restrict pre3, float* __restrict d,
              float* __restrict d_pre3, int64_t n) {
  if (pre3) {
    for (int64_t i = 0; i < n; ++i) {
      float dh = d[i];
      d_pre3[i] = dh * Act(kAct, pre1[i]);
      d[i] = dh * pre3[i] * ActGrad(kAct, pre1[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] *= ActGrad(kAct, pre1[i]);
  }
}

}  // namespace

void ActivationForwardFast(Activation act, const float* pre1, const float* pre3, float* hidden,
                           int64_t n) {
  switch (act) {
    case Activation::kRelu: Forward<Activation::kRelu>(pre1, pre3, hidden, n); break;
    case Activation::kGelu: Forward<Activation::kGelu>(pre1, pre3, hidden, n); break;
    case Activation::kSilu: Forward<Activation::kSilu>(pre1, pre3, hidden, n); break;
    case Activation::kIdentity: Forward<Activation::kIdentity>(pre1, pre3, hidden, n); break;
  }
}

void ActivationBackwardFast(Activation act, const float* pre1, const float* pre3, float* d,
                            float* d_pre3, int64_t n) {
  switch (act) {
    case Activation::kRelu: Backward<Activation::kRelu>(pre1, pre3, d, d_pre3, n); break;
    case Activation::kGelu: Backward<Activation::kGelu>(pre1, pre3, d, d_pre3, n); break;
    case Activation::kSilu: Backward<Activation::kSilu>(pre1, pre3, d, d_pre3, n); break;
    case Activation::kIdentity: Backward<Activation::kIdentity>(pre1, pre3, d, d_pre3, n); break;
  }
}

}  // namespace switchyard::moe
