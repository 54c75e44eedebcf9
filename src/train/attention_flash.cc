// The flash attention core: tiled scores, online softmax, backward recomputing each tile
// (train/attention_flash.h).
#include "train/attention_flash.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "switchyard/kernels/cpu_features.h"
#include "switchyard/kernels/vec_math.h"
#include "train/parallel_for.h"

namespace switchyard::train::internal {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kRows = 6;  // register tile: kRows x 16 floats of C in 12 ymm accumulators

int64_t Pad16(int64_t n) { return (n + 15) / 16 * 16; }

// C[R, 16] (+)= op(A)[R, k] B[k, 16] (B rows ldb apart); op(A) = A (rows lda apart) or A^T
// (A stored [k, R], rows lda apart).
template <int R, bool kTransA>
__attribute__((target("avx2,fma"))) void MicroKernel(int64_t k, const float* a, int64_t lda,
                                                     const float* b, int64_t ldb, float* c,
                                                     int64_t ldc, bool accumulate) {
  __m256 c0[R], c1[R];
  // Every loop over r unrolled, so that the accumulators live in registers (not on the stack).
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b + p * ldb);
    const __m256 b1 = _mm256_loadu_ps(b + p * ldb + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(kTransA ? a + p * lda + r : a + r * lda + p);
      c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      c0[r] = _mm256_add_ps(c0[r], _mm256_loadu_ps(cr));
      c1[r] = _mm256_add_ps(c1[r], _mm256_loadu_ps(cr + 8));
    }
    _mm256_storeu_ps(cr, c0[r]);
    _mm256_storeu_ps(cr + 8, c1[r]);
  }
}

template <bool kTransA>
__attribute__((target("avx2,fma"))) void TileGemmAvx2(int64_t m, int64_t n, int64_t k,
                                                      const float* a, int64_t lda, const float* b,
                                                      float* c, int64_t ldc, bool accumulate) {
  // Row i of op(A): A's row i, or A's column i.
  auto row = [&](int64_t i) { return kTransA ? a + i : a + i * lda; };
  for (int64_t j = 0; j < n; j += 16) {
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      MicroKernel<kRows, kTransA>(k, row(i), lda, b + j, n, c + i * ldc + j, ldc, accumulate);
    const float* ai = row(i);
    float* ci = c + i * ldc + j;
    switch (m - i) {
      case 5: MicroKernel<5, kTransA>(k, ai, lda, b + j, n, ci, ldc, accumulate); break;
      case 4: MicroKernel<4, kTransA>(k, ai, lda, b + j, n, ci, ldc, accumulate); break;
      case 3: MicroKernel<3, kTransA>(k, ai, lda, b + j, n, ci, ldc, accumulate); break;
      case 2: MicroKernel<2, kTransA>(k, ai, lda, b + j, n, ci, ldc, accumulate); break;
      case 1: MicroKernel<1, kTransA>(k, ai, lda, b + j, n, ci, ldc, accumulate); break;
      default: break;
    }
  }
}

void TileGemmPlain(bool trans_a, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                   const float* b, float* c, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (!accumulate) std::fill_n(ci, n, 0.0f);
    for (int64_t p = 0; p < k; ++p) {
      const float av = trans_a ? a[p * lda + i] : a[i * lda + p];
      const float* bp = b + p * n;
      for (int64_t j = 0; j < n; ++j) ci[j] += av * bp[j];
    }
  }
}

// dst[c, r] = src[r, c] for r < rows, c < cols.
void Transpose(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

// dst[i, 0..hd) = src row i, zero up to hd_pad, for `rows` rows.
void PackRows(const float* src, int64_t lds, int64_t rows, int64_t hd, int64_t hd_pad, float* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    std::copy_n(src + i * lds, hd, dst + i * hd_pad);
    std::fill(dst + i * hd_pad + hd, dst + (i + 1) * hd_pad, 0.0f);
  }
}

// dst [hd, nkp] = src rows [nk, hd]^T, columns nk..nkp zero.
void PackTransposed(const float* src, int64_t lds, int64_t nk, int64_t hd, int64_t nkp,
                    float* dst) {
  std::fill_n(dst, hd * nkp, 0.0f);
  Transpose(src, nk, hd, lds, dst, nkp);
}

// Keys of row `i` of a query tile visible in a key tile: [0, Visible) (causal), all otherwise.
int64_t Visible(const FlashProblem& p, const SequenceChunk& qc, int64_t q0, const SequenceChunk& kc,
                int64_t k0, int64_t nk) {
  if (!p.causal) return nk;
  return std::clamp<int64_t>(qc.position + q0 - (kc.position + k0) + 1, 0, nk);
}

// One key tile of the sequence: chunk kc's rows [j0, j0 + nk).
struct KeyTile {
  const SequenceChunk* kc;
  int64_t j0, nk;
};

std::vector<KeyTile> KeyTiles(const FlashProblem& p) {
  std::vector<KeyTile> tiles;
  for (const SequenceChunk& kc : p.k_chunks)
    for (int64_t j0 = 0; j0 < kc.length; j0 += kFlashKeyTile)
      tiles.push_back({&kc, j0, std::min(kFlashKeyTile, kc.length - j0)});
  return tiles;
}

// Online softmax of one score tile s [tq, nkp] (raw q k^T) into probabilities (in place), given
// the running max m and sum l per row; o [tq, hd_pad] is rescaled when a row's max grows.
void OnlineSoftmaxTile(const FlashProblem& p, const SequenceChunk& qc, int64_t i0, int64_t tq,
                       const KeyTile& t, int64_t nkp, int64_t hd_pad, float* s, float* m, float* l,
                       float* o) {
  const float scale = p.scale();
  for (int64_t i = 0; i < tq; ++i) {
    float* row = s + i * nkp;
    const int64_t vis = Visible(p, qc, i0 + i, *t.kc, t.j0, t.nk);
    float mx = kNegInf;
    for (int64_t j = 0; j < vis; ++j) {
      row[j] *= scale;
      mx = std::max(mx, row[j]);
    }
    std::fill(row + vis, row + nkp, 0.0f);
    if (vis == 0) continue;
    const float m_new = std::max(m[i], mx);
    float sum = 0;
    for (int64_t j = 0; j < vis; ++j) {
      row[j] = kernels::vec::Exp(row[j] - m_new);
      sum += row[j];
    }
    if (m_new != m[i]) {
      const float alpha = m[i] == kNegInf ? 0.0f : kernels::vec::Exp(m[i] - m_new);
      float* orow = o + i * hd_pad;
      for (int64_t d = 0; d < hd_pad; ++d) orow[d] *= alpha;
      l[i] *= alpha;
      m[i] = m_new;
    }
    l[i] += sum;
  }
}

// out = out * exp(lse - lse') + o / l * exp(block_lse - lse'), lse' = log(e^lse + e^block_lse).
void MergeRow(const float* o, float m, float l, int64_t hd, float* dst, float& lse) {
  const float bl = m + std::log(l), inv = 1.0f / l;
  if (lse == kNegInf) {
    for (int64_t d = 0; d < hd; ++d) dst[d] = o[d] * inv;
    lse = bl;
    return;
  }
  const float mx = std::max(lse, bl);
  const float merged = mx + std::log(std::exp(lse - mx) + std::exp(bl - mx));
  const float wa = std::exp(lse - merged), wb = std::exp(bl - merged) * inv;
  for (int64_t d = 0; d < hd; ++d) dst[d] = dst[d] * wa + o[d] * wb;
  lse = merged;
}

}  // namespace

float FlashProblem::scale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

int64_t FlashProblem::ScratchFloats() const {
  const int64_t hd_pad = Pad16(head_dim), tile = kFlashQueryTile * kFlashKeyTile;
  const int64_t forward = static_cast<int64_t>(KeyTiles(*this).size()) * head_dim * kFlashKeyTile +
                          k.seq_rows * hd_pad + tile + kFlashQueryTile * (hd_pad + 2);
  const int64_t backward = 3 * q.seq_rows * hd_pad + 3 * head_dim * kFlashKeyTile +
                           3 * kFlashKeyTile * hd_pad + 2 * tile;
  return std::max(forward, backward);
}

void FlashTileGemm(bool trans_a, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                   const float* b, float* c, int64_t ldc, bool accumulate) {
  static const bool avx2 = kernels::HostCpuFeatures().HasAvx2Fma();
  if (!avx2) {
    TileGemmPlain(trans_a, m, n, k, a, lda, b, c, ldc, accumulate);
  } else if (trans_a) {
    TileGemmAvx2<true>(m, n, k, a, lda, b, c, ldc, accumulate);
  } else {
    TileGemmAvx2<false>(m, n, k, a, lda, b, c, ldc, accumulate);
  }
}

void FlashForward(const FlashProblem& p, const Mat& out, float* lse, int threads) {
  const int64_t hd = p.head_dim, hd_pad = Pad16(hd), bq = kFlashQueryTile;
  const std::vector<KeyTile> tiles = KeyTiles(p);
  const int64_t kt_size = hd * kFlashKeyTile;
  ParallelFor(p.batch * p.heads, threads, [&](int64_t t0, int64_t t1) {
    // Every key tile of the sequence packed once per (sequence, head): k^T tiles and v rows.
    std::vector<float> kt(tiles.size() * static_cast<size_t>(kt_size));
    std::vector<float> vp(static_cast<size_t>(p.k.seq_rows * hd_pad));
    std::vector<float> s(static_cast<size_t>(bq * kFlashKeyTile));
    std::vector<float> o(static_cast<size_t>(bq * hd_pad)), m(bq), l(bq);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / p.heads, h = t % p.heads, hc = h * hd;
      for (size_t x = 0; x < tiles.size(); ++x) {
        const KeyTile& kt_x = tiles[x];
        const int64_t row = kt_x.kc->row + kt_x.j0;
        PackTransposed(p.k.Row(b, row) + hc, p.k.ld, kt_x.nk, hd, Pad16(kt_x.nk),
                       kt.data() + x * kt_size);
        PackRows(p.v.Row(b, row) + hc, p.v.ld, kt_x.nk, hd, hd_pad, vp.data() + row * hd_pad);
      }
      for (const SequenceChunk& qc : p.q_chunks) {
        for (int64_t i0 = 0; i0 < qc.length; i0 += bq) {
          const int64_t tq = std::min(bq, qc.length - i0);
          std::fill(o.begin(), o.end(), 0.0f);
          std::fill(m.begin(), m.end(), kNegInf);
          std::fill(l.begin(), l.end(), 0.0f);
          const float* qrows = p.q.Row(b, qc.row + i0) + hc;
          for (size_t x = 0; x < tiles.size(); ++x) {
            const KeyTile& tile = tiles[x];
            if (p.Skipped(qc, i0, tq, *tile.kc, tile.j0)) continue;
            const int64_t nkp = Pad16(tile.nk);
            FlashTileGemm(false, tq, nkp, hd, qrows, p.q.ld, kt.data() + x * kt_size, s.data(), nkp,
                          false);
            OnlineSoftmaxTile(p, qc, i0, tq, tile, nkp, hd_pad, s.data(), m.data(), l.data(),
                              o.data());
            FlashTileGemm(false, tq, hd_pad, tile.nk, s.data(), nkp,
                          vp.data() + (tile.kc->row + tile.j0) * hd_pad, o.data(), hd_pad, true);
          }
          for (int64_t i = 0; i < tq; ++i) {
            if (l[i] == 0.0f) continue;  // every key masked for this query
            const int64_t row = qc.row + i0 + i;
            MergeRow(o.data() + i * hd_pad, m[i], l[i], hd, out.Row(b, row) + hc,
                     lse[t * out.seq_rows + row]);
          }
        }
      }
    }
  });
}

namespace {

// Scratch of one backward task, packed per (sequence, head) and per key tile.
struct BackwardScratch {
  explicit BackwardScratch(const FlashProblem& p, int64_t hd_pad)
      : qp(p.q.seq_rows * hd_pad),
        dop(p.q.seq_rows * hd_pad),
        dqs(p.q.seq_rows * hd_pad),
        kt(p.head_dim * kFlashKeyTile),
        vt(p.head_dim * kFlashKeyTile),
        kp(kFlashKeyTile * hd_pad),
        dk(kFlashKeyTile * hd_pad),
        dv(kFlashKeyTile * hd_pad),
        s(kFlashQueryTile * kFlashKeyTile),
        dp(kFlashQueryTile * kFlashKeyTile) {}
  std::vector<float> qp, dop, dqs;  // [q rows, hd_pad]: q, dout, the dq sum of the task
  std::vector<float> kt, vt;        // [hd, nkp]: the key tile's k^T, v^T
  std::vector<float> kp, dk, dv;    // [nk, hd_pad]: its k, and its dk, dv sums
  std::vector<float> s, dp;         // [tq, nkp]: P, dP then dS
};

// One (query tile, key tile) pair of the backward: dv, dk of the key tile and dq of the query
// tile accumulate in `w` (unscaled).
void BackwardPair(const FlashProblem& p, int64_t b, int64_t t, const float* lse,
                  const ConstMat& dout, const float* delta, const SequenceChunk& qc, int64_t i0,
                  int64_t tq, const KeyTile& tile, int64_t hd_pad, BackwardScratch& w) {
  const int64_t hd = p.head_dim, hc = (t % p.heads) * hd, nk = tile.nk, nkp = Pad16(nk);
  const int64_t r0 = qc.row + i0;
  const float scale = p.scale();
  // P = exp(scale q k^T - lse) over the visible keys.
  FlashTileGemm(false, tq, nkp, hd, p.q.Row(b, r0) + hc, p.q.ld, w.kt.data(), w.s.data(), nkp,
                false);
  for (int64_t i = 0; i < tq; ++i) {
    float* row = w.s.data() + i * nkp;
    const float li = lse[t * dout.seq_rows + r0 + i];
    const int64_t vis = li == kNegInf ? 0 : Visible(p, qc, i0 + i, *tile.kc, tile.j0, nk);
    for (int64_t j = 0; j < vis; ++j) row[j] = kernels::vec::Exp(row[j] * scale - li);
    std::fill(row + vis, row + nkp, 0.0f);
  }
  // dv += P^T dout.
  FlashTileGemm(true, nk, hd_pad, tq, w.s.data(), nkp, w.dop.data() + r0 * hd_pad, w.dv.data(),
                hd_pad, true);
  // dS = P (dout v^T - delta).
  FlashTileGemm(false, tq, nkp, hd, dout.Row(b, r0) + hc, dout.ld, w.vt.data(), w.dp.data(), nkp,
                false);
  for (int64_t i = 0; i < tq; ++i) {
    const float di = delta[t * dout.seq_rows + r0 + i];
    float* dpr = w.dp.data() + i * nkp;
    const float* pr = w.s.data() + i * nkp;
    for (int64_t j = 0; j < nk; ++j) dpr[j] = pr[j] * (dpr[j] - di);
  }
  // dq += dS k; dk += dS^T q.
  FlashTileGemm(false, tq, hd_pad, nk, w.dp.data(), nkp, w.kp.data(), w.dqs.data() + r0 * hd_pad,
                hd_pad, true);
  FlashTileGemm(true, nk, hd_pad, tq, w.dp.data(), nkp, w.qp.data() + r0 * hd_pad, w.dk.data(),
                hd_pad, true);
}

}  // namespace

void FlashBackward(const FlashProblem& p, const float* lse, const ConstMat& dout,
                   const float* delta, const Mat& dq, const Mat& dk, const Mat& dv, int threads) {
  const int64_t hd = p.head_dim, hd_pad = Pad16(hd), bq = kFlashQueryTile;
  const std::vector<KeyTile> tiles = KeyTiles(p);
  const float scale = p.scale();
  ParallelFor(p.batch * p.heads, threads, [&](int64_t t0, int64_t t1) {
    BackwardScratch w(p, hd_pad);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / p.heads, hc = (t % p.heads) * hd;
      for (const SequenceChunk& qc : p.q_chunks) {
        PackRows(p.q.Row(b, qc.row) + hc, p.q.ld, qc.length, hd, hd_pad,
                 w.qp.data() + qc.row * hd_pad);
        PackRows(dout.Row(b, qc.row) + hc, dout.ld, qc.length, hd, hd_pad,
                 w.dop.data() + qc.row * hd_pad);
      }
      std::fill(w.dqs.begin(), w.dqs.end(), 0.0f);
      for (const KeyTile& tile : tiles) {
        const int64_t row = tile.kc->row + tile.j0, nkp = Pad16(tile.nk);
        PackTransposed(p.k.Row(b, row) + hc, p.k.ld, tile.nk, hd, nkp, w.kt.data());
        PackTransposed(p.v.Row(b, row) + hc, p.v.ld, tile.nk, hd, nkp, w.vt.data());
        PackRows(p.k.Row(b, row) + hc, p.k.ld, tile.nk, hd, hd_pad, w.kp.data());
        std::fill(w.dk.begin(), w.dk.end(), 0.0f);
        std::fill(w.dv.begin(), w.dv.end(), 0.0f);
        bool any = false;
        for (const SequenceChunk& qc : p.q_chunks) {
          for (int64_t i0 = 0; i0 < qc.length; i0 += bq) {
            const int64_t tq = std::min(bq, qc.length - i0);
            if (p.Skipped(qc, i0, tq, *tile.kc, tile.j0)) continue;
            BackwardPair(p, b, t, lse, dout, delta, qc, i0, tq, tile, hd_pad, w);
            any = true;
          }
        }
        if (!any) continue;
        for (int64_t j = 0; j < tile.nk; ++j) {
          float* dkr = dk.Row(b, row + j) + hc;
          float* dvr = dv.Row(b, row + j) + hc;
          const float* dks = w.dk.data() + j * hd_pad;
          const float* dvs = w.dv.data() + j * hd_pad;
          for (int64_t d = 0; d < hd; ++d) {
            dkr[d] += scale * dks[d];
            dvr[d] += dvs[d];
          }
        }
      }
      for (const SequenceChunk& qc : p.q_chunks)
        for (int64_t i = 0; i < qc.length; ++i) {
          float* dqr = dq.Row(b, qc.row + i) + hc;
          const float* src = w.dqs.data() + (qc.row + i) * hd_pad;
          for (int64_t d = 0; d < hd; ++d) dqr[d] += scale * src[d];
        }
    }
  });
}

}  // namespace switchyard::train::internal
