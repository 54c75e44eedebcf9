#include "train/parallel_for.h"

#include <gtest/gtest.h>

#include "switchyard/kernels/reference.h"
#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using kernels::Trans;

TEST(ParallelGemmTest, EqualsOneGemmForEveryTransposeAndSplit) {
  kernels::SetBlasThreads(1);
  for (Trans ta : {Trans::kNo, Trans::kYes}) {
    for (Trans tb : {Trans::kNo, Trans::kYes}) {
      for (int64_t m : {1, 17, 100, 333}) {
        const int64_t n = 70, k = 90;
        Tensor a = testing::RandomTensor({m * k}, 1), b = testing::RandomTensor({k * n}, 2);
        Tensor c0 = testing::RandomTensor({m * n}, 3);
        int64_t lda = ta == Trans::kNo ? k : m, ldb = tb == Trans::kNo ? n : k;
        Tensor ref = c0.Clone();
        kernels::Gemm(ta, tb, m, n, k, 0.5f, a.data<float>(), lda, b.data<float>(), ldb, 1.0f,
                      ref.data<float>(), n);
        for (int threads : {1, 2, 3}) {
          Tensor c = c0.Clone();
          ParallelGemm(ta, tb, m, n, k, 0.5f, a.data<float>(), lda, b.data<float>(), ldb, 1.0f,
                       c.data<float>(), n, threads);
          for (int64_t i = 0; i < m * n; ++i) {
            // Each row is computed by one single-threaded BLAS call either way.
            ASSERT_NEAR(c.data<float>()[i], ref.data<float>()[i], 1e-5)
                << "m " << m << " threads " << threads << " element " << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace switchyard::train
