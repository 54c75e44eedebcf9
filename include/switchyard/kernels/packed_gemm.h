// switchyard's own float32 GEMM for the expert shapes on AVX2 + FMA CPUs (no AVX-512): the three
// products of an expert FFN,
//   NT  C[m, n] = A[m, k] · B[n, k]^T   forward X W^T (W stored [out, in])
//   NN  C[m, n] = A[m, k] · B[k, n]     data gradient dY W
//   TN  C[m, n] = A[k, m]^T · B[k, n]   weight gradient dY^T X (beta = 1 accumulates)
// (and TT for completeness), each C = alpha * op(A) op(B) + beta * C.
//
// Blocked as BLIS does it: op(B) is packed in blocks of kKc x kNc into 16-column panels, once per
// block, and reused by every row block of op(A) (an expert's weight packed once for all its rows);
// op(A) is packed in blocks of kMc x kKc into 6-row panels. The micro-kernel holds a 6 x 16 tile of
// C in 12 ymm accumulators (2 vector loads of B and 6 broadcasts of A per k step, 12 FMAs). The
// first k block applies beta, so beta = 0 never reads C and needs no zeroing pass of its own.
// Edges (m, n not multiples of the tile) are zero-padded in the packs and stored through a
// buffer. The kernels are compiled with target attributes and never run on a CPU without AVX2
// and FMA: callers check PackedGemmAvailable() (cpuid) first. Tested against kernels::ref::Gemm
// (float64) in tests/kernels/packed_gemm_test.cc; where it runs instead of the GEMM backend is
// moe/grouped_gemm.h's choice (docs/PERFORMANCE.md, "Fine-grained experts").
#pragma once

#include <cstdint>
#include <span>

#include "switchyard/kernels/gemm.h"

namespace switchyard::kernels {

// True when the CPU (and OS) supports AVX2 and FMA.
bool PackedGemmAvailable();

// Work on C done where it is still in cache: fn(ctx, row, col, rows, cols) is called once for
// every region [row, row + rows) x [col, col + cols) of C as soon as it holds its final value
// (for a pair: of both C1 and C2 at the same place), before later regions are computed. The
// regions cover C exactly once, in an unspecified order and size (a row block of up to 144 rows
// by all columns of C, or of one 2048-column block, when the product runs blocked; all of C when
// it does not). fn may rewrite those regions of C (and write elsewhere), but no other part of C
// and nothing the product still reads. E.g. the SwiGLU's activation applied to the gate and up
// products' rows while they are in L2.
struct TileEpilogue {
  void (*fn)(void* ctx, int64_t row, int64_t col, int64_t rows, int64_t cols);
  void* ctx;
};

// One product, any (trans_a, trans_b), any sizes (0 included; k = 0 scales C by beta). Single-
// threaded; uses per-thread packing buffers (up to 2.2 MiB: one 256 x 2048 block of B and one
// 150 x 256 block of A). Requires PackedGemmAvailable(); throws InvalidArgument for negative sizes
// or leading dimensions smaller than the columns they hold.
// `epilogue` (may be null): see TileEpilogue.
void PackedGemm(Trans trans_a, Trans trans_b, const GemmProblem& p, float alpha, float beta,
                const TileEpilogue* epilogue = nullptr);

// Two products that share an operand, in one pass that packs the shared operand once per block
// (an expert's SwiGLU pair). Same contract as PackedGemm for each product.
//   SharedA: C1 = alpha op(A) op(B1) + beta C1, C2 = alpha op(A) op(B2) + beta C2; p1 and p2 have
//            the same m, k, a and lda (else InvalidArgument). E.g. the gate and up products
//            X W1^T and X W3^T: X is packed once for both.
//   SharedB: C1 = alpha op(A1) op(B) + beta C1, C2 = alpha op(A2) op(B) + beta C2; the same n, k,
//            b and ldb. E.g. the weight gradients dA1^T X and dA3^T X: X is packed once.
// SharedA runs the two products one after the other when their columns (each rounded up to 16)
// exceed one 2048-column block of op(B). SharedA's `epilogue` (may be null; then p1.n == p2.n,
// else InvalidArgument) sees each region once both products' values there are final.
void PackedGemmSharedA(Trans trans_a, Trans trans_b, const GemmProblem& p1, const GemmProblem& p2,
                       float alpha, float beta, const TileEpilogue* epilogue = nullptr);
void PackedGemmSharedB(Trans trans_a, Trans trans_b, const GemmProblem& p1, const GemmProblem& p2,
                       float alpha, float beta);

// Every problem in order on the calling thread (a grouped GEMM's share of one thread).
void PackedGroupedGemm(Trans trans_a, Trans trans_b, float alpha, float beta,
                       std::span<const GemmProblem> problems);

}  // namespace switchyard::kernels
