// Row reductions that vectorize: sums, dot products and maxima of a float32 vector.
//
// A left-to-right float sum is a chain of dependent adds (one per 4 cycles): the compiler may not
// reorder it, so it runs scalar. These keep 16 interleaved partial sums (lane l takes the elements
// j with j % 16 == l), which the compiler turns into two 8-wide vector accumulators, and combine
// them pairwise at the end. For a given build the order depends only on n -- not on threads or
// alignment -- so a result is the same on every rank and every run; it differs from the
// left-to-right sum by float rounding (tests/kernels/reduce_test.cc bounds it against float64 and
// checks the order bit for bit). (Dot may fuse its multiply-adds, as any GCC -O2 build may.)
#pragma once

#include <cstdint>
#include <limits>

namespace switchyard::kernels {

namespace reduce_detail {
inline constexpr int kLanes = 16;

inline float Combine(float (&acc)[kLanes]) {
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}
}  // namespace reduce_detail

// sum_j f(j) for j in [0, n), with f(j) a float (inlined; f must not have side effects).
template <typename F>
inline float SumOver(int64_t n, F&& f) {
  using reduce_detail::kLanes;
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma GCC unroll 16
    for (int l = 0; l < kLanes; ++l) acc[l] += f(j + l);
  }
  for (int l = 0; j + l < n; ++l) acc[l] += f(j + l);
  return reduce_detail::Combine(acc);
}

// sum_j x[j].
inline float Sum(const float* x, int64_t n) {
  return SumOver(n, [x](int64_t j) { return x[j]; });
}

// sum_j a[j] * b[j].
inline float Dot(const float* a, const float* b, int64_t n) {
  return SumOver(n, [a, b](int64_t j) { return a[j] * b[j]; });
}

// sum_j (x[j] - c)^2.
inline float SumSquaredDeviation(const float* x, float c, int64_t n) {
  return SumOver(n, [x, c](int64_t j) {
    const float d = x[j] - c;
    return d * d;
  });
}

// max_j x[j] with NaNs skipped (as a loop of std::max(m, x[j]) from -inf): -inf for n = 0 or
// when every element is NaN. Exact (a maximum does not round), so equal in value to the
// sequential loop; only the sign of a zero maximum may differ when -0 and +0 tie.
inline float Max(const float* x, int64_t n) {
  using reduce_detail::kLanes;
  float acc[kLanes];
  for (float& a : acc) a = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma GCC unroll 16
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] < x[j + l] ? x[j + l] : acc[l];
  }
  for (int l = 0; j + l < n; ++l) acc[l] = acc[l] < x[j + l] ? x[j + l] : acc[l];
  float m = acc[0];
  for (int l = 1; l < kLanes; ++l) m = m < acc[l] ? acc[l] : m;
  return m;
}

}  // namespace switchyard::kernels
