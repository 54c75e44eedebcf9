// AVX-512 kernels for products with one small dimension -- the many-small-experts case of the
// grouped expert GEMM (moe/grouped_gemm.h): C = alpha * op(A) op(B) + beta * C where
//   NT  C[m, n] = A[m, k] · B[n, k]^T   m small (an expert's rows; forward products)
//   NN  C[m, n] = A[m, k] · B[k, n]     m small (input gradients)
//   TN  C[m, n] = A[k, m]^T · B[k, n]   k small (weight gradients, k = the expert's rows)
// All three use one micro-kernel: a 12 x 32 tile of 24 zmm accumulators, 32 columns loaded from a
// row panel and 12 rows broadcast per k step. NT packs A^T (small) and computes C^T tiles that are
// stored transposed, so the large operand B is read in place exactly once; NN repacks B into
// 32-column panels (one sequential pass); TN reads both operands in place.
// Compiled with target attributes for AVX-512 F/BW/DQ/VL; callers must check
// SmallGemmAvx512Available() (cpuid) first -- the code never runs on a CPU without it.
#pragma once

#include "switchyard/kernels/gemm.h"

namespace switchyard::kernels {

// True when the CPU (and OS) supports AVX-512 F/BW/DQ/VL.
bool SmallGemmAvx512Available();

// One product; (trans_a, trans_b) in {(No, Yes), (No, No), (Yes, No)}, any sizes (0 included).
// Requires SmallGemmAvx512Available(); throws InvalidArgument for A^T B^T.
void SmallGemmAvx512(Trans trans_a, Trans trans_b, const GemmProblem& p, float alpha, float beta);

}  // namespace switchyard::kernels
