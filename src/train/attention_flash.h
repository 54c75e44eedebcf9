// The flash attention core (FlashAttention-2's algorithm on the CPU) behind `attention_core flash`
// and the context-parallel ring and Ulysses cores (train/context_parallel.h).
//
// softmax(scale * q k^T, causal or not) v per sequence and head, between the query rows of
// `q_chunks` and the key rows of `k_chunks` (row offsets into q and k/v, global positions for the
// causal mask), never holding more than one score tile per thread:
//   - queries in tiles of kFlashQueryTile rows, keys in tiles of kFlashKeyTile rows; a key tile
//     entirely in the future of a query tile is skipped, only tiles crossing the diagonal are
//     masked element by element;
//   - forward: S = q_tile k_tile^T, an online softmax with the running row max and sum, O += P v
//     (rescaled when the max grows); the tile's result is merged into (out, lse) by the
//     log-sum-exp rule, so ring steps can add key blocks one after another;
//   - backward: per (sequence, head) and key tile, the scores of every query tile recomputed from
//     lse; dV += P^T dO, dP = dO v^T, dS = P (dP - delta), dQ += scale dS k, dK += scale dS^T q.
// The tile products (A B and A^T B, so the backward transposes nothing) run on a 6 x 16 AVX2/FMA
// register kernel when the CPU has it (cpuid), plain
// loops otherwise; operands are packed into contiguous zero-padded tiles first.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/train/context_parallel.h"

namespace switchyard::train::internal {

inline constexpr int64_t kFlashQueryTile = 64;
inline constexpr int64_t kFlashKeyTile = 64;

// Rows of a float matrix: row i of sequence b at p + (b * seq_rows + i) * ld.
struct ConstMat {
  const float* p = nullptr;
  int64_t ld = 0;
  int64_t seq_rows = 0;
  const float* Row(int64_t b, int64_t i) const { return p + (b * seq_rows + i) * ld; }
};
struct Mat {
  float* p = nullptr;
  int64_t ld = 0;
  int64_t seq_rows = 0;
  float* Row(int64_t b, int64_t i) const { return p + (b * seq_rows + i) * ld; }
  operator ConstMat() const { return {p, ld, seq_rows}; }
};

// One attention problem: q, k, v hold head h at columns [h * head_dim, (h + 1) * head_dim).
struct FlashProblem {
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  bool causal = true;
  ConstMat q, k, v;
  std::vector<SequenceChunk> q_chunks, k_chunks;

  float scale() const;
  // The key rows [k0, k0 + nk) of chunk kc are all in the future of the query rows [q0, q0 + nq)
  // of chunk qc (causal only).
  bool Skipped(const SequenceChunk& qc, int64_t q0, int64_t nq, const SequenceChunk& kc,
               int64_t k0) const {
    return causal && kc.position + k0 > qc.position + q0 + nq - 1;
  }
  // Floats of per-thread scratch the forward or backward holds.
  int64_t ScratchFloats() const;
};

// Merges the attention of `p` into (out, lse): out holds the normalized result and lse
// ([batch, heads, out.seq_rows], by query row) the log-sum-exp over the keys seen so far (-inf:
// none yet). Tasks are (sequence, head, query tile) over `threads` threads.
void FlashForward(const FlashProblem& p, const Mat& out, float* lse, int threads);

// Accumulates the gradients of `p` into dq, dk, dv (+=) from the final output's log-sum-exp,
// dout and delta = rowsum(dout * out) ([batch, heads, dout.seq_rows]). Tasks are (sequence,
// head): each owns its columns of dk and dv (and of dq).
void FlashBackward(const FlashProblem& p, const float* lse, const ConstMat& dout,
                   const float* delta, const Mat& dq, const Mat& dk, const Mat& dv, int threads);

// C[m, n] = (accumulate ? C : 0) + op(A)[m, k] B[k, n] with B contiguous (ldb = n) and n a
// multiple of 16; op(A) = A (stored [m, k]) or A^T (stored [k, m]), rows lda apart: the tile
// product (AVX2 register kernel or plain loops, by cpuid). Exposed for the tests.
void FlashTileGemm(bool trans_a, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                   const float* b, float* c, int64_t ldc, bool accumulate);

}  // namespace switchyard::train::internal
