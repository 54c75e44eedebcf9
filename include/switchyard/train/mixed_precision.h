// bfloat16 mixed precision of the train layer (docs/training.md "Mixed precision").
//
// With Precision::kBFloat16 every GEMM operand of the dense model (activations, weights and
// incoming gradients) is a bfloat16 value and every GEMM accumulates in float32; what layers keep
// for backward is stored as bfloat16 tensors (half the bytes). Master weights, their gradients,
// the optimizer state, the residual stream, norm statistics, softmax and the loss stay float32.
// bfloat16 is a storage type here (core/dtype.h): the GEMM converts its bfloat16 operands to
// float32 and runs the float32 kernel, so on a CPU without bfloat16 arithmetic (no AVX512-BF16,
// no AMX) the format saves memory, not time.
#pragma once

#include <cstdint>
#include <string_view>

#include "switchyard/core/tensor.h"
#include "switchyard/kernels/gemm.h"

namespace switchyard::train {

enum class Precision : uint8_t {
  kFloat32,  // everything in float32
  kBFloat16  // bfloat16 GEMM operands and saved activations, float32 master weights and sums
};
// "fp32" | "bf16"; InvalidArgument naming the key `precision` otherwise.
Precision PrecisionFromName(std::string_view name);
std::string_view PrecisionName(Precision precision);

// A bfloat16 tensor of x's shape (x float32: rounded to nearest even; bfloat16: x itself).
Tensor ToBFloat16(const Tensor& x, int threads = 1);
// A float32 tensor of x's shape (x bfloat16: exact conversion; float32: x itself).
Tensor ToFloat32(const Tensor& x, int threads = 1);
// A float32 tensor holding x's values rounded to bfloat16 (x float32 or bfloat16).
Tensor BFloat16Values(const Tensor& x, int threads = 1);
// Rounds a float32 buffer in place to bfloat16 values.
void RoundToBFloat16(float* x, int64_t n);

// C [m, n] = alpha * op(A) op(B) + beta * C with bfloat16 A and B (row-major, leading dimensions
// as kernels::Gemm) and float32 C: the operands are converted to float32 and multiplied by the
// float32 GEMM, split by rows of C over `threads` threads. Accumulation is float32.
void ParallelGemmBFloat16(kernels::Trans trans_a, kernels::Trans trans_b, int64_t m, int64_t n,
                          int64_t k, float alpha, const BFloat16* a, int64_t lda, const BFloat16* b,
                          int64_t ldb, float beta, float* c, int64_t ldc, int threads);

}  // namespace switchyard::train
