// Finite-difference gradient checks for the train layer's tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include "switchyard/core/rng.h"
#include "switchyard/core/tensor.h"

namespace switchyard::train::testing {

// Random float32 tensor, U(lo, hi), keyed by seed.
inline Tensor RandomTensor(Shape shape, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Tensor t = Tensor::Empty(std::move(shape));
  CounterRng rng(seed, kStreamData);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = lo + (hi - lo) * rng.Uniform(uint64_t(i));
  return t;
}

// sum(a * b) in double.
inline double Dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    s += static_cast<double>(a.data<float>()[i]) * b.data<float>()[i];
  }
  return s;
}

// Compares `grad` (analytic) with central differences of `loss` w.r.t. the elements of `value`,
// at every element (up to max_checks, spread evenly). |fd - grad| <= atol + rtol * |fd|.
inline ::testing::AssertionResult CheckGradient(const std::string& what,
                                                const std::function<double()>& loss,
                                                const Tensor& value, const Tensor& grad,
                                                double eps = 1e-3, double rtol = 2e-2,
                                                double atol = 2e-4, int64_t max_checks = 64) {
  float* v = value.data<float>();
  const float* g = grad.data<float>();
  int64_t n = value.numel();
  int64_t stride = std::max<int64_t>(1, n / max_checks);
  double worst = 0;
  for (int64_t i = 0; i < n; i += stride) {
    float saved = v[i];
    v[i] = saved + static_cast<float>(eps);
    double plus = loss();
    v[i] = saved - static_cast<float>(eps);
    double minus = loss();
    v[i] = saved;
    double fd = (plus - minus) / (2 * eps);
    double err = std::abs(fd - g[i]);
    worst = std::max(worst, err);
    if (!(err <= atol + rtol * std::abs(fd))) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: analytic " << g[i] << " vs finite difference " << fd
             << " (|diff| " << err << ")";
    }
  }
  return ::testing::AssertionSuccess() << what << ": worst |diff| " << worst;
}

}  // namespace switchyard::train::testing
