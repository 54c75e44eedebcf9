#include "train/parallel_for.h"

#include <algorithm>
#include <memory>

namespace switchyard::train {

void ParallelGemm(kernels::Trans trans_a, kernels::Trans trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                  float* c, int64_t ldc, int threads) {
  // Below ~1 MFLOP per thread the split costs more than it saves.
  constexpr double kMinFlopsPerThread = 1 << 20;
  double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  int64_t parts = std::min<int64_t>(threads, static_cast<int64_t>(flops / kMinFlopsPerThread));
  parts = std::min<int64_t>(parts, m / 16);  // rows per part: at least 16
  if (parts <= 1) {
    kernels::Gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  LocalPool(threads).Run(parts, [&](int64_t i) {
    // Row boundaries on multiples of 16 (whole micro-kernel panels).
    int64_t r0 = (m * i / parts) / 16 * 16;
    int64_t r1 = i + 1 == parts ? m : (m * (i + 1) / parts) / 16 * 16;
    const float* ai = trans_a == kernels::Trans::kNo ? a + r0 * lda : a + r0;
    kernels::Gemm(trans_a, trans_b, r1 - r0, n, k, alpha, ai, lda, b, ldb, beta, c + r0 * ldc, ldc);
  });
}

Tensor ActivationForwardParallel(kernels::Activation act, const Tensor& h, int threads) {
  Tensor a = Tensor::Empty(h.shape());
  ParallelFor(h.numel(), threads, [&](int64_t begin, int64_t end) {
    kernels::ActivationForward(act, h.data<float>() + begin, a.data<float>() + begin, end - begin);
  });
  return a;
}

void ActivationBackwardInPlace(kernels::Activation act, const Tensor& h, const Tensor& d,
                               int threads) {
  ParallelFor(d.numel(), threads, [&](int64_t begin, int64_t end) {
    float* dp = d.data<float>() + begin;
    kernels::ActivationBackward(act, h.data<float>() + begin, dp, dp, end - begin);
  });
}

}  // namespace switchyard::train
