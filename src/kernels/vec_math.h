// Branch-free float32 exp and erf that the compiler vectorizes (AVX2 in the release build).
// Private to the kernels layer. Accuracy (checked against float64 in tests/kernels):
//   Exp: relative error < 4e-7 on [-87, 88]; underflows to 0 below -87.3, saturates at exp(88.37)
//   above. Erf: absolute error < 5e-7 (Abramowitz & Stegun 7.1.26, 1.5e-7, plus float32 rounding).
#pragma once

#include <bit>
#include <cstdint>

namespace switchyard::kernels::vec {

inline float Exp(float x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 in [-ln2/2, ln2/2].
  // Every value is computed unconditionally and selected at the end, so loops if-convert and
  // vectorize (a branch around a possibly-trapping product would stop that).
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.37f ? 88.37f : xc;
  x = xc;
  float n = __builtin_rintf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;  // ln2 split in two for an exact first product
  r = r - n * -2.12194440e-4f;
  // Taylor-like minimax polynomial of degree 6 for exp(r) on [-0.347, 0.347].
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = static_cast<int32_t>(n) + 127;
  float scale = std::bit_cast<float>(static_cast<uint32_t>(e) << 23);
  float result = p * scale;
  return x <= -87.3f ? 0.0f : result;
}

inline float Erf(float x) {
  float ax = __builtin_fabsf(x);
  float t = 1.0f / (1.0f + 0.3275911f * ax);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  float y = 1.0f - poly * t * Exp(-ax * ax);
  return __builtin_copysignf(y, x);
}

// The standard normal's distribution Phi(x) = (1 + erf(x / sqrt2)) / 2 and density
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi), sharing one exponential (Erf above computes the same
// exp(-x^2 / 2) inside). GELU's derivative is Phi(x) + x phi(x).
struct CdfPdf {
  float cdf, pdf;
};
inline CdfPdf NormalCdfPdf(float x) {
  float a = __builtin_fabsf(x) * 0.70710678118654752440f;
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  float e = Exp(-a * a);
  float erf = __builtin_copysignf(1.0f - poly * t * e, x);
  return {0.5f * (1.0f + erf), 0.39894228040143267794f * e};
}

}  // namespace switchyard::kernels::vec
