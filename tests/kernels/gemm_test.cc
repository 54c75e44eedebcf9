#include "switchyard/kernels/gemm.h"

#include <gtest/gtest.h>

#include <tuple>

#include "switchyard/core/error.h"
#include "switchyard/kernels/reference.h"
#include "testing/random.h"

namespace switchyard::kernels {
namespace {

using testing::AllClose;
using testing::RandomVector;

// (m, n, k, trans_a, trans_b): odd sizes, zero sizes, and the gating/expert shapes.
class GemmTest : public ::testing::TestWithParam<std::tuple<int, int, int, bool, bool>> {};

TEST_P(GemmTest, MatchesReference) {
  auto [m, n, k, ta, tb] = GetParam();
  Trans trans_a = ta ? Trans::kYes : Trans::kNo, trans_b = tb ? Trans::kYes : Trans::kNo;
  // Leading dimensions with padding, to check they are honoured.
  int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;
  auto a = RandomVector(static_cast<size_t>((ta ? k : m) * lda), 1);
  auto b = RandomVector(static_cast<size_t>((tb ? n : k) * ldb), 2);
  auto c0 = RandomVector(static_cast<size_t>(m * ldc), 3);
  for (float beta : {0.0f, 0.5f}) {
    auto c = c0, want = c0;
    Gemm(trans_a, trans_b, m, n, k, 1.5f, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
    ref::Gemm(trans_a, trans_b, m, n, k, 1.5f, a.data(), lda, b.data(), ldb, beta, want.data(),
              ldc);
    EXPECT_TRUE(AllClose(c, want, 1e-5, 1e-4 * std::max(1, k) / 64.0)) << "beta " << beta;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest,
                         ::testing::Combine(::testing::Values(0, 1, 7, 33),
                                            ::testing::Values(0, 1, 5, 64),
                                            ::testing::Values(0, 1, 13, 100), ::testing::Bool(),
                                            ::testing::Bool()));

TEST(Gemm, RejectsBadLeadingDimension) {
  std::vector<float> a(16), b(16), c(16);
  EXPECT_THROW(Gemm(Trans::kNo, Trans::kNo, 4, 4, 4, 1, a.data(), 3, b.data(), 4, 0, c.data(), 4),
               InvalidArgument);
  EXPECT_THROW(Gemm(Trans::kNo, Trans::kNo, 4, 4, 4, 1, a.data(), 4, b.data(), 4, 0, c.data(), 3),
               InvalidArgument);
}

TEST(Gemm, ZeroInnerDimensionScalesC) {
  std::vector<float> c = {1, 2, 3, 4};
  Gemm(Trans::kNo, Trans::kNo, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1, 1.5f, 2}));
  Gemm(Trans::kNo, Trans::kNo, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0, 0, 0, 0}));
}

// Grouped GEMM over variable-sized groups, as dropless experts use it: group g multiplies
// rows [off_g, off_g + m_g) of X [sum m, K] by W_g^T (W [G, N, K]) into Y [sum m, N].
class GroupedGemmTest : public ::testing::TestWithParam<int> {};

TEST_P(GroupedGemmTest, VariableGroupsMatchReference) {
  int threads = GetParam();
  const std::vector<int64_t> sizes = {5, 0, 17, 1, 0, 33, 2};
  const int64_t n = 19, k = 23;
  int64_t total = 0;
  for (auto s : sizes) total += s;
  auto x = RandomVector(static_cast<size_t>(total * k), 4);
  auto w = RandomVector(sizes.size() * n * k, 5);
  std::vector<float> y(static_cast<size_t>(total * n), -7.0f), want(y.size(), 0.0f);
  std::vector<GemmProblem> problems;
  int64_t off = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    problems.push_back(
        {sizes[g], n, k, x.data() + off * k, k, w.data() + g * n * k, k, y.data() + off * n, n});
    ref::Gemm(Trans::kNo, Trans::kYes, sizes[g], n, k, 1.0f, x.data() + off * k, k,
              w.data() + g * n * k, k, 0.0f, want.data() + off * n, n);
    off += sizes[g];
  }
  GroupedGemm(Trans::kNo, Trans::kYes, 1.0f, 0.0f, problems, threads);
  EXPECT_TRUE(AllClose(y, want, 1e-5, 1e-5));

  // The weight-gradient form: dW_g = dY_g^T X_g, reducing over the group's rows (m_g may be 0).
  auto dy = RandomVector(y.size(), 6);
  std::vector<float> dw(w.size(), 3.0f), dw_want(w.size(), 0.0f);
  problems.clear();
  off = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    problems.push_back(
        {n, k, sizes[g], dy.data() + off * n, n, x.data() + off * k, k, dw.data() + g * n * k, k});
    ref::Gemm(Trans::kYes, Trans::kNo, n, k, sizes[g], 1.0f, dy.data() + off * n, n,
              x.data() + off * k, k, 0.0f, dw_want.data() + g * n * k, k);
    off += sizes[g];
  }
  GroupedGemm(Trans::kYes, Trans::kNo, 1.0f, 0.0f, problems, threads);
  EXPECT_TRUE(AllClose(dw, dw_want, 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Threads, GroupedGemmTest, ::testing::Values(1, 2, 3));

TEST(BatchedGemm, EqualGroupsMatchReference) {
  const int64_t batch = 4, m = 9, n = 6, k = 11;
  auto a = RandomVector(static_cast<size_t>(batch * m * k), 7);
  auto b = RandomVector(static_cast<size_t>(batch * n * k), 8);
  std::vector<float> c(static_cast<size_t>(batch * m * n)), want(c.size());
  BatchedGemm(Trans::kNo, Trans::kYes, batch, m, n, k, 1.0f, a.data(), k, m * k, b.data(), k, n * k,
              0.0f, c.data(), n, m * n, 2);
  for (int64_t i = 0; i < batch; ++i) {
    ref::Gemm(Trans::kNo, Trans::kYes, m, n, k, 1.0f, a.data() + i * m * k, k, b.data() + i * n * k,
              k, 0.0f, want.data() + i * m * n, n);
  }
  EXPECT_TRUE(AllClose(c, want, 1e-5, 1e-5));
  // batch = 0 touches nothing.
  BatchedGemm(Trans::kNo, Trans::kYes, 0, m, n, k, 1.0f, nullptr, k, 0, nullptr, k, 0, 0.0f,
              nullptr, n, 0);
}

TEST(Blas, ThreadCountIsSettable) {
  int before = BlasThreads();
  SetBlasThreads(1);
  EXPECT_EQ(BlasThreads(), 1);
  SetBlasThreads(before);
  EXPECT_NE(std::string(BlasConfig()).find("OpenBLAS"), std::string::npos);
}

}  // namespace
}  // namespace switchyard::kernels
