// Test helpers: deterministic random data and closeness checks.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "switchyard/core/rng.h"

namespace switchyard::testing {

inline std::vector<float> RandomVector(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  CounterRng rng(seed, kStreamData);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = lo + (hi - lo) * rng.Uniform(i);
  return v;
}

// Max over i of |a - b| / (atol + rtol * |b|) must be <= 1.
inline ::testing::AssertionResult AllClose(const float* a, const float* b, size_t n, double rtol,
                                           double atol) {
  for (size_t i = 0; i < n; ++i) {
    double d = std::abs(static_cast<double>(a[i]) - b[i]);
    if (!(d <= atol + rtol * std::abs(static_cast<double>(b[i])))) {
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a[i] << " vs " << b[i] << " (|diff| " << d << ")";
    }
  }
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult AllClose(const std::vector<float>& a, const std::vector<float>& b,
                                           double rtol, double atol) {
  if (a.size() != b.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  }
  return AllClose(a.data(), b.data(), a.size(), rtol, atol);
}

}  // namespace switchyard::testing
