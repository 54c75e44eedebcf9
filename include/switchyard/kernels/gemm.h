// Dense matrix products on one rank: float32, row-major, through the GEMM backend chosen from the
// CPU's features (kernels/gemm_backend.h: oneDNN on AVX-512 CPUs, OpenBLAS on AVX2-only CPUs it
// runs AVX2 kernels on, oneDNN on other AVX2 CPUs, OpenBLAS without AVX2).
//
// Three forms:
//   Gemm         one product C = alpha * op(A) * op(B) + beta * C
//   GroupedGemm  a list of independent products of different sizes (dropless experts: one group
//                per expert, each with its own number of tokens)
//   BatchedGemm  `batch` products of equal size at fixed strides (capacity-mode experts [E, C, M])
// Each has a plain reference in kernels/reference.h that the tests compare against.
#pragma once

#include <cstdint>
#include <span>

namespace switchyard::kernels {

enum class Trans : uint8_t { kNo, kYes };

// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C[m, n].
// op(A) = A (stored [m, k], lda >= k) or A^T (stored [k, m], lda >= m); likewise for B.
// m, n or k may be 0 (k = 0 scales C by beta).
void Gemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc);

// One product of a grouped GEMM. All groups share trans_a, trans_b, alpha and beta.
struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const float* a = nullptr;
  int64_t lda = 0;
  const float* b = nullptr;
  int64_t ldb = 0;
  float* c = nullptr;
  int64_t ldc = 0;
};

// Runs every problem. `threads` compute threads (<= the rank's budget, see core/threading.h):
// problems are spread over the threads (one BLAS thread each) when there are many, and run one
// after another with all threads inside BLAS when there are few. Problems must not write
// overlapping C.
void GroupedGemm(Trans trans_a, Trans trans_b, float alpha, float beta,
                 std::span<const GemmProblem> problems, int threads = 1);

// `batch` equal products; operand i starts at a + i*stride_a (likewise b, c).
void BatchedGemm(Trans trans_a, Trans trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                 float alpha, const float* a, int64_t lda, int64_t stride_a, const float* b,
                 int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                 int threads = 1);

// The GEMM thread budget is process-global. SetBlasThreads is called once per process by the
// runtime (see core/threading.h for the policy) and by `switchyard bench gemm --threads`. With
// either backend one Gemm splits C over that many threads of the calling thread's pool (each
// block one single-threaded oneDNN or OpenBLAS call; OpenBLAS's own pool is kept at 1 thread).
// BlasThreads() is the budget (OpenBLAS's default before any SetBlasThreads, when OpenBLAS
// still runs with its own threads).
void SetBlasThreads(int threads);
int BlasThreads();
// OpenBLAS's own description, e.g. "OpenBLAS 0.3.21 ... SkylakeX MAX_THREADS=64". The backend
// that runs is kernels::GemmBackendName() (gemm_backend.h).
const char* BlasConfig();

}  // namespace switchyard::kernels
