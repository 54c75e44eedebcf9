#include "kernels/vec_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace switchyard::kernels::vec {
namespace {

TEST(VecMath, ExpRelativeErrorIsSmallOverTheRange) {
  double worst = 0;
  for (double x = -87.0; x <= 88.0; x += 0.0013) {
    double want = std::exp(x);
    double got = Exp(static_cast<float>(x));
    // Compare against exp of the float-rounded argument, which is what the kernel sees.
    want = std::exp(static_cast<double>(static_cast<float>(x)));
    worst = std::max(worst, std::abs(got - want) / want);
  }
  EXPECT_LT(worst, 4e-7);
  EXPECT_EQ(Exp(-100.0f), 0.0f);
  EXPECT_EQ(Exp(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(Exp(0.0f), 1.0f);
  EXPECT_TRUE(std::isfinite(Exp(100.0f)));
}

TEST(VecMath, ErfAbsoluteErrorIsSmall) {
  double worst = 0;
  for (double x = -6.0; x <= 6.0; x += 0.0007) {
    float xf = static_cast<float>(x);
    worst = std::max(worst, std::abs(Erf(xf) - std::erf(static_cast<double>(xf))));
  }
  EXPECT_LT(worst, 5e-7);
  EXPECT_EQ(Erf(0.0f), 0.0f);
  EXPECT_NEAR(Erf(10.0f), 1.0f, 1e-7);
  EXPECT_NEAR(Erf(-10.0f), -1.0f, 1e-7);
}

}  // namespace
}  // namespace switchyard::kernels::vec
