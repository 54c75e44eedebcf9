// Plain reference implementations of the kernels in gemm.h and ops.h: straight loops, float64
// accumulation, written for obviousness rather than speed. Tests (and `switchyard bench`'s
// correctness checks) compare the optimized kernels against these.
#pragma once

#include <cstdint>

#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"

namespace switchyard::kernels::ref {

void Gemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc);
void SoftmaxRows(const float* x, float* y, int64_t rows, int64_t cols);
void SoftmaxRowsBackward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols);
void LogSumExpRows(const float* x, float* out, int64_t rows, int64_t cols);
void TopK(const float* x, int64_t rows, int64_t cols, int64_t k, int32_t* indices, float* values);
void CumsumDim0(const int32_t* in, int32_t* out, int64_t rows, int64_t cols, bool exclusive);
void ActivationForward(Activation act, const float* x, float* y, int64_t n);
void ActivationBackward(Activation act, const float* x, const float* dy, float* dx, int64_t n);
void GatherRows(const float* src, int64_t src_rows, int64_t cols, const int32_t* index,
                const float* scale, int64_t n, float* dst);
void ScatterAddRows(const float* src, int64_t n, int64_t cols, const int32_t* index,
                    const float* scale, float* dst, int64_t dst_rows);

}  // namespace switchyard::kernels::ref
