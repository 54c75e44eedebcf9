#include "switchyard/kernels/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "switchyard/core/error.h"
#include "switchyard/kernels/reference.h"
#include "testing/random.h"

namespace switchyard::kernels {
namespace {

using testing::AllClose;
using testing::RandomVector;

struct RowsCols {
  int64_t rows, cols;
};
const RowsCols kShapes[] = {{0, 5},   {1, 1},   {1, 7},   {3, 2},   {17, 13},
                            {64, 64}, {5, 129}, {3, 256}, {3, 257}, {2, 1000}};

TEST(Softmax, ForwardBackwardMatchReference) {
  for (auto [rows, cols] : kShapes) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
    size_t n = static_cast<size_t>(rows * cols);
    auto x = RandomVector(n, 1, -8, 8);
    auto dy = RandomVector(n, 2);
    std::vector<float> y(n), yr(n), dx(n), dxr(n);
    SoftmaxRows(x.data(), y.data(), rows, cols);
    ref::SoftmaxRows(x.data(), yr.data(), rows, cols);
    EXPECT_TRUE(AllClose(y, yr, 1e-5, 1e-7));
    SoftmaxRowsBackward(y.data(), dy.data(), dx.data(), rows, cols);
    ref::SoftmaxRowsBackward(yr.data(), dy.data(), dxr.data(), rows, cols);
    EXPECT_TRUE(AllClose(dx, dxr, 1e-4, 1e-6));
    std::vector<float> lse(static_cast<size_t>(rows)), lser(static_cast<size_t>(rows));
    LogSumExpRows(x.data(), lse.data(), rows, cols);
    ref::LogSumExpRows(x.data(), lser.data(), rows, cols);
    EXPECT_TRUE(AllClose(lse, lser, 1e-6, 1e-5));
  }
}

TEST(Softmax, StableForLargeLogits) {
  std::vector<float> x = {1000.0f, 1000.0f, -1000.0f}, y(3);
  SoftmaxRows(x.data(), y.data(), 1, 3);
  EXPECT_FLOAT_EQ(y[0], 0.5f);
  EXPECT_FLOAT_EQ(y[1], 0.5f);
  EXPECT_EQ(y[2], 0.0f);
  float lse;
  LogSumExpRows(x.data(), &lse, 1, 3);
  EXPECT_NEAR(lse, 1000.0f + std::log(2.0f), 1e-3);
}

TEST(Softmax, BackwardMatchesFiniteDifferences) {
  const int64_t cols = 6;
  auto x = RandomVector(cols, 3, -2, 2);
  auto dy = RandomVector(cols, 4);
  std::vector<float> y(cols), dx(cols);
  SoftmaxRows(x.data(), y.data(), 1, cols);
  SoftmaxRowsBackward(y.data(), dy.data(), dx.data(), 1, cols);
  for (int64_t i = 0; i < cols; ++i) {
    auto f = [&](double h) {
      std::vector<float> xp = x, yp(cols);
      xp[static_cast<size_t>(i)] += static_cast<float>(h);
      ref::SoftmaxRows(xp.data(), yp.data(), 1, cols);
      double s = 0;
      for (int64_t j = 0; j < cols; ++j) s += static_cast<double>(yp[j]) * dy[j];
      return s;
    };
    double h = 1e-3;
    EXPECT_NEAR(dx[static_cast<size_t>(i)], (f(h) - f(-h)) / (2 * h), 2e-4);
  }
}

TEST(TopK, MatchesReferenceIncludingTies) {
  for (auto [rows, cols] : kShapes) {
    if (cols == 0) continue;
    for (int64_t k : {int64_t{1}, int64_t{2}, cols}) {
      if (k > cols) continue;
      SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " k=" << k);
      // Quantize so ties are common.
      auto x = RandomVector(static_cast<size_t>(rows * cols), 5, -3, 3);
      for (auto& v : x) v = std::round(v);
      size_t out = static_cast<size_t>(rows * k);
      std::vector<int32_t> idx(out), idxr(out);
      std::vector<float> val(out), valr(out);
      TopK(x.data(), rows, cols, k, idx.data(), val.data());
      ref::TopK(x.data(), rows, cols, k, idxr.data(), valr.data());
      EXPECT_EQ(idx, idxr);
      EXPECT_EQ(val, valr);
    }
  }
}

TEST(TopK, TiesGoToLowerIndexAndNanIsLast) {
  std::vector<float> x = {1, 3, 3, std::numeric_limits<float>::quiet_NaN(), 3};
  std::vector<int32_t> idx(5);
  std::vector<float> val(5);
  TopK(x.data(), 1, 5, 5, idx.data(), val.data());
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 2, 4, 0, 3}));
  EXPECT_THROW(TopK(x.data(), 1, 5, 0, idx.data(), val.data()), InvalidArgument);
  EXPECT_THROW(TopK(x.data(), 1, 5, 6, idx.data(), val.data()), InvalidArgument);
}

TEST(Cumsum, ExclusiveAndInclusiveMatchReference) {
  for (auto [rows, cols] : kShapes) {
    size_t n = static_cast<size_t>(rows * cols);
    auto r = RandomVector(n, 6, 0, 3);
    std::vector<int32_t> in(n), out(n), want(n);
    for (size_t i = 0; i < n; ++i) in[i] = static_cast<int32_t>(r[i]);
    for (bool exclusive : {true, false}) {
      CumsumDim0(in.data(), out.data(), rows, cols, exclusive);
      ref::CumsumDim0(in.data(), want.data(), rows, cols, exclusive);
      EXPECT_EQ(out, want);
    }
    // In place.
    auto inplace = in;
    CumsumDim0(inplace.data(), inplace.data(), rows, cols, true);
    ref::CumsumDim0(in.data(), want.data(), rows, cols, true);
    EXPECT_EQ(inplace, want);
  }
}

// act and act' * dy on x against kernels::ref, forward within (rtol, atol) and backward within
// (rtol_bwd, atol_bwd).
void ExpectActivationMatchesReference(Activation act, const std::vector<float>& x,
                                      const std::vector<float>& dy, double rtol, double atol,
                                      double rtol_bwd, double atol_bwd) {
  const auto n = static_cast<int64_t>(x.size());
  std::vector<float> y(x.size()), yr(x.size()), dx(x.size()), dxr(x.size());
  ActivationForward(act, x.data(), y.data(), n);
  ref::ActivationForward(act, x.data(), yr.data(), n);
  EXPECT_TRUE(AllClose(y, yr, rtol, atol));
  ActivationBackward(act, x.data(), dy.data(), dx.data(), n);
  ref::ActivationBackward(act, x.data(), dy.data(), dxr.data(), n);
  EXPECT_TRUE(AllClose(dx, dxr, rtol_bwd, atol_bwd));
}

TEST(Activation, ForwardBackwardMatchReference) {
  for (Activation act :
       {Activation::kRelu, Activation::kGelu, Activation::kSilu, Activation::kIdentity}) {
    SCOPED_TRACE(std::string(ActivationName(act)));
    for (int64_t n : {0, 1, 31, 1000}) {
      ExpectActivationMatchesReference(act, RandomVector(static_cast<size_t>(n), 7, -6, 6),
                                       RandomVector(static_cast<size_t>(n), 8), 1e-6, 1e-6, 1e-4,
                                       1e-5);
    }
  }
}

// Inputs where erf saturates and the normal density underflows (GELU's derivative shares one
// exponential between the two).
TEST(Activation, ExtremeInputsMatchReference) {
  const std::vector<float> x = {0.0f,  -0.0f, 1e-8f,  -1e-8f, 5.0f,   -5.0f, 9.0f,
                                -9.0f, 20.0f, -20.0f, 90.0f,  -90.0f, 1e30f, -1e30f};
  for (Activation act : {Activation::kRelu, Activation::kGelu, Activation::kSilu}) {
    SCOPED_TRACE(std::string(ActivationName(act)));
    ExpectActivationMatchesReference(act, x, std::vector<float>(x.size(), 1.0f), 2e-6, 1e-6, 2e-6,
                                     1e-6);
  }
}

TEST(Activation, KnownValuesAndNames) {
  float x[3] = {-1.0f, 0.0f, 1.0f}, y[3];
  ActivationForward(Activation::kGelu, x, y, 3);
  EXPECT_NEAR(y[2], 0.8413447460685429, 1e-6);  // 1 * Phi(1), exact erf form
  EXPECT_NEAR(y[0], -0.15865525393145707, 1e-6);
  ActivationForward(Activation::kSilu, x, y, 3);
  EXPECT_NEAR(y[2], 0.7310585786300049, 1e-6);
  EXPECT_EQ(ActivationFromName("gelu"), Activation::kGelu);
  try {
    ActivationFromName("tanh");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'tanh'"), std::string::npos);
  }
}

TEST(IndexRows, GatherAndScatterAddMatchReference) {
  const int64_t src_rows = 11, cols = 9, n = 23;
  auto src = RandomVector(static_cast<size_t>(src_rows * cols), 9);
  auto r = RandomVector(n, 10, -3, static_cast<float>(src_rows));
  std::vector<int32_t> idx(n);
  for (int64_t i = 0; i < n; ++i)
    idx[static_cast<size_t>(i)] = static_cast<int32_t>(std::floor(r[i]));
  auto scale = RandomVector(n, 11);
  for (const float* s :
       {static_cast<const float*>(nullptr), static_cast<const float*>(scale.data())}) {
    std::vector<float> g(static_cast<size_t>(n * cols)), gr(g.size());
    GatherRows(src.data(), src_rows, cols, idx.data(), s, n, g.data());
    ref::GatherRows(src.data(), src_rows, cols, idx.data(), s, n, gr.data());
    EXPECT_TRUE(AllClose(g, gr, 0, 0));  // gathers are exact
    std::vector<float> d(static_cast<size_t>(src_rows * cols), 0.25f), dr = d;
    ScatterAddRows(g.data(), n, cols, idx.data(), s, d.data(), src_rows);
    ref::ScatterAddRows(g.data(), n, cols, idx.data(), s, dr.data(), src_rows);
    EXPECT_TRUE(AllClose(d, dr, 1e-6, 1e-6));
  }
  std::vector<int32_t> bad = {src_rows};
  std::vector<float> out(static_cast<size_t>(cols));
  EXPECT_THROW(GatherRows(src.data(), src_rows, cols, bad.data(), nullptr, 1, out.data()),
               InvalidArgument);
  EXPECT_THROW(ScatterAddRows(out.data(), 1, cols, bad.data(), nullptr, src.data(), src_rows),
               InvalidArgument);
  // n = 0 is a no-op.
  GatherRows(src.data(), src_rows, cols, nullptr, nullptr, 0, nullptr);
  ScatterAddRows(nullptr, 0, cols, nullptr, nullptr, src.data(), src_rows);
}

TEST(RowDot, MatchesLoop) {
  for (int cols : {7, 33, 100}) {
    auto a = RandomVector(5 * cols, 12), b = RandomVector(5 * cols, 13);
    std::vector<float> out(5);
    RowDot(a.data(), b.data(), 5, cols, out.data());
    for (int i = 0; i < 5; ++i) {
      double s = 0;
      for (int j = 0; j < cols; ++j) s += static_cast<double>(a[i * cols + j]) * b[i * cols + j];
      EXPECT_NEAR(out[i], s, 1e-5) << cols;
    }
  }
}

TEST(Softmax, InPlaceEqualsOutOfPlace) {
  for (auto [rows, cols] : kShapes) {
    size_t n = static_cast<size_t>(rows * cols);
    auto x = RandomVector(n, 3, -8, 8), dy = RandomVector(n, 4);
    std::vector<float> y(n), dx(n);
    SoftmaxRows(x.data(), y.data(), rows, cols);
    SoftmaxRows(x.data(), x.data(), rows, cols);
    EXPECT_EQ(x, y) << rows << "x" << cols;
    SoftmaxRowsBackward(y.data(), dy.data(), dx.data(), rows, cols);
    SoftmaxRowsBackward(y.data(), dy.data(), dy.data(), rows, cols);
    EXPECT_EQ(dy, dx) << rows << "x" << cols;
  }
}

}  // namespace
}  // namespace switchyard::kernels
