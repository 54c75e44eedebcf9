#include "switchyard/core/rng.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace switchyard {
namespace {

// Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32_10).
TEST(Philox, MatchesRandom123KnownAnswers) {
  auto r = Philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r, (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  r = Philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(r, (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  r = Philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(r, (std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(CounterRng, IsAPureFunctionOfSeedStreamIndex) {
  CounterRng a(7, kStreamGateNoise), b(7, kStreamGateNoise);
  // Order of draws does not matter.
  float late = a.Normal(1000);
  for (uint64_t i = 0; i < 100; ++i) (void)a.Normal(i);
  EXPECT_EQ(a.Normal(1000), late);
  EXPECT_EQ(b.Normal(1000), late);
  // Different streams and seeds differ.
  EXPECT_NE(CounterRng(7, kStreamGumbel).Uniform(5), CounterRng(7, kStreamGateNoise).Uniform(5));
  EXPECT_NE(CounterRng(8, kStreamGateNoise).Uniform(5), CounterRng(7, kStreamGateNoise).Uniform(5));
}

TEST(CounterRng, UniformIsInOpenIntervalWithRightMoments) {
  CounterRng rng(1, kStreamData);
  const int n = 200000;
  double sum = 0, sum2 = 0;
  for (int i = 0; i < n; ++i) {
    float u = rng.Uniform(static_cast<uint64_t>(i), i % 4);
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
    sum2 += u * u;
  }
  double mean = sum / n, var = sum2 / n - mean * mean;
  EXPECT_NEAR(mean, 0.5, 0.005);
  EXPECT_NEAR(var, 1.0 / 12, 0.002);
  EXPECT_GT(BitsToOpenUnit(0), 0.0f);
  EXPECT_LT(BitsToOpenUnit(0xffffffffu), 1.0f);
}

TEST(CounterRng, NormalAndGumbelMoments) {
  CounterRng rng(3, kStreamGateNoise);
  const int n = 200000;
  double s = 0, s2 = 0, g = 0;
  for (int i = 0; i < n; ++i) {
    double x = rng.Normal(static_cast<uint64_t>(i));
    s += x;
    s2 += x * x;
    g += rng.Gumbel(static_cast<uint64_t>(i));
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
  EXPECT_NEAR(g / n, 0.5772156649, 0.01);  // Euler-Mascheroni
}

}  // namespace
}  // namespace switchyard
