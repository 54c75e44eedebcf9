// Compute threads of the train layer (private): the shared pool of core/thread_pool.h, a
// parallel loop, and GEMMs split by rows over the pool with single-threaded BLAS calls.
//
// Why not OpenBLAS's own threads: between calls its idle workers spin in sched_yield, which
// took ~35% of the CPU time of a training step (perf, 2 cores) and competes with the
// attention and element-wise work running on the same cores. The pool's workers block.
#pragma once

#include <cstdint>
#include <functional>

#include "switchyard/core/tensor.h"
#include "switchyard/core/thread_pool.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"

namespace switchyard::train {

// The pool and the parallel loop live in core/thread_pool.h (shared with the MoE layer).
using ::switchyard::LocalPool;
using ::switchyard::WorkerPool;

// ParallelFor of core/thread_pool.h with grain 1: min(threads, n) chunks.
inline void ParallelFor(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  ::switchyard::ParallelFor(n, threads, /*grain=*/1, fn);
}

// acc += x elementwise over `threads` (both float32 of one shape).
inline void AddInPlaceParallel(const Tensor& acc, const Tensor& x, int threads) {
  float* a = acc.data<float>();
  const float* b = x.data<float>();
  ParallelFor(acc.numel(), threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] += b[i];
  });
}

// kernels::Gemm with the m rows of op(A) and C split over `threads` threads (each BLAS call
// single-threaded); small products run on the caller.
void ParallelGemm(kernels::Trans trans_a, kernels::Trans trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                  float* c, int64_t ldc, int threads);

// act(h) elementwise over `threads` (h float32; a new tensor of its shape).
Tensor ActivationForwardParallel(kernels::Activation act, const Tensor& h, int threads);
// d *= act'(h) elementwise, in place over `threads` (both float32 of one shape).
void ActivationBackwardInPlace(kernels::Activation act, const Tensor& h, const Tensor& d,
                               int threads);

}  // namespace switchyard::train
