#include "switchyard/moe/grouped_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/packed_gemm.h"
#include "switchyard/kernels/reference.h"
#include "switchyard/kernels/small_gemm.h"
#include "switchyard/moe/experts.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

using kernels::GemmProblem;
using kernels::Trans;
using switchyard::testing::AllClose;
using switchyard::testing::RandomVector;

// Every form over sizes covering each remainder of the 4 x 3 and 6 x 16 tiles, k with and without
// an 8-wide tail, padded leading dimensions and beta 0 / 1 / other.
// Every kernel path (AVX2, and AVX-512 where the CPU has it) against the float64 reference.
class SmallGemmTest : public ::testing::TestWithParam<SmallGemmIsa> {};

TEST_P(SmallGemmTest, MatchesReference) {
  if (!SmallGemmAvailable()) GTEST_SKIP() << "no AVX2/FMA on this CPU: the kernels are not used";
  const SmallGemmIsa isa = GetParam();
  if (isa == SmallGemmIsa::kAvx512 && !kernels::SmallGemmAvx512Available()) {
    GTEST_SKIP() << "no AVX-512 on this CPU: the AVX-512 kernels are not used";
  }
  for (int form = 0; form < 3; ++form) {
    const Trans ta = form == 2 ? Trans::kYes : Trans::kNo;
    const Trans tb = form == 0 ? Trans::kYes : Trans::kNo;
    for (int64_t m : {0, 1, 5, 6, 7, 12, 13, 29, 33, 65}) {
      for (int64_t n : {1, 3, 4, 15, 16, 17, 40, 65}) {
        for (int64_t k : {0, 1, 7, 8, 9, 17, 33, 63, 64, 65}) {
          SCOPED_TRACE(::testing::Message()
                       << "form " << form << " m " << m << " n " << n << " k " << k);
          const int64_t lda = (ta == Trans::kNo ? k : m) + 3;
          const int64_t ldb = (tb == Trans::kNo ? n : k) + 5, ldc = n + 2;
          auto a = RandomVector(static_cast<size_t>((ta == Trans::kNo ? m : k) * lda), 1);
          auto b = RandomVector(static_cast<size_t>((tb == Trans::kNo ? k : n) * ldb), 2);
          auto c0 = RandomVector(static_cast<size_t>(m * ldc), 3);
          for (float beta : {0.0f, 1.0f, 0.5f}) {
            auto c = c0, want = c0;
            GemmProblem p{m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc};
            SmallGemm(ta, tb, p, 1.25f, beta, isa);
            kernels::ref::Gemm(ta, tb, m, n, k, 1.25f, a.data(), lda, b.data(), ldb, beta,
                               want.data(), ldc);
            ASSERT_TRUE(AllClose(c, want, 1e-5, 1e-5 * (1 + static_cast<double>(k) / 16)))
                << "beta " << beta;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, SmallGemmTest,
                         ::testing::Values(SmallGemmIsa::kAvx2, SmallGemmIsa::kAvx512),
                         [](const ::testing::TestParamInfo<SmallGemmIsa>& p) {
                           return p.param == SmallGemmIsa::kAvx2 ? "avx2" : "avx512";
                         });

// The grouped entry point (small and large problems mixed, spread over threads) equals a loop
// of plain GEMMs.
TEST(ExpertGroupedGemm, MixedSizesEqualPlainGemms) {
  const int64_t k = 24, n = 20;
  std::vector<int64_t> rows = {0, 3, 29, 41, 100, 7};
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  auto x = RandomVector(static_cast<size_t>(total * k), 1);
  auto w = RandomVector(rows.size() * static_cast<size_t>(n * k), 2);
  for (int threads : {1, 3}) {
    std::vector<float> y(static_cast<size_t>(total * n)), want(y.size());
    std::vector<GemmProblem> ps, ref_ps;
    int64_t off = 0;
    for (size_t g = 0; g < rows.size(); ++g) {
      ps.push_back(
          {rows[g], n, k, x.data() + off * k, k, w.data() + g * n * k, k, y.data() + off * n, n});
      ref_ps.push_back(ps.back());
      ref_ps.back().c = want.data() + off * n;
      off += rows[g];
    }
    ExpertGroupedGemm(Trans::kNo, Trans::kYes, 1.0f, 0.0f, ps, threads);
    for (const auto& p : ref_ps) {
      kernels::ref::Gemm(Trans::kNo, Trans::kYes, p.m, p.n, p.k, 1.0f, p.a, p.lda, p.b, p.ldb, 0.0f,
                         p.c, p.ldc);
    }
    EXPECT_TRUE(AllClose(y, want, 1e-5, 1e-5)) << threads << " threads";
  }
}

// Each kernel of the expert products above the few-row limits (ExpertGemmKernel) on the three
// forms of the expert FFN, groups of 0, 1, 7, 13, 41 and 100 rows, 1 and 3 threads, against the
// float64 reference.
class ExpertGemmKernelTest : public ::testing::TestWithParam<ExpertGemmKernel> {
 protected:
  void TearDown() override { SetExpertGemmKernel(DefaultExpertGemmKernel()); }
};

TEST_P(ExpertGemmKernelTest, ExpertFormsMatchReference) {
  if (GetParam() == ExpertGemmKernel::kPacked && !kernels::PackedGemmAvailable()) {
    GTEST_SKIP() << "no AVX2/FMA on this CPU: the packed kernel is not used";
  }
  SetExpertGemmKernel(GetParam());
  const std::vector<int64_t> rows = {0, 1, 7, 13, 41, 100};
  const int64_t model = 70, hidden = 33, groups = static_cast<int64_t>(rows.size());
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  auto x = RandomVector(static_cast<size_t>(total * model), 3);
  auto d = RandomVector(static_cast<size_t>(total * hidden), 4);
  auto w = RandomVector(static_cast<size_t>(groups * hidden * model), 5);  // [G, hidden, model]
  for (int form = 0; form < 3; ++form) {
    const Trans ta = form == 2 ? Trans::kYes : Trans::kNo;
    const Trans tb = form == 0 ? Trans::kYes : Trans::kNo;
    const int64_t cols = form == 0 ? hidden : model;
    for (int threads : {1, 3}) {
      std::vector<float> got(static_cast<size_t>(std::max(total, groups * hidden) * cols), 9.0f);
      std::vector<float> want = got;
      std::vector<GemmProblem> ps;
      int64_t off = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const float* wg = w.data() + g * hidden * model;
        if (form == 0) {  // X_g W_g^T
          ps.push_back({rows[g], hidden, model, x.data() + off * model, model, wg, model,
                        got.data() + off * hidden, hidden});
        } else if (form == 1) {  // dA_g W_g
          ps.push_back({rows[g], model, hidden, d.data() + off * hidden, hidden, wg, model,
                        got.data() + off * model, model});
        } else {  // dA_g^T X_g
          ps.push_back({hidden, model, rows[g], d.data() + off * hidden, hidden,
                        x.data() + off * model, model, got.data() + g * hidden * model, model});
        }
        off += rows[g];
      }
      ExpertGroupedGemm(ta, tb, 1.0f, 0.0f, ps, threads);
      for (GemmProblem p : ps) {
        p.c = want.data() + (p.c - got.data());
        kernels::ref::Gemm(ta, tb, p.m, p.n, p.k, 1.0f, p.a, p.lda, p.b, p.ldb, 0.0f, p.c, p.ldc);
      }
      EXPECT_TRUE(AllClose(got, want, 1e-5, 1e-4))
          << "form " << form << ", " << threads << " threads";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernel, ExpertGemmKernelTest,
                         ::testing::Values(ExpertGemmKernel::kBackend, ExpertGemmKernel::kPacked),
                         [](const ::testing::TestParamInfo<ExpertGemmKernel>& p) {
                           return p.param == ExpertGemmKernel::kPacked ? "packed" : "backend";
                         });

// The SwiGLU pairs (ExpertGroupedGemmPairs): gate and up products sharing X (forward, NT) and
// the two weight gradients sharing X (TN), groups of 0, 1, 7, 13, 41 and 100 rows (the packed
// kernel fuses the pairs of groups with >= 16 rows, the others run one product at a time), 1 and
// 3 threads, against the float64 reference.
TEST_P(ExpertGemmKernelTest, SharedOperandPairsMatchReference) {
  if (GetParam() == ExpertGemmKernel::kPacked && !kernels::PackedGemmAvailable()) {
    GTEST_SKIP() << "no AVX2/FMA on this CPU: the packed kernel is not used";
  }
  SetExpertGemmKernel(GetParam());
  const std::vector<int64_t> rows = {0, 1, 7, 13, 41, 100};
  const int64_t model = 70, hidden = 33, groups = static_cast<int64_t>(rows.size());
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  auto x = RandomVector(static_cast<size_t>(total * model), 6);
  auto d1 = RandomVector(static_cast<size_t>(total * hidden), 7);
  auto d3 = RandomVector(static_cast<size_t>(total * hidden), 8);
  auto w1 = RandomVector(static_cast<size_t>(groups * hidden * model), 9);
  auto w3 = RandomVector(static_cast<size_t>(groups * hidden * model), 10);
  for (SharedOperand shared : {SharedOperand::kA, SharedOperand::kB}) {
    const bool fwd = shared == SharedOperand::kA;
    const Trans ta = fwd ? Trans::kNo : Trans::kYes, tb = fwd ? Trans::kYes : Trans::kNo;
    for (int threads : {1, 3}) {
      const size_t size = static_cast<size_t>(std::max(total, groups * hidden) * model);
      std::vector<float> got1(size, 9.0f), got3 = got1, want1 = got1, want3 = got1;
      std::vector<GemmProblem> p1, p3;
      int64_t off = 0;
      for (int64_t g = 0; g < groups; ++g) {
        if (fwd) {  // X_g W1_g^T and X_g W3_g^T
          for (auto [w, c, ps] : {std::tuple{&w1, &got1, &p1}, std::tuple{&w3, &got3, &p3}}) {
            ps->push_back({rows[g], hidden, model, x.data() + off * model, model,
                           w->data() + g * hidden * model, model, c->data() + off * hidden,
                           hidden});
          }
        } else {  // dA1_g^T X_g and dA3_g^T X_g
          for (auto [d, c, ps] : {std::tuple{&d1, &got1, &p1}, std::tuple{&d3, &got3, &p3}}) {
            ps->push_back({hidden, model, rows[g], d->data() + off * hidden, hidden,
                           x.data() + off * model, model, c->data() + g * hidden * model, model});
          }
        }
        off += rows[g];
      }
      ExpertGroupedGemmPairs(ta, tb, 1.0f, 0.0f, p1, p3, shared, threads);
      for (auto [ps, got, want] :
           {std::tuple{&p1, &got1, &want1}, std::tuple{&p3, &got3, &want3}}) {
        for (GemmProblem p : *ps) {
          p.c = want->data() + (p.c - got->data());
          kernels::ref::Gemm(ta, tb, p.m, p.n, p.k, 1.0f, p.a, p.lda, p.b, p.ldb, 0.0f, p.c, p.ldc);
        }
        EXPECT_TRUE(AllClose(*got, *want, 1e-5, 1e-4))
            << (fwd ? "shared A" : "shared B") << ", " << threads << " threads";
      }
    }
  }
  std::vector<GemmProblem> one(1), two(2);
  EXPECT_THROW(
      ExpertGroupedGemmPairs(Trans::kNo, Trans::kYes, 1.0f, 0.0f, one, two, SharedOperand::kA),
      InvalidArgument);
}

// The expert FFN with its biases and activation applied as GEMM epilogues (tile by tile on the
// packed kernel, after the product on the others), forward and backward, against a float64
// reference of the FFN: groups of 0, 5, 17, 40 and 150 rows (150: more than one 144-row block),
// M = 40 and H = 33 (edge tiles; >= 16, so the packed kernel takes the products), gated (SwiGLU)
// and plain GELU, with and without biases, both kernels, 1 and 2 threads.
TEST_P(ExpertGemmKernelTest, ExpertsWithEpiloguesMatchReference) {
  if (GetParam() == ExpertGemmKernel::kPacked && !kernels::PackedGemmAvailable()) {
    GTEST_SKIP() << "no AVX2/FMA on this CPU: the packed kernel is not used";
  }
  SetExpertGemmKernel(GetParam());
  const std::vector<int64_t> rows = {0, 5, 17, 40, 150};
  const int64_t m = 40, h = 33, g_n = static_cast<int64_t>(rows.size());
  ExpertGroups groups;
  int64_t total = 0;
  for (int64_t r : rows) {
    groups.begin.push_back(total);
    groups.rows.push_back(r);
    total += r;
  }
  auto tensor = [](std::vector<int64_t> shape, uint64_t seed) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return Tensor::FromVector(RandomVector(static_cast<size_t>(n), seed), Shape(shape));
  };
  for (bool gated : {true, false}) {
    for (bool bias : {true, false}) {
      const ExpertOptions o{gated ? kernels::Activation::kSilu : kernels::Activation::kGelu, gated};
      ExpertWeights w{tensor({g_n, h, m}, 41), bias ? tensor({g_n, h}, 42) : Tensor(),
                      tensor({g_n, m, h}, 43), bias ? tensor({g_n, m}, 44) : Tensor(),
                      gated ? tensor({g_n, h, m}, 45) : Tensor()};
      const Tensor x = tensor({total, m}, 46), dy = tensor({total, m}, 47);
      // The reference, group by group: a1 = X W1^T + b1, a3 = X W3^T, hid = act(a1) (* a3),
      // y = hid W2^T + b2; dhid = dY W2, da1 = dhid (* a3) act'(a1), da3 = dhid act(a1).
      std::vector<float> y(static_cast<size_t>(total * m)), dx(y.size(), 0.0f);
      std::vector<float> dw1(static_cast<size_t>(g_n * h * m)), dw3(dw1.size()), dw2(dw1.size()),
          db1(static_cast<size_t>(g_n * h), 0.0f), db2(static_cast<size_t>(g_n * m), 0.0f);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t r = rows[static_cast<size_t>(g)], b = groups.begin[static_cast<size_t>(g)];
        const float* xg = x.data<float>() + b * m;
        const float* dyg = dy.data<float>() + b * m;
        const float* w1 = w.fc1_weight.data<float>() + g * h * m;
        const float* w2 = w.fc2_weight.data<float>() + g * m * h;
        const float* w3 = gated ? w.fc3_weight.data<float>() + g * h * m : nullptr;
        const size_t rh = static_cast<size_t>(r * h);
        std::vector<float> a1(rh, 0.0f), a3(rh, 1.0f), act(rh), hid(rh), dhid(rh), da1(rh), da3(rh),
            ones(rh, 1.0f), dact(rh);
        kernels::ref::Gemm(Trans::kNo, Trans::kYes, r, h, m, 1.0f, xg, m, w1, m, 0.0f, a1.data(),
                           h);
        if (gated) {
          kernels::ref::Gemm(Trans::kNo, Trans::kYes, r, h, m, 1.0f, xg, m, w3, m, 0.0f, a3.data(),
                             h);
        }
        for (size_t i = 0; i < rh; ++i) {
          if (bias) a1[i] += w.fc1_bias.data<float>()[g * h + static_cast<int64_t>(i) % h];
        }
        kernels::ref::ActivationForward(o.activation, a1.data(), act.data(), r * h);
        kernels::ref::ActivationBackward(o.activation, a1.data(), ones.data(), dact.data(), r * h);
        for (size_t i = 0; i < rh; ++i) hid[i] = act[i] * a3[i];
        float* yg = y.data() + b * m;
        for (int64_t i = 0; i < r * m; ++i) {
          yg[i] = bias ? w.fc2_bias.data<float>()[g * m + i % m] : 0.0f;
        }
        kernels::ref::Gemm(Trans::kNo, Trans::kYes, r, m, h, 1.0f, hid.data(), h, w2, h, 1.0f, yg,
                           m);
        kernels::ref::Gemm(Trans::kNo, Trans::kNo, r, h, m, 1.0f, dyg, m, w2, h, 0.0f, dhid.data(),
                           h);
        for (size_t i = 0; i < rh; ++i) {
          da1[i] = dhid[i] * a3[i] * dact[i];
          da3[i] = dhid[i] * act[i];
          db1[static_cast<size_t>(g * h) + i % static_cast<size_t>(h)] += da1[i];
        }
        for (int64_t i = 0; i < r * m; ++i) db2[static_cast<size_t>(g * m + i % m)] += dyg[i];
        kernels::ref::Gemm(Trans::kYes, Trans::kNo, m, h, r, 1.0f, dyg, m, hid.data(), h, 0.0f,
                           dw2.data() + g * m * h, h);
        kernels::ref::Gemm(Trans::kYes, Trans::kNo, h, m, r, 1.0f, da1.data(), h, xg, m, 0.0f,
                           dw1.data() + g * h * m, m);
        kernels::ref::Gemm(Trans::kNo, Trans::kNo, r, m, h, 1.0f, da1.data(), h, w1, m, 0.0f,
                           dx.data() + b * m, m);
        if (gated) {
          kernels::ref::Gemm(Trans::kYes, Trans::kNo, h, m, r, 1.0f, da3.data(), h, xg, m, 0.0f,
                             dw3.data() + g * h * m, m);
          kernels::ref::Gemm(Trans::kNo, Trans::kNo, r, m, h, 1.0f, da3.data(), h, w3, m, 1.0f,
                             dx.data() + b * m, m);
        }
      }
      const auto close = [](const Tensor& t, const std::vector<float>& want) {
        return AllClose(std::vector<float>(t.data<float>(), t.data<float>() + t.numel()), want,
                        1e-4, 1e-3);
      };
      for (int threads : {1, 2}) {
        const std::string what = std::string(gated ? "gated" : "plain") +
                                 (bias ? ", bias, " : ", no bias, ") + std::to_string(threads) +
                                 " threads";
        ExpertActivations saved;
        const Tensor out = ExpertsForward(o, w, x, groups, &saved, threads);
        EXPECT_TRUE(close(out, y)) << "output, " << what;
        const ExpertGradients grads = ExpertsBackward(o, w, saved, dy, threads);
        EXPECT_TRUE(close(grads.input, dx)) << "d input, " << what;
        EXPECT_TRUE(close(grads.weights.fc1_weight, dw1)) << "d fc1, " << what;
        EXPECT_TRUE(close(grads.weights.fc2_weight, dw2)) << "d fc2, " << what;
        if (gated) {
          EXPECT_TRUE(close(grads.weights.fc3_weight, dw3)) << "d fc3, " << what;
        }
        if (bias) {
          EXPECT_TRUE(close(grads.weights.fc1_bias, db1)) << "d fc1 bias, " << what;
          EXPECT_TRUE(close(grads.weights.fc2_bias, db2)) << "d fc2 bias, " << what;
        }
      }
    }
  }
}

TEST(ExpertGemmKernel, ParseNamesTheChoices) {
  EXPECT_EQ(ParseExpertGemmKernel("SY_EXPERT_GEMM", "backend"), ExpertGemmKernel::kBackend);
  try {
    ParseExpertGemmKernel("SY_EXPERT_GEMM", "fast");
    FAIL() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expected packed or backend"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace switchyard::moe
