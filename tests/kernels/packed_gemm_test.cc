#include "switchyard/kernels/packed_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/reference.h"
#include "testing/random.h"

namespace switchyard::kernels {
namespace {

using testing::AllClose;
using testing::RandomVector;

// (m, n, k, trans_a, trans_b): m = an expert's rows (0, 1, odd, more than one 144-row block; the
// last row tile holds 1 to 5 rows: 7, 32, 147, 4, 17), n
// and k not multiples of the 6 x 16 tile, k across the 256-deep block.
class PackedGemmTest : public ::testing::TestWithParam<std::tuple<int, int, int, bool, bool>> {};

TEST_P(PackedGemmTest, MatchesFloat64Reference) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  auto [m, n, k, ta, tb] = GetParam();
  const Trans trans_a = ta ? Trans::kYes : Trans::kNo, trans_b = tb ? Trans::kYes : Trans::kNo;
  // Leading dimensions with padding, to check they are honoured.
  const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;
  auto a = RandomVector(static_cast<size_t>((ta ? k : m) * lda), 1);
  auto b = RandomVector(static_cast<size_t>((tb ? n : k) * ldb), 2);
  auto c0 = RandomVector(static_cast<size_t>(m * ldc), 3);
  for (float beta : {0.0f, 0.5f, 1.0f}) {
    auto c = c0, want = c0;
    PackedGemm(trans_a, trans_b, {m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc}, 1.5f,
               beta);
    ref::Gemm(trans_a, trans_b, m, n, k, 1.5f, a.data(), lda, b.data(), ldb, beta, want.data(),
              ldc);
    EXPECT_TRUE(AllClose(c, want, 1e-5, 2e-5 * std::max(1, k))) << "beta " << beta;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PackedGemmTest,
                         ::testing::Combine(::testing::Values(0, 1, 4, 7, 17, 32, 147, 151),
                                            ::testing::Values(0, 1, 17, 40),
                                            ::testing::Values(0, 1, 13, 300), ::testing::Bool(),
                                            ::testing::Bool()));

// Wider than one 2048-column block of B, with an edge tile in both directions.
TEST(PackedGemm, WideProductCrossesColumnBlocks) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  const int64_t m = 9, n = 2061, k = 37;
  auto a = RandomVector(static_cast<size_t>(m * k), 4);
  auto b = RandomVector(static_cast<size_t>(n * k), 5);
  std::vector<float> c(static_cast<size_t>(m * n), 7.0f), want = c;
  PackedGemm(Trans::kNo, Trans::kYes, {m, n, k, a.data(), k, b.data(), k, c.data(), n}, 1.0f, 0.0f);
  ref::Gemm(Trans::kNo, Trans::kYes, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, want.data(), n);
  EXPECT_TRUE(AllClose(c, want, 1e-5, 1e-4));
}

// The expert FFN's three forms over groups of rows of one buffer (M_e = 0, 1, 7, 13, 512), per-
// group weights, the weight gradient accumulated with beta = 1 on top of a first pass.
TEST(PackedGroupedGemm, ExpertFormsMatchReference) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  const std::vector<int64_t> rows = {0, 1, 7, 13, 512};
  const int64_t model = 37, hidden = 50, groups = static_cast<int64_t>(rows.size());
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  auto x = RandomVector(static_cast<size_t>(total * model), 6);
  auto dy = RandomVector(static_cast<size_t>(total * hidden), 7);
  auto w = RandomVector(static_cast<size_t>(groups * hidden * model), 8);  // [G, hidden, model]
  struct Form {
    Trans ta, tb;
    const char* name;
  };
  for (const Form& f : {Form{Trans::kNo, Trans::kYes, "forward X W^T"},
                        Form{Trans::kNo, Trans::kNo, "data gradient dY W"},
                        Form{Trans::kYes, Trans::kNo, "weight gradient dY^T X"}}) {
    std::vector<GemmProblem> got_p, want_p;
    const bool wgrad = f.ta == Trans::kYes;
    const int64_t out_rows = wgrad ? groups * hidden : total;
    const int64_t out_cols = f.tb == Trans::kYes ? hidden : model;
    std::vector<float> got(static_cast<size_t>(out_rows * out_cols), 0.0f), want = got;
    int64_t off = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const float* wg = w.data() + g * hidden * model;
      GemmProblem p;
      if (f.tb == Trans::kYes) {  // [rows, model] x [hidden, model]^T
        p = {rows[g], hidden, model, x.data() + off * model, model, wg, model, nullptr, hidden};
        p.c = got.data() + off * hidden;
      } else if (!wgrad) {  // [rows, hidden] x [hidden, model]
        p = {rows[g], model, hidden, dy.data() + off * hidden, hidden, wg, model, nullptr, model};
        p.c = got.data() + off * model;
      } else {  // [rows, hidden]^T x [rows, model]
        p = {hidden,  model,
             rows[g], dy.data() + off * hidden,
             hidden,  x.data() + off * model,
             model,   got.data() + g * hidden * model,
             model};
      }
      got_p.push_back(p);
      GemmProblem q = p;
      q.c = want.data() + (p.c - got.data());
      want_p.push_back(q);
      off += rows[g];
    }
    const int passes = wgrad ? 2 : 1;  // the second pass accumulates (beta = 1)
    for (int pass = 0; pass < passes; ++pass) {
      const float beta = pass == 0 ? 0.0f : 1.0f;
      PackedGroupedGemm(f.ta, f.tb, 1.0f, beta, got_p);
      for (const GemmProblem& q : want_p) {
        ref::Gemm(f.ta, f.tb, q.m, q.n, q.k, 1.0f, q.a, q.lda, q.b, q.ldb, beta, q.c, q.ldc);
      }
    }
    EXPECT_TRUE(AllClose(got, want, 1e-5, 1e-4 * 8)) << f.name;
  }
}

// The fused pairs (an expert's SwiGLU gate and up products) against two float64 products, on
// odd shapes: m across the 144-row block, n not a multiple of 16 (the column parts' panels are
// padded), k across the 256-deep block, every transposition (and below, a pair wider than one
// column block of B: SharedA then runs the products one after the other).
class PackedGemmPairTest : public ::testing::TestWithParam<std::tuple<int, int, int, bool, bool>> {
};

TEST_P(PackedGemmPairTest, MatchesFloat64Reference) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  auto [m, n, k, ta, tb] = GetParam();
  const Trans trans_a = ta ? Trans::kYes : Trans::kNo, trans_b = tb ? Trans::kYes : Trans::kNo;
  for (bool shared_a : {true, false}) {
    // The second product's non-shared size differs from the first's (n + 5 or m + 7).
    const int64_t m2 = shared_a ? m : m + 7, n2 = shared_a ? n + 5 : n;
    const int64_t lda1 = (ta ? m : k) + 3, lda2 = (ta ? m2 : k) + 1;
    const int64_t ldb1 = (tb ? k : n) + 1, ldb2 = (tb ? k : n2) + 2;
    auto a1 = RandomVector(static_cast<size_t>((ta ? k : m) * lda1), 11);
    auto a2 = RandomVector(static_cast<size_t>((ta ? k : m2) * lda2), 12);
    auto b1 = RandomVector(static_cast<size_t>((tb ? n : k) * ldb1), 13);
    auto b2 = RandomVector(static_cast<size_t>((tb ? n2 : k) * ldb2), 14);
    auto c1 = RandomVector(static_cast<size_t>(m * (n + 2)), 15);
    auto c2 = RandomVector(static_cast<size_t>(m2 * (n2 + 4)), 16);
    for (float beta : {0.0f, 1.0f}) {
      auto got1 = c1, got2 = c2, want1 = c1, want2 = c2;
      GemmProblem p1{m, n, k, a1.data(), lda1, b1.data(), ldb1, got1.data(), n + 2};
      GemmProblem p2 =
          shared_a ? GemmProblem{m2, n2, k, a1.data(), lda1, b2.data(), ldb2, got2.data(), n2 + 4}
                   : GemmProblem{m2, n2, k, a2.data(), lda2, b1.data(), ldb1, got2.data(), n2 + 4};
      if (shared_a) {
        PackedGemmSharedA(trans_a, trans_b, p1, p2, 0.5f, beta);
      } else {
        PackedGemmSharedB(trans_a, trans_b, p1, p2, 0.5f, beta);
      }
      ref::Gemm(trans_a, trans_b, m, n, k, 0.5f, p1.a, p1.lda, p1.b, p1.ldb, beta, want1.data(),
                n + 2);
      ref::Gemm(trans_a, trans_b, m2, n2, k, 0.5f, p2.a, p2.lda, p2.b, p2.ldb, beta, want2.data(),
                n2 + 4);
      const double atol = 2e-5 * std::max(1, k);
      EXPECT_TRUE(AllClose(got1, want1, 1e-5, atol)) << "first, shared_a " << shared_a;
      EXPECT_TRUE(AllClose(got2, want2, 1e-5, atol)) << "second, shared_a " << shared_a;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PackedGemmPairTest,
                         ::testing::Combine(::testing::Values(0, 1, 13, 151),
                                            ::testing::Values(0, 17, 40),
                                            ::testing::Values(0, 13, 300), ::testing::Bool(),
                                            ::testing::Bool()));

TEST(PackedGemm, WidePairsMatchReference) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  const int64_t m = 9, n = 1100, k = 37;  // 2 x 1104 padded columns > one 2048-column block
  auto a = RandomVector(static_cast<size_t>(m * k), 21);
  auto b1 = RandomVector(static_cast<size_t>(n * k), 22);
  auto b2 = RandomVector(static_cast<size_t>(n * k), 23);
  std::vector<float> c1(static_cast<size_t>(m * n), 7.0f), c2 = c1, want1 = c1, want2 = c1;
  for (bool shared_a : {true, false}) {
    // SharedB: C1 = B1 A^T and C2 = B2 A^T ([n, m], 1100 rows: 8 row blocks of each part).
    if (shared_a) {
      PackedGemmSharedA(Trans::kNo, Trans::kYes, {m, n, k, a.data(), k, b1.data(), k, c1.data(), n},
                        {m, n, k, a.data(), k, b2.data(), k, c2.data(), n}, 1.0f, 0.0f);
      ref::Gemm(Trans::kNo, Trans::kYes, m, n, k, 1.0f, a.data(), k, b1.data(), k, 0.0f,
                want1.data(), n);
      ref::Gemm(Trans::kNo, Trans::kYes, m, n, k, 1.0f, a.data(), k, b2.data(), k, 0.0f,
                want2.data(), n);
    } else {
      PackedGemmSharedB(Trans::kNo, Trans::kYes, {n, m, k, b1.data(), k, a.data(), k, c1.data(), m},
                        {n, m, k, b2.data(), k, a.data(), k, c2.data(), m}, 1.0f, 0.0f);
      ref::Gemm(Trans::kNo, Trans::kYes, n, m, k, 1.0f, b1.data(), k, a.data(), k, 0.0f,
                want1.data(), m);
      ref::Gemm(Trans::kNo, Trans::kYes, n, m, k, 1.0f, b2.data(), k, a.data(), k, 0.0f,
                want2.data(), m);
    }
    EXPECT_TRUE(AllClose(c1, want1, 1e-5, 1e-4)) << "shared_a " << shared_a;
    EXPECT_TRUE(AllClose(c2, want2, 1e-5, 1e-4)) << "shared_a " << shared_a;
  }
}

TEST(PackedGemm, PairRejectsProductsThatDoNotShare) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  std::vector<float> a(64), b(64), c(64), d(64);
  const GemmProblem p1{4, 4, 4, a.data(), 4, b.data(), 4, c.data(), 4};
  GemmProblem p2 = p1;
  p2.a = d.data();
  EXPECT_THROW(PackedGemmSharedA(Trans::kNo, Trans::kNo, p1, p2, 1.0f, 0.0f), InvalidArgument);
  p2 = p1;
  p2.k = 3;
  EXPECT_THROW(PackedGemmSharedB(Trans::kNo, Trans::kNo, p1, p2, 1.0f, 0.0f), InvalidArgument);
}

// The tile epilogue: called on every element of C exactly once, after that element (and, for a
// pair, the second product's element at the same place) holds its final value, and what it
// writes into C stays. The epilogue here records c1 * c2 (c1 alone for one product), then negates
// C1; checked against float64 products on odd shapes: m across the 144-row block, n not a
// multiple of 16, k across the 256-deep block and k = 0, a pair wider than one column block (run
// apart, one call over all of C), NT (the SwiGLU's gate/up form) and NN.
struct EpilogueProbe {
  float* c1;
  const float* c2;  // null: one product
  int64_t ldc;
  float* seen;  // [m, n] c1 * c2 at the call
  int64_t n;
  std::vector<int>* visits;  // [m, n]
  static void Fn(void* ctx, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    auto* e = static_cast<EpilogueProbe*>(ctx);
    for (int64_t i = row; i < row + rows; ++i) {
      for (int64_t j = col; j < col + cols; ++j) {
        float& v = e->c1[i * e->ldc + j];
        e->seen[i * e->n + j] = e->c2 ? v * e->c2[i * e->ldc + j] : v;
        v = -v;
        ++(*e->visits)[static_cast<size_t>(i * e->n + j)];
      }
    }
  }
};

TEST(PackedGemm, TileEpilogueSeesFinalValuesOnce) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  for (auto [m, n, k] : {std::tuple{151, 40, 300}, std::tuple{13, 17, 13}, std::tuple{7, 1100, 37},
                         std::tuple{5, 33, 0}}) {
    for (bool pair : {true, false}) {
      for (Trans tb : {Trans::kYes, Trans::kNo}) {
        const int64_t ldc = n + 3, ldb = tb == Trans::kYes ? k + 1 : n + 1;
        auto a = RandomVector(static_cast<size_t>(m * (k + 2)), 31);
        auto b1 = RandomVector(static_cast<size_t>((tb == Trans::kYes ? n : k) * ldb), 32);
        auto b2 = RandomVector(static_cast<size_t>((tb == Trans::kYes ? n : k) * ldb), 33);
        std::vector<float> c1(static_cast<size_t>(m * ldc), 5.0f), c2 = c1, want1 = c1, want2 = c1;
        std::vector<float> seen(static_cast<size_t>(m * n), 0.0f), want_seen = seen;
        std::vector<int> visits(static_cast<size_t>(m * n), 0);
        EpilogueProbe probe{c1.data(), pair ? c2.data() : nullptr, ldc, seen.data(), n, &visits};
        const TileEpilogue epi{&EpilogueProbe::Fn, &probe};
        const GemmProblem p1{m, n, k, a.data(), k + 2, b1.data(), ldb, c1.data(), ldc};
        GemmProblem p2 = p1;
        p2.b = b2.data();
        p2.c = c2.data();
        if (pair) {
          PackedGemmSharedA(Trans::kNo, tb, p1, p2, 1.0f, 0.0f, &epi);
        } else {
          PackedGemm(Trans::kNo, tb, p1, 1.0f, 0.0f, &epi);
        }
        ref::Gemm(Trans::kNo, tb, m, n, k, 1.0f, a.data(), k + 2, b1.data(), ldb, 0.0f,
                  want1.data(), ldc);
        ref::Gemm(Trans::kNo, tb, m, n, k, 1.0f, a.data(), k + 2, b2.data(), ldb, 0.0f,
                  want2.data(), ldc);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            const float w1 = want1[static_cast<size_t>(i * ldc + j)];
            want_seen[static_cast<size_t>(i * n + j)] =
                pair ? w1 * want2[static_cast<size_t>(i * ldc + j)] : w1;
            want1[static_cast<size_t>(i * ldc + j)] = -w1;
          }
        }
        const std::string what = "m " + std::to_string(m) + " n " + std::to_string(n) + " k " +
                                 std::to_string(k) + (pair ? " pair" : " single") +
                                 (tb == Trans::kYes ? " NT" : " NN");
        EXPECT_EQ(std::count(visits.begin(), visits.end(), 1), m * n) << what;
        const double atol = 2e-5 * std::max(1, k);
        EXPECT_TRUE(AllClose(seen, want_seen, 1e-4, atol * std::max(1, k))) << what;
        EXPECT_TRUE(AllClose(c1, want1, 1e-5, atol)) << what;
        if (pair) {
          EXPECT_TRUE(AllClose(c2, want2, 1e-5, atol)) << what;
        }
      }
    }
  }
  std::vector<float> a(64), b(64), c(64), d(64);
  int calls = 0;
  const TileEpilogue count{
      [](void* ctx, int64_t, int64_t, int64_t, int64_t) { ++*static_cast<int*>(ctx); }, &calls};
  const GemmProblem p1{4, 4, 4, a.data(), 4, b.data(), 4, c.data(), 4};
  GemmProblem p2 = p1;
  p2.n = 3;
  p2.c = d.data();
  EXPECT_THROW(PackedGemmSharedA(Trans::kNo, Trans::kNo, p1, p2, 1.0f, 0.0f, &count),
               InvalidArgument);
  EXPECT_EQ(calls, 0);
}

TEST(PackedGemm, RejectsBadSizes) {
  if (!PackedGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernel is not used";
  std::vector<float> a(16), b(16), c(16);
  EXPECT_THROW(PackedGemm(Trans::kNo, Trans::kNo, {4, 4, 4, a.data(), 3, b.data(), 4, c.data(), 4},
                          1.0f, 0.0f),
               InvalidArgument);
  EXPECT_THROW(PackedGemm(Trans::kNo, Trans::kNo, {4, 4, 4, a.data(), 4, b.data(), 4, c.data(), 3},
                          1.0f, 0.0f),
               InvalidArgument);
  EXPECT_THROW(PackedGemm(Trans::kNo, Trans::kNo, {-1, 4, 4, a.data(), 4, b.data(), 4, c.data(), 4},
                          1.0f, 0.0f),
               InvalidArgument);
}

}  // namespace
}  // namespace switchyard::kernels
