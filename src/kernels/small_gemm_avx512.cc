#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/cpu_features.h"
#include "switchyard/kernels/small_gemm.h"

// Functions compiled for AVX-512 whatever the build's -march; only called after the cpuid check.
#define SY_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

namespace switchyard::kernels {
namespace {

constexpr int kMr = 12;  // broadcast rows of the tile
constexpr int kNr = 32;  // vector columns of the tile (two zmm)
// NT tiles broadcast kNtMr rows of B in place: with row strides of 4 KiB, 12 rows plus the packed
// panel would compete for the same 8-way L1 sets.
constexpr int kNtMr = 6;
constexpr int64_t kPrefetchRows = 8;  // rows of B ahead that in-place tiles prefetch

SY_AVX512 inline __mmask16 Mask16(int64_t n) {
  n = std::clamp<int64_t>(n, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// acc[i][0..1] (row i, 32 columns) += sum over kk of A(i, kk) * B[kk, 0:32], A(i, kk) at
// a[i * a_rs + kk * a_cs], B rows at b + kk * ldb. Then C = alpha * acc + beta * C on the
// first `mr` x `nr` elements: row-major tile at c (kTransC false) or its transpose, C[j, i] at
// c[j * ldc + i] (kTransC true).
template <int MR, bool kTransC, bool kPrefetchB>
SY_AVX512 void Tile(int64_t k, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                    int64_t ldb, float* c, int64_t ldc, int64_t nr, float alpha, float beta) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    if (kPrefetchB) {
      // Rows of B in place are ldb apart (often 4 KiB: no hardware prefetch across pages).
      const char* next = reinterpret_cast<const char*>(b + (kk + kPrefetchRows) * ldb);
      _mm_prefetch(next, _MM_HINT_T0);
      _mm_prefetch(next + 64, _MM_HINT_T0);
      _mm_prefetch(next + 124, _MM_HINT_T0);
    }
    const __m512 b0 = _mm512_loadu_ps(b + kk * ldb);
    const __m512 b1 = _mm512_loadu_ps(b + kk * ldb + 16);
    const float* ak = a + kk * a_cs;
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(ak[i * a_rs]);
      acc0[i] = _mm512_fmadd_ps(av, b0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(av, b1, acc1[i]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  if (!kTransC) {
    const __mmask16 m0 = Mask16(nr), m1 = Mask16(nr - 16);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      float* cr = c + i * ldc;
      __m512 r0 = _mm512_mul_ps(va, acc0[i]), r1 = _mm512_mul_ps(va, acc1[i]);
      if (beta != 0.0f) {
        r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cr), r0);
        r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cr + 16), r1);
      }
      _mm512_mask_storeu_ps(cr, m0, r0);
      _mm512_mask_storeu_ps(cr + 16, m1, r1);
    }
  } else {
    // The tile is C^T: row i of the tile is column i of C, its 32 lanes are rows of C.
    alignas(64) float t[MR][kNr];
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      _mm512_store_ps(t[i], _mm512_mul_ps(va, acc0[i]));
      _mm512_store_ps(t[i] + 16, _mm512_mul_ps(va, acc1[i]));
    }
    for (int64_t j = 0; j < nr; ++j) {
      float* cr = c + j * ldc;
      for (int i = 0; i < MR; ++i) cr[i] = beta == 0.0f ? t[i][j] : t[i][j] + beta * cr[i];
    }
  }
}

using TileFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                        int64_t, int64_t, float, float);
template <bool kTransC, bool kPf>
constexpr TileFn kTiles[kMr] = {
    Tile<1, kTransC, kPf>, Tile<2, kTransC, kPf>,  Tile<3, kTransC, kPf>,  Tile<4, kTransC, kPf>,
    Tile<5, kTransC, kPf>, Tile<6, kTransC, kPf>,  Tile<7, kTransC, kPf>,  Tile<8, kTransC, kPf>,
    Tile<9, kTransC, kPf>, Tile<10, kTransC, kPf>, Tile<11, kTransC, kPf>, Tile<12, kTransC, kPf>};

// Copies rows [0, k) x columns [0, n) of B (row-major, ldb) into panels [n / 32][k][32], the last
// panel zero-padded.
SY_AVX512 void PackColumnPanels(int64_t k, int64_t n, const float* b, int64_t ldb, float* dst) {
  const int64_t panels = (n + kNr - 1) / kNr;
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* src = b + kk * ldb;
    for (int64_t q = 0; q < panels; ++q) {
      const int64_t rest = n - q * kNr;
      float* d = dst + (q * k + kk) * kNr;
      _mm512_storeu_ps(d, _mm512_maskz_loadu_ps(Mask16(rest), src + q * kNr));
      _mm512_storeu_ps(d + 16, _mm512_maskz_loadu_ps(Mask16(rest - 16), src + q * kNr + 16));
    }
  }
}

// NN: C[m, n] = A[m, k] B[k, n], m small. B is read in place (prefetched a few rows ahead),
// panel by panel of 32 columns, each panel by every 12-row block of A while it is in cache; the
// last partial panel is packed (zero-padded).
SY_AVX512 void GemmNN(const GemmProblem& p, float alpha, float beta) {
  const int64_t full = p.n / kNr * kNr;
  thread_local std::vector<float> tail;
  if (full < p.n) {
    tail.resize(static_cast<size_t>(p.k * kNr));
    PackColumnPanels(p.k, p.n - full, p.b + full, p.ldb, tail.data());
  }
  for (int64_t j0 = 0; j0 < p.n; j0 += kNr) {
    const bool in_place = j0 < full;
    const int64_t nr = std::min<int64_t>(kNr, p.n - j0);
    for (int64_t i0 = 0; i0 < p.m; i0 += kMr) {
      const int64_t mr = std::min<int64_t>(kMr, p.m - i0);
      if (in_place) {
        kTiles<false, true>[mr - 1](p.k, p.a + i0 * p.lda, p.lda, 1, p.b + j0, p.ldb,
                                    p.c + i0 * p.ldc + j0, p.ldc, nr, alpha, beta);
      } else {
        kTiles<false, false>[mr - 1](p.k, p.a + i0 * p.lda, p.lda, 1, tail.data(), kNr,
                                     p.c + i0 * p.ldc + j0, p.ldc, nr, alpha, beta);
      }
    }
  }
}

// TN: C[m, n] = A[k, m]^T B[k, n], k small: both read in place (rows of A and B are contiguous).
SY_AVX512 void GemmTN(const GemmProblem& p, float alpha, float beta) {
  const int64_t full = p.n / kNr * kNr;
  thread_local std::vector<float> tail;
  if (full < p.n) {
    tail.resize(static_cast<size_t>(p.k * kNr));
    PackColumnPanels(p.k, p.n - full, p.b + full, p.ldb, tail.data());
  }
  for (int64_t i0 = 0; i0 < p.m; i0 += kMr) {
    const int64_t mr = std::min<int64_t>(kMr, p.m - i0);
    for (int64_t j0 = 0; j0 < p.n; j0 += kNr) {
      const bool in_place = j0 < full;
      kTiles<false, false>[mr - 1](p.k, p.a + i0, 1, p.lda, in_place ? p.b + j0 : tail.data(),
                                   in_place ? p.ldb : kNr, p.c + i0 * p.ldc + j0, p.ldc,
                                   std::min<int64_t>(kNr, p.n - j0), alpha, beta);
    }
  }
}

// NT: C[m, n] = A[m, k] B[n, k]^T, m small. C^T[n, m] = B[n, k] A^T[k, m]: A^T is packed into
// 32-column panels (A is the small operand), B rows are broadcast in place, C^T tiles stored
// transposed.
SY_AVX512 void GemmNT(const GemmProblem& p, float alpha, float beta) {
  thread_local std::vector<float> packed;
  const int64_t panels = (p.m + kNr - 1) / kNr;
  packed.assign(static_cast<size_t>(panels * p.k * kNr), 0.0f);
  for (int64_t i = 0; i < p.m; ++i) {
    const float* src = p.a + i * p.lda;
    float* dst = packed.data() + (i / kNr) * p.k * kNr + i % kNr;
    for (int64_t kk = 0; kk < p.k; ++kk) dst[kk * kNr] = src[kk];
  }
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t i0 = q * kNr, mr = std::min<int64_t>(kNr, p.m - i0);
    const float* panel = packed.data() + q * p.k * kNr;
    for (int64_t j0 = 0; j0 < p.n; j0 += kNtMr) {
      const int64_t nr = std::min<int64_t>(kNtMr, p.n - j0);
      kTiles<true, false>[nr - 1](p.k, p.b + j0 * p.ldb, p.ldb, 1, panel, kNr,
                                  p.c + i0 * p.ldc + j0, p.ldc, mr, alpha, beta);
    }
  }
}

}  // namespace

bool SmallGemmAvx512Available() {
  static const bool available = HostCpuFeatures().HasAvx512Core();
  return available;
}

void SmallGemmAvx512(Trans trans_a, Trans trans_b, const GemmProblem& p, float alpha, float beta) {
  SY_CHECK(SmallGemmAvx512Available(), "SmallGemmAvx512 needs AVX-512 F/BW/DQ/VL");
  SY_REQUIRE(p.m >= 0 && p.n >= 0 && p.k >= 0, InvalidArgument,
             "SmallGemmAvx512: negative size m={} n={} k={}", p.m, p.n, p.k);
  if (p.m == 0 || p.n == 0) return;
  if (p.k == 0) {
    Gemm(trans_a, trans_b, p.m, p.n, 0, alpha, p.a, p.lda, p.b, p.ldb, beta, p.c, p.ldc);
    return;
  }
  if (trans_a == Trans::kNo && trans_b == Trans::kYes) {
    GemmNT(p, alpha, beta);
  } else if (trans_a == Trans::kNo && trans_b == Trans::kNo) {
    GemmNN(p, alpha, beta);
  } else if (trans_a == Trans::kYes && trans_b == Trans::kNo) {
    GemmTN(p, alpha, beta);
  } else {
    throw InvalidArgument("SmallGemmAvx512: A^T B^T is not supported");
  }
}

}  // namespace switchyard::kernels
