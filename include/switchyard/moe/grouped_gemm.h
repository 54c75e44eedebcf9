// The grouped GEMM of the experts: kernels::GroupedGemm's contract, with a faster path for
// experts that hold few tokens.
//
// With many small experts (e.g. 64 experts of ~30 tokens), each expert's product has one small
// dimension: the expert's rows (m of the forward and input-gradient products, the inner dimension
// of the weight-gradient products). OpenBLAS packs both operands on every call, which costs about
// as much as the arithmetic at these sizes. These kernels read the operands in place instead:
//   NT  C[m, n] = A[m, k] · B[n, k]^T   dot-product tiles of 4 x 3 (8-wide k steps)
//   NN  C[m, n] = A[m, k] · B[k, n]     broadcast tiles of 6 x 16 (B rows read in place)
//   TN  C[m, n] = A[k, m]^T · B[k, n]   the same tiles with A read column-wise
// They need AVX2 + FMA, checked at run time; without them, or above the size limits below (where
// OpenBLAS is faster), the products go to kernels::Gemm. Tested against kernels::ref::Gemm; the
// gain is measured by `switchyard bench layer` (grouped vs a loop of plain GEMMs).
#pragma once

#include <cstdint>
#include <span>

#include "switchyard/kernels/gemm.h"

namespace switchyard::moe {

// Size limits of the kernels, measured on AVX2 (Zen 2) against OpenBLAS 0.3.21 at one thread:
// NT and NN win up to ~40 rows (by 5-25% at 16-32 rows), TN only for very few rows.
inline constexpr int64_t kSmallGemmMaxRows = 40;   // m of NT / NN problems
inline constexpr int64_t kSmallGemmMaxInner = 16;  // k of TN problems

// True when the CPU has AVX2 and FMA.
bool SmallGemmAvailable();

// One product with the kernels: C = alpha * op(A) op(B) + beta * C, for (trans_a, trans_b) in
// {(No, Yes), (No, No), (Yes, No)}. Requires SmallGemmAvailable(). Any size (0 included).
void SmallGemm(kernels::Trans trans_a, kernels::Trans trans_b, const kernels::GemmProblem& p,
               float alpha, float beta);

// kernels::GroupedGemm's contract; small problems use SmallGemm, the others kernels::Gemm.
// Problems are spread over `threads` threads when BLAS runs single-threaded.
void ExpertGroupedGemm(kernels::Trans trans_a, kernels::Trans trans_b, float alpha, float beta,
                       std::span<const kernels::GemmProblem> problems, int threads = 1);

}  // namespace switchyard::moe
