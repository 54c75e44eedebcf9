#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <span>

#include "switchyard/core/error.h"
#include "switchyard/kernels/cpu_features.h"
#include "switchyard/kernels/packed_gemm.h"

// Functions compiled for AVX2 + FMA whatever the build's -march; only called after the cpuid
// check.
#define SY_AVX2 __attribute__((target("avx2,fma")))
// Kept out of line so that profiles show packing and the micro-kernel apart (one call per tile).
#define SY_NOINLINE __attribute__((noinline))

namespace switchyard::kernels {
namespace {

constexpr int64_t kMr = 6;     // rows of the register tile (broadcasts)
constexpr int64_t kNr = 16;    // columns of the register tile (two ymm)
constexpr int64_t kKc = 256;   // k block: a 6 x kKc A panel (6 KiB) and a kKc x 16 B panel
                               // (16 KiB) together in the 32 KiB L1
constexpr int64_t kMc = 144;   // row block of A: 144 x kKc packed = 144 KiB, in L2 (512 KiB)
constexpr int64_t kNc = 2048;  // column block of B: kKc x kNc packed = 2 MiB, in L3

// A growable 64-byte aligned float buffer (one per thread for each pack).
class PackBuffer {
 public:
  float* Get(int64_t n) {
    if (n > size_) {
      data_.reset(new (std::align_val_t{64}) float[static_cast<size_t>(n)]);
      size_ = n;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<float[], Free> data_;
  int64_t size_ = 0;
};

// op(A)(i, kk) and op(B)(kk, j) of a row-major operand stored as given.
struct Operand {
  const float* p;
  int64_t ld;
  bool trans;
};

// Columns kk..kk+7 of 8 rows (rows[i] + kk), transposed: out[q] = the 8 rows' values at kk + q.
SY_AVX2 __attribute__((always_inline)) inline void Transpose8x8(const float* const rows[8],
                                                                int64_t kk, __m256 out[8]) {
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + kk);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    out[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
}

// Packs op(A)[i0 : i0 + mc, p0 : p0 + kc] into ceil(mc / 6) panels of [kc][6], rows past mc zero.
SY_NOINLINE SY_AVX2 void PackA(const Operand& a, int64_t i0, int64_t mc, int64_t p0, int64_t kc,
                               float* dst) {
  if (a.trans) {
    // A stored [k, m]: 8 rows of A at a time (in L1), 6 values of each into each panel, so each
    // panel is written contiguously (going along A's rows instead writes 24 panels at strides
    // that meet in the same L1 sets).
    const int64_t full = mc / kMr, rest = mc - full * kMr;
    for (int64_t kk0 = 0; kk0 < kc; kk0 += 8) {
      const int64_t kb = std::min<int64_t>(8, kc - kk0);
      const float* src = a.p + (p0 + kk0) * a.ld + i0;
      for (int64_t q = 0; q < full; ++q) {
        float* d = dst + q * kc * kMr + kk0 * kMr;
        for (int64_t r = 0; r < kb; ++r) {
          const float* sr = src + r * a.ld + q * kMr;
          _mm_storeu_ps(d + r * kMr, _mm_loadu_ps(sr));
          _mm_storel_pi(reinterpret_cast<__m64*>(d + r * kMr + 4),
                        _mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(sr + 4)));
        }
      }
      if (rest > 0) {
        float* d = dst + full * kc * kMr + kk0 * kMr;
        for (int64_t r = 0; r < kb; ++r) {
          for (int64_t i = 0; i < kMr; ++i) {
            d[r * kMr + i] = i < rest ? src[r * a.ld + full * kMr + i] : 0.0f;
          }
        }
      }
    }
    return;
  }
  for (int64_t ip = 0; ip < mc; ip += kMr, dst += kc * kMr) {
    const int64_t mr = std::min(kMr, mc - ip);
    // A stored [m, k]: 6 rows (and 2 repeated) transposed in 8 x 8 blocks; each 8-float store
    // runs 2 floats into the next k's slots, which the next store (or the tail) overwrites, and
    // the last one into the buffer's slack (Run allocates one panel more than it packs).
    const float* rows[8];
    for (int64_t i = 0; i < 8; ++i) {
      rows[i] = a.p + (i0 + ip + std::min<int64_t>(i, mr - 1)) * a.ld + p0;
    }
    int64_t kk = 0;
    if (mr == kMr) {
      for (; kk + 8 <= kc; kk += 8) {
        __m256 col[8];
        Transpose8x8(rows, kk, col);
        float* d = dst + kk * kMr;
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) _mm256_storeu_ps(d + q * kMr, col[q]);
      }
    }
    for (; kk < kc; ++kk) {
      float* d = dst + kk * kMr;
      for (int64_t i = 0; i < kMr; ++i) d[i] = i < mr ? rows[i][kk] : 0.0f;
    }
  }
}

// Packs op(B)[p0 : p0 + kc, j0 : j0 + nc] into ceil(nc / 16) panels of [kc][16], columns past nc
// zero.
SY_NOINLINE SY_AVX2 void PackB(const Operand& b, int64_t p0, int64_t kc, int64_t j0, int64_t nc,
                               float* dst) {
  const int64_t full = nc / kNr, rest = nc - full * kNr;
  if (!b.trans) {
    // B stored [k, n]: row by row (sequential reads), 16 values into each panel.
    for (int64_t kk = 0; kk < kc; ++kk) {
      const float* src = b.p + (p0 + kk) * b.ld + j0;
      float* d = dst + kk * kNr;
      for (int64_t q = 0; q < full; ++q) {
        _mm256_storeu_ps(d + q * kc * kNr, _mm256_loadu_ps(src + q * kNr));
        _mm256_storeu_ps(d + q * kc * kNr + 8, _mm256_loadu_ps(src + q * kNr + 8));
      }
      if (rest > 0) {
        float* dr = d + full * kc * kNr;
        for (int64_t j = 0; j < kNr; ++j) dr[j] = j < rest ? src[full * kNr + j] : 0.0f;
      }
    }
    return;
  }
  // B stored [n, k]: 16 rows transposed in 8 x 8 blocks, the rest one by one.
  for (int64_t q = 0; q <= full; ++q, dst += kc * kNr) {
    const int64_t nr = q < full ? kNr : rest;
    if (nr == 0) break;
    const float* src = b.p + (j0 + q * kNr) * b.ld + p0;
    int64_t kk0 = 0;
    if (nr == kNr) {
      const float* lo[8];
      const float* hi[8];
      for (int64_t j = 0; j < 8; ++j) {
        lo[j] = src + j * b.ld;
        hi[j] = src + (j + 8) * b.ld;
      }
      for (; kk0 + 8 <= kc; kk0 += 8) {
        __m256 c0[8], c1[8];
        Transpose8x8(lo, kk0, c0);
        Transpose8x8(hi, kk0, c1);
        float* d = dst + kk0 * kNr;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          _mm256_storeu_ps(d + i * kNr, c0[i]);
          _mm256_storeu_ps(d + i * kNr + 8, c1[i]);
        }
      }
    }
    for (int64_t kk = kk0; kk < kc; ++kk) {
      for (int64_t j = 0; j < kNr; ++j) dst[kk * kNr + j] = j < nr ? src[j * b.ld + kk] : 0.0f;
    }
  }
}

// The MR x 16 tile (MR = 6 but at the last rows of op(A)): C[0:MR, 0:16] = alpha * (A panel ·
// B panel) + beta * C (beta = 0: C not read). The A panel has 6 values per k whatever MR is.
template <int MR>
SY_NOINLINE SY_AVX2 void MicroKernel(int64_t kc, const float* a, const float* b, float* c,
                                     int64_t ldc, float alpha, float beta) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    acc0[i] = acc1[i] = _mm256_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 15), _MM_HINT_T0);
  }
#pragma GCC unroll 4
  for (int64_t kk = 0; kk < kc; ++kk) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    _mm_prefetch(reinterpret_cast<const char*>(b + 8 * kNr), _MM_HINT_T0);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i);
      acc0[i] = _mm256_fmadd_ps(av, b0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(av, b1, acc1[i]);
    }
    a += kMr;
    b += kNr;
  }
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  // Every loop over the tile is unrolled so the accumulators stay in registers.
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    float* cr = c + i * ldc;
    __m256 r0 = _mm256_mul_ps(va, acc0[i]), r1 = _mm256_mul_ps(va, acc1[i]);
    if (beta != 0.0f) {
      r0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(cr), r0);
      r1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(cr + 8), r1);
    }
    _mm256_storeu_ps(cr, r0);
    _mm256_storeu_ps(cr + 8, r1);
  }
}

// Full-width tiles by their rows: the last row tile of a block computes only the rows it has
// (an expert of 32 rows: 5 tiles of 6 and one of 2, not 6).
using TileFn = void (*)(int64_t, const float*, const float*, float*, int64_t, float, float);
constexpr TileFn kRowTiles[kMr] = {MicroKernel<1>, MicroKernel<2>, MicroKernel<3>,
                                   MicroKernel<4>, MicroKernel<5>, MicroKernel<6>};

// A tile at the right edge of C (nr < 16): computed into a buffer, then mr x nr stored.
SY_AVX2 void EdgeKernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                        int64_t mr, int64_t nr, float alpha, float beta) {
  alignas(32) float t[kMr * kNr];
  MicroKernel<kMr>(kc, a, b, t, kNr, alpha, 0.0f);
  for (int64_t i = 0; i < mr; ++i) {
    float* cr = c + i * ldc;
    for (int64_t j = 0; j < nr; ++j) {
      cr[j] = beta == 0.0f ? t[i * kNr + j] : t[i * kNr + j] + beta * cr[j];
    }
  }
}

// C = beta * C (k = 0).
void ScaleC(const GemmProblem& p, float beta) {
  for (int64_t i = 0; i < p.m; ++i) {
    float* cr = p.c + i * p.ldc;
    for (int64_t j = 0; j < p.n; ++j) cr[j] = beta == 0.0f ? 0.0f : beta * cr[j];
  }
}

void CheckProblem(Trans trans_a, Trans trans_b, const GemmProblem& p) {
  SY_REQUIRE(p.m >= 0 && p.n >= 0 && p.k >= 0, InvalidArgument,
             "PackedGemm: negative size m={} n={} k={}", p.m, p.n, p.k);
  const int64_t a_cols = trans_a == Trans::kNo ? p.k : p.m;
  const int64_t b_cols = trans_b == Trans::kNo ? p.n : p.k;
  SY_REQUIRE(p.lda >= std::max<int64_t>(1, a_cols), InvalidArgument,
             "PackedGemm: lda={} smaller than the {} columns of A", p.lda, a_cols);
  SY_REQUIRE(p.ldb >= std::max<int64_t>(1, b_cols), InvalidArgument,
             "PackedGemm: ldb={} smaller than the {} columns of B", p.ldb, b_cols);
  SY_REQUIRE(p.ldc >= std::max<int64_t>(1, p.n), InvalidArgument,
             "PackedGemm: ldc={} smaller than the {} columns of C", p.ldc, p.n);
}

// The calling thread's packs (up to one (kMc + kMr) x kKc block of op(A), one kKc x kNc of op(B)).
thread_local PackBuffer pack_a_buffer, pack_b_buffer;

// One stretch of op(A)'s rows (a row part) or of op(B)'s columns (a column part): a whole
// operand, or one block of it, with the size of that stretch. A fused pair has two parts on one
// side (PackedGemmSharedA: two column parts; PackedGemmSharedB: two row parts).
struct Part {
  Operand op;
  int64_t size;
};

// C of the tile at (row part r, row i of it; column part s, column j of it).
struct CView {
  float* p;
  int64_t ld;
};

// The products of every row part with every column part over all of k, with each column part at
// most kNc wide: op(B) is packed once per k block for all column parts, op(A) once per (k block,
// row block) for all column parts. c_of(r, s) gives the C of the pair (its row 0, column 0).
// With an epilogue, after the last k block it is called on each finished row block (all columns
// of the last column part), columns counted from `epi_col` (the column parts must then have the
// same size: the region is final in every part).
template <typename COf>
SY_AVX2 void RunBlock(std::span<const Part> rows, std::span<const Part> cols, int64_t k, COf&& c_of,
                      float alpha, float beta, const TileEpilogue* epi = nullptr,
                      int64_t epi_col = 0) {
  int64_t cols_padded = 0;
  for (const Part& s : cols) cols_padded += (s.size + kNr - 1) / kNr * kNr;
  const int64_t kc_max = std::min(kKc, k);
  float* pack_a = pack_a_buffer.Get((kMc + kMr) * kc_max);
  float* pack_b = pack_b_buffer.Get(cols_padded * kc_max);
  for (int64_t p0 = 0; p0 < k; p0 += kKc) {
    const int64_t kc = std::min(kKc, k - p0);
    const float beta_block = p0 == 0 ? beta : 1.0f;  // later k blocks accumulate
    const bool last_k = p0 + kc >= k;
    int64_t off = 0;
    for (const Part& s : cols) {
      PackB(s.op, p0, kc, 0, s.size, pack_b + off * kc);
      off += (s.size + kNr - 1) / kNr * kNr;
    }
    for (size_t r = 0; r < rows.size(); ++r) {
      for (int64_t i0 = 0; i0 < rows[r].size; i0 += kMc) {
        const int64_t mc = std::min(kMc, rows[r].size - i0);
        PackA(rows[r].op, i0, mc, p0, kc, pack_a);
        const float* bp = pack_b;
        for (size_t s = 0; s < cols.size(); ++s) {
          const CView cv = c_of(r, s);
          const int64_t nc = cols[s].size;
          for (int64_t jr = 0; jr < nc; jr += kNr, bp += kNr * kc) {
            const int64_t nr = std::min(kNr, nc - jr);
            for (int64_t ir = 0; ir < mc; ir += kMr) {
              const int64_t mr = std::min(kMr, mc - ir);
              const float* ap = pack_a + ir * kc;
              float* c = cv.p + (i0 + ir) * cv.ld + jr;
              if (nr == kNr) {
                kRowTiles[mr - 1](kc, ap, bp, c, cv.ld, alpha, beta_block);
              } else {
                EdgeKernel(kc, ap, bp, c, cv.ld, mr, nr, alpha, beta_block);
              }
            }
          }
        }
        // The row block's rows are final in every column part: one region of whole rows (the
        // epilogue then streams along rows; per 16-column panel it ran 2-3x slower, measured
        // on layer F).
        if (epi != nullptr && last_k) epi->fn(epi->ctx, i0, epi_col, mc, cols.back().size);
      }
    }
  }
}

// op(B)'s columns j0.. of a stored operand: the operand moved to that column.
Operand ColumnsFrom(const Operand& b, int64_t j0) {
  return {b.trans ? b.p + j0 * b.ld : b.p + j0, b.ld, b.trans};
}

SY_AVX2 void Run(Trans trans_a, Trans trans_b, const GemmProblem& p, float alpha, float beta,
                 const TileEpilogue* epi) {
  const Operand a{p.a, p.lda, trans_a == Trans::kYes};
  const Operand b{p.b, p.ldb, trans_b == Trans::kYes};
  const Part row{a, p.m};
  for (int64_t j0 = 0; j0 < p.n; j0 += kNc) {
    const Part col{ColumnsFrom(b, j0), std::min(kNc, p.n - j0)};
    RunBlock(
        std::span<const Part>(&row, 1), std::span<const Part>(&col, 1), p.k,
        [&](size_t, size_t) {
          return CView{p.c + j0, p.ldc};
        },
        alpha, beta, epi, j0);
  }
}

}  // namespace

bool PackedGemmAvailable() { return HostCpuFeatures().HasAvx2Fma(); }

void PackedGemm(Trans trans_a, Trans trans_b, const GemmProblem& p, float alpha, float beta,
                const TileEpilogue* epilogue) {
  SY_CHECK(PackedGemmAvailable(), "PackedGemm needs AVX2 and FMA");
  CheckProblem(trans_a, trans_b, p);
  if (p.m == 0 || p.n == 0) return;
  if (p.k == 0) {
    ScaleC(p, beta);
    if (epilogue != nullptr) epilogue->fn(epilogue->ctx, 0, 0, p.m, p.n);
    return;
  }
  Run(trans_a, trans_b, p, alpha, beta, epilogue);
}

namespace {

// Checks both products of a pair; returns true when they have to run one after the other
// (`apart`, or a size 0 that PackedGemm handles) and ran them so.
bool RanApart(Trans trans_a, Trans trans_b, const GemmProblem& p1, const GemmProblem& p2,
              float alpha, float beta, bool apart, const TileEpilogue* epilogue = nullptr) {
  SY_CHECK(PackedGemmAvailable(), "PackedGemm needs AVX2 and FMA");
  CheckProblem(trans_a, trans_b, p1);
  CheckProblem(trans_a, trans_b, p2);
  apart = apart || p1.k == 0 || p1.m == 0 || p1.n == 0 || p2.m == 0 || p2.n == 0;
  if (apart) {
    PackedGemm(trans_a, trans_b, p1, alpha, beta);
    PackedGemm(trans_a, trans_b, p2, alpha, beta);
    if (epilogue != nullptr && p1.m > 0 && p1.n > 0) {
      epilogue->fn(epilogue->ctx, 0, 0, p1.m, p1.n);
    }
  }
  return apart;
}

}  // namespace

void PackedGemmSharedA(Trans trans_a, Trans trans_b, const GemmProblem& p1, const GemmProblem& p2,
                       float alpha, float beta, const TileEpilogue* epilogue) {
  SY_REQUIRE(p1.m == p2.m && p1.k == p2.k && p1.a == p2.a && p1.lda == p2.lda, InvalidArgument,
             "PackedGemmSharedA: the products must share A (m, k, a, lda), got m={}/{} k={}/{}",
             p1.m, p2.m, p1.k, p2.k);
  SY_REQUIRE(epilogue == nullptr || p1.n == p2.n, InvalidArgument,
             "PackedGemmSharedA: an epilogue needs products of the same n, got n={}/{}", p1.n,
             p2.n);
  const auto padded = [](int64_t n) { return (n + kNr - 1) / kNr * kNr; };
  if (RanApart(trans_a, trans_b, p1, p2, alpha, beta, padded(p1.n) + padded(p2.n) > kNc,
               epilogue)) {
    return;
  }
  const Part row{{p1.a, p1.lda, trans_a == Trans::kYes}, p1.m};
  const Part cols[2] = {{{p1.b, p1.ldb, trans_b == Trans::kYes}, p1.n},
                        {{p2.b, p2.ldb, trans_b == Trans::kYes}, p2.n}};
  RunBlock(
      std::span<const Part>(&row, 1), cols, p1.k,
      [&](size_t, size_t s) {
        return s == 0 ? CView{p1.c, p1.ldc} : CView{p2.c, p2.ldc};
      },
      alpha, beta, epilogue);
}

void PackedGemmSharedB(Trans trans_a, Trans trans_b, const GemmProblem& p1, const GemmProblem& p2,
                       float alpha, float beta) {
  SY_REQUIRE(p1.n == p2.n && p1.k == p2.k && p1.b == p2.b && p1.ldb == p2.ldb, InvalidArgument,
             "PackedGemmSharedB: the products must share B (n, k, b, ldb), got n={}/{} k={}/{}",
             p1.n, p2.n, p1.k, p2.k);
  if (RanApart(trans_a, trans_b, p1, p2, alpha, beta, false)) return;
  const Operand b{p1.b, p1.ldb, trans_b == Trans::kYes};
  const Part rows[2] = {{{p1.a, p1.lda, trans_a == Trans::kYes}, p1.m},
                        {{p2.a, p2.lda, trans_a == Trans::kYes}, p2.m}};
  for (int64_t j0 = 0; j0 < p1.n; j0 += kNc) {
    const Part col{ColumnsFrom(b, j0), std::min(kNc, p1.n - j0)};
    RunBlock(
        rows, std::span<const Part>(&col, 1), p1.k,
        [&](size_t r, size_t) {
          return r == 0 ? CView{p1.c + j0, p1.ldc} : CView{p2.c + j0, p2.ldc};
        },
        alpha, beta);
  }
}

void PackedGroupedGemm(Trans trans_a, Trans trans_b, float alpha, float beta,
                       std::span<const GemmProblem> problems) {
  for (const GemmProblem& p : problems) PackedGemm(trans_a, trans_b, p, alpha, beta);
}

}  // namespace switchyard::kernels
