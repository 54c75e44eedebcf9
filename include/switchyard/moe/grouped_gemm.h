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
// They need AVX2 + FMA, checked at run time; on CPUs with AVX-512 F/BW/DQ/VL the AVX-512 kernels
// of kernels/small_gemm.h (12 x 32 tiles) run instead. Without AVX2, or above the size limits
// below (where the GEMM backend is faster), the products go to kernels::Gemm. Tested against
// kernels::ref::Gemm; the gain is measured by `switchyard bench layer` (grouped vs a loop of plain
// GEMMs).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/packed_gemm.h"

namespace switchyard::moe {

// Size limits of the kernels, measured at one thread against the GEMM backend that runs the other
// problems (kernels/gemm_backend.h).
// With OpenBLAS 0.3.21 (AVX2, Zen 2): NT and NN win up to ~40 rows (by 5-25% at 16-32 rows).
// TN (weight gradients, k = the expert's rows): on a Zen 3, in the layer, up to k = 64: OpenBLAS
// first zeroes C for beta = 0 in a pass of its own and then reads and writes it again, while the
// kernel writes C once; on config C (64 experts of 32 rows, dW 128 MB per step) that pass was 8 %
// of the step's samples, and k <= 64 made the step ~5 % faster (docs/PERFORMANCE.md).
inline constexpr int64_t kSmallGemmMaxRows = 40;   // m of NT / NN problems
inline constexpr int64_t kSmallGemmMaxInner = 64;  // k of TN problems
// With oneDNN 2.6.3 (Zen 4, docs/PERFORMANCE.md): only NT wins (oneDNN's small-m NT path is slow,
// e.g. 32 x 256 x 1024 at ~0.45 of the FMA peak against ~0.8 for the AVX-512 kernel); NN and TN
// stay with oneDNN. AVX2 NT tiles for m <= 16 (the AVX-512 tile is 32 rows wide), AVX-512 up to
// 128 rows.
inline constexpr int64_t kSmallGemmAvx2MaxRowsOneDnn = 16;
inline constexpr int64_t kSmallGemmAvx512MaxRows = 128;

// The products above those limits: the GEMM backend (kernels::Gemm) or switchyard's own packed
// AVX2 kernel (kernels/packed_gemm.h). When the packed kernel is active it also takes the
// products within those limits whose every dimension is at least kPackedGemmMinDim: on a Zen 3,
// config C's products (32 rows per expert) ran 8 % faster on it than on the few-row kernels
// (grouped / loop 0.86 against 0.95, docs/PERFORMANCE.md); the few-row kernels keep the products
// with fewer rows. Default (DefaultExpertGemmKernel): packed on CPUs with AVX2
// + FMA and no AVX-512 whose backend is OpenBLAS (measured faster there on the expert shapes,
// docs/PERFORMANCE.md "Fine-grained experts"), the backend elsewhere. SY_EXPERT_GEMM=packed|backend
// (read once) or SetExpertGemmKernel overrides it. With a GEMM budget above one thread
// (kernels::BlasThreads) the backend runs either way: it splits one product over the threads.
// Products with a dimension below kPackedGemmMinDim or above kPackedGemmMaxDim stay on the
// backend: on a Zen 3 the packed kernel was ahead of OpenBLAS on layer F's products (all
// dimensions <= 512: the expert GEMMs 5 % faster per CPU-second) and only level on layer A's
// (512 x 2048 weights: the step at 0.68 of the FMA peak either way, docs/PERFORMANCE.md), where
// OpenBLAS stays.
enum class ExpertGemmKernel : uint8_t { kBackend, kPacked };
inline constexpr int64_t kPackedGemmMinDim = 16;
inline constexpr int64_t kPackedGemmMaxDim = 1024;
ExpertGemmKernel DefaultExpertGemmKernel();
ExpertGemmKernel ActiveExpertGemmKernel();
// For benchmarks and tests; call it while no GEMM runs. kPacked without AVX2 + FMA throws
// InvalidArgument.
void SetExpertGemmKernel(ExpertGemmKernel kernel);
// "packed" / "backend"; anything else (or packed without AVX2 + FMA) throws InvalidArgument
// naming `what`.
ExpertGemmKernel ParseExpertGemmKernel(std::string_view what, std::string_view name);
// What runs the expert products above the few-row limits now: "packed avx2 6x16", "openblas" or
// "onednn".
const char* ExpertGemmKernelName();

// True when the CPU has AVX2 and FMA.
bool SmallGemmAvailable();

// Which kernels SmallGemm runs: kBest = AVX-512 when the CPU has it, else AVX2.
enum class SmallGemmIsa : uint8_t { kBest, kAvx2, kAvx512 };
// "avx512" or "avx2": what kBest runs on this CPU.
const char* SmallGemmIsaName();

// One product with the kernels: C = alpha * op(A) op(B) + beta * C, for (trans_a, trans_b) in
// {(No, Yes), (No, No), (Yes, No)}. Requires SmallGemmAvailable() (and, for kAvx512,
// kernels::SmallGemmAvx512Available()). Any size (0 included).
void SmallGemm(kernels::Trans trans_a, kernels::Trans trans_b, const kernels::GemmProblem& p,
               float alpha, float beta, SmallGemmIsa isa = SmallGemmIsa::kBest);

// kernels::GroupedGemm's contract; small problems use SmallGemm, the others kernels::Gemm.
// Problems are spread over `threads` threads when the GEMM budget (kernels::BlasThreads) is one
// thread.
void ExpertGroupedGemm(kernels::Trans trans_a, kernels::Trans trans_b, float alpha, float beta,
                       std::span<const kernels::GemmProblem> problems, int threads = 1);

// Two products that share an operand (an expert's SwiGLU gate and up products):
//   kA: p1 and p2 have the same A (m, k, a, lda): C1 = op(A) op(B1), C2 = op(A) op(B2);
//   kB: the same B (n, k, b, ldb): C1 = op(A1) op(B), C2 = op(A2) op(B).
// When both go to the packed kernel (the choice above) they run as one pass that packs the shared
// operand once (kernels::PackedGemmSharedA / SharedB); otherwise one after the other, each on
// the kernel it would get alone. Same results either way up to float summation order (none: the
// fused pass sums in the same order as the two products).
// `epilogue` (may be null; kA only, p1.n == p2.n, else InvalidArgument) is called on regions of
// C1 / C2 that hold their final values (kernels::TileEpilogue): row block by row block while
// they are in cache on the packed kernel, once over all of C after the two products on the other
// kernels.
enum class SharedOperand : uint8_t { kA, kB };
void ExpertGemmPair(kernels::Trans trans_a, kernels::Trans trans_b, float alpha, float beta,
                    const kernels::GemmProblem& p1, const kernels::GemmProblem& p2,
                    SharedOperand shared, const kernels::TileEpilogue* epilogue = nullptr);
// One product through ExpertGroupedGemm's choice of kernel, with ExpertGemmPair's `epilogue`.
void ExpertGemm(kernels::Trans trans_a, kernels::Trans trans_b, float alpha, float beta,
                const kernels::GemmProblem& p, const kernels::TileEpilogue* epilogue = nullptr);
// ExpertGemmPair for first[i], second[i] of every i, spread over threads as ExpertGroupedGemm
// spreads problems. first and second must have the same length.
void ExpertGroupedGemmPairs(kernels::Trans trans_a, kernels::Trans trans_b, float alpha, float beta,
                            std::span<const kernels::GemmProblem> first,
                            std::span<const kernels::GemmProblem> second, SharedOperand shared,
                            int threads = 1);

}  // namespace switchyard::moe
