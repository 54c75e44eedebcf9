// Branch-free float32 exp, erf and the normal distribution that the compiler vectorizes (AVX2 in
// the release build), for the elementwise loops of kernels/ops and the fused MoE activations. The
// loops that call them need -fno-trapping-math, or GCC will not if-convert (and so not vectorize)
// them. Accuracy (checked against float64 in tests/kernels/vec_math_test.cc):
//   Exp: relative error < 2e-7 on [-87, 88]; 0 below -87.3, saturates at exp(88.37) above; NaN
//   gives NaN.
//   Erf: absolute error < 5e-7 (Abramowitz & Stegun 7.1.26, 1.5e-7, plus float32 rounding).
#pragma once

#include <bit>
#include <cstdint>

namespace switchyard::kernels::vec {

inline float Exp(float x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 in [-ln2/2, ln2/2].
  // Every value is computed unconditionally and selected at the end, so loops if-convert and
  // vectorize (a branch around a possibly-trapping product would stop that). n is rounded by
  // adding 1.5 * 2^23 (its bits then hold n) rather than converted to an integer, which is
  // undefined for NaN: a NaN argument flows through as NaN.
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.37f ? 88.37f : xc;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  float shifted = xc * 1.44269504088896341f + kRound;
  float n = shifted - kRound;
  float r = xc - n * 0.693359375f;  // ln2 split in two for an exact first product
  r = r - n * -2.12194440e-4f;
  // exp(r) = 1 + r + r^2 P(r), P of degree 5 (the Cephes expf coefficients), on [-0.347, 0.347].
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // The low bits of `shifted` are n (two's complement, |n| < 2^22): 2^n = (n + 127) << 23.
  uint32_t scale_bits = (std::bit_cast<uint32_t>(shifted) << 23) + (127u << 23);
  float result = p * std::bit_cast<float>(scale_bits);
  return x <= -87.3f ? 0.0f : result;
}

// For a >= 0: erf(a) and exp(-a^2), the exponential the approximation is built on
// (Abramowitz & Stegun 7.1.26).
struct ErfExp {
  float erf, exp;
};
inline ErfExp ErfOfNonNegative(float a) {
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  float e = Exp(-a * a);
  return {1.0f - poly * t * e, e};
}

inline float Erf(float x) {
  return __builtin_copysignf(ErfOfNonNegative(__builtin_fabsf(x)).erf, x);
}

// The standard normal's distribution Phi(x) = (1 + erf(x / sqrt2)) / 2 and density
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi), from one exponential. GELU(x) = x Phi(x), and its
// derivative is Phi(x) + x phi(x).
struct CdfPdf {
  float cdf, pdf;
};
inline CdfPdf NormalCdfPdf(float x) {
  ErfExp r = ErfOfNonNegative(__builtin_fabsf(x) * 0.70710678118654752440f);
  float erf = __builtin_copysignf(r.erf, x);
  return {0.5f * (1.0f + erf), 0.39894228040143267794f * r.exp};
}

}  // namespace switchyard::kernels::vec
