#include "switchyard/kernels/vec_math.h"

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
  EXPECT_LT(worst, 2e-7);
  EXPECT_EQ(Exp(-100.0f), 0.0f);
  EXPECT_EQ(Exp(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(Exp(0.0f), 1.0f);
  EXPECT_TRUE(std::isfinite(Exp(100.0f)));
  EXPECT_EQ(Exp(std::numeric_limits<float>::infinity()), Exp(88.37f));
  EXPECT_TRUE(std::isnan(Exp(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(Erf(std::numeric_limits<float>::quiet_NaN())));
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

TEST(VecMath, NormalCdfAndDensityMatchFloat64) {
  double worst_cdf = 0, worst_pdf = 0, worst_tail = 0;
  for (double x = -12.0; x <= 12.0; x += 0.0011) {
    float xf = static_cast<float>(x);
    double xd = xf;
    CdfPdf c = NormalCdfPdf(xf);
    worst_cdf = std::max(worst_cdf, std::abs(c.cdf - 0.5 * std::erfc(-xd / std::sqrt(2.0))));
    double pdf = std::exp(-0.5 * xd * xd) / std::sqrt(2.0 * M_PI);
    double rel = std::abs(c.pdf - pdf) / pdf;
    (std::abs(x) <= 4.0 ? worst_pdf : worst_tail) =
        std::max(std::abs(x) <= 4.0 ? worst_pdf : worst_tail, rel);
  }
  EXPECT_LT(worst_cdf, 3e-7);
  // Relative error of the density: the float argument x^2 / 2 carries a rounding error that grows
  // with x^2, so it is looser in the tails (where the density is below 1e-4).
  EXPECT_LT(worst_pdf, 2e-6);
  EXPECT_LT(worst_tail, 3e-5);
  // Far tails: the density underflows to 0 and the distribution saturates.
  for (float x : {-1e30f, -100.0f, 100.0f, 1e30f}) {
    CdfPdf c = NormalCdfPdf(x);
    EXPECT_EQ(c.pdf, 0.0f);
    EXPECT_EQ(c.cdf, x < 0 ? 0.0f : 1.0f);
  }
}

}  // namespace
}  // namespace switchyard::kernels::vec
