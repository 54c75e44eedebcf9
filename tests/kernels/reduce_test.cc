// The vectorizing reductions (kernels/reduce.h) against float64, and their fixed order.
#include "switchyard/kernels/reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "testing/random.h"

namespace switchyard::kernels {
namespace {

using testing::RandomVector;

constexpr int64_t kSizes[] = {0, 1, 2, 7, 15, 16, 17, 31, 33, 64, 65, 100, 128, 1000, 4099};

TEST(Reduce, SumsAndDotsAreWithinFloatRoundingOfFloat64) {
  for (int64_t n : kSizes) {
    std::vector<float> a = RandomVector(static_cast<size_t>(n), 11 + n);
    std::vector<float> b = RandomVector(static_cast<size_t>(n), 12 + n);
    double sum = 0, abs_sum = 0, dot = 0, abs_dot = 0, dev = 0;
    const float c = 0.25f;
    for (int64_t j = 0; j < n; ++j) {
      sum += a[j];
      abs_sum += std::abs(a[j]);
      dot += static_cast<double>(a[j]) * b[j];
      abs_dot += std::abs(static_cast<double>(a[j]) * b[j]);
      dev += (static_cast<double>(a[j]) - c) * (static_cast<double>(a[j]) - c);
    }
    // A float sum of n terms in any order is within n * eps * sum |terms| of the exact sum.
    const double eps = std::numeric_limits<float>::epsilon();
    const double tol = static_cast<double>(n + 1) * eps;
    EXPECT_NEAR(Sum(a.data(), n), sum, tol * abs_sum + 1e-30) << n;
    EXPECT_NEAR(Dot(a.data(), b.data(), n), dot, tol * abs_dot + 1e-30) << n;
    EXPECT_NEAR(SumSquaredDeviation(a.data(), c, n), dev, tol * dev + 1e-30) << n;
  }
}

TEST(Reduce, ExactWhereFloatIsExact) {
  // Small integers add exactly in any order.
  for (int64_t n : kSizes) {
    std::vector<float> a(static_cast<size_t>(n));
    double want = 0;
    for (int64_t j = 0; j < n; ++j) {
      a[j] = static_cast<float>((j * 7) % 13) - 6.0f;
      want += a[j];
    }
    EXPECT_EQ(Sum(a.data(), n), static_cast<float>(want)) << n;
  }
}

TEST(Reduce, MaxEqualsTheSequentialLoopIncludingNaNsAndInfinities) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : kSizes) {
    std::vector<float> a = RandomVector(static_cast<size_t>(n), 21 + n);
    for (int variant = 0; variant < 4; ++variant) {
      std::vector<float> x = a;
      if (n > 0 && variant == 1) x[static_cast<size_t>(n / 2)] = nan;
      if (n > 0 && variant == 2) x[static_cast<size_t>(n - 1)] = inf;
      if (variant == 3) std::fill(x.begin(), x.end(), nan);
      float want = -inf;
      for (float v : x) want = std::max(want, v);
      EXPECT_EQ(Max(x.data(), n), want) << n << " variant " << variant;
    }
  }
  EXPECT_EQ(Max(nullptr, 0), -inf);
}

// The documented order written out plainly: lane l sums the elements j with j % 16 == l, left to
// right; then lanes l and l + w are added for w = 8, 4, 2, 1.
float DocumentedOrderSum(const std::vector<float>& x) {
  float lane[16] = {};
  for (size_t j = 0; j < x.size(); ++j) lane[j % 16] += x[j];
  for (int w = 8; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  }
  return lane[0];
}

TEST(Reduce, SumFollowsTheDocumentedOrderBitForBit) {
  for (int64_t n : kSizes) {
    // Values of very different magnitudes, so that another order would round differently.
    std::vector<float> x = RandomVector(static_cast<size_t>(n), 31 + n);
    for (size_t j = 0; j < x.size(); j += 5) x[j] *= 1e6f;
    EXPECT_EQ(Sum(x.data(), n), DocumentedOrderSum(x)) << n;
  }
  // And it is not the left-to-right order (which this input rounds differently).
  std::vector<float> x = {1e8f, 1.0f, -1e8f, 1.0f};
  x.resize(40, 1.0f);
  float left_to_right = 0;
  for (float v : x) left_to_right += v;
  EXPECT_NE(Sum(x.data(), static_cast<int64_t>(x.size())), left_to_right);
  EXPECT_EQ(Sum(x.data(), static_cast<int64_t>(x.size())), DocumentedOrderSum(x));
}

TEST(Reduce, OrderDependsOnlyOnTheLength) {
  // The same values at another address (another alignment) give the same bits.
  std::vector<float> a = RandomVector(1003, 5);
  std::vector<float> shifted(a.size() + 3);
  std::copy(a.begin(), a.end(), shifted.begin() + 3);
  EXPECT_EQ(Sum(a.data(), 1003), Sum(shifted.data() + 3, 1003));
  EXPECT_EQ(Dot(a.data(), a.data(), 1003), Dot(shifted.data() + 3, shifted.data() + 3, 1003));
}

}  // namespace
}  // namespace switchyard::kernels
