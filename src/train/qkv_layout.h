// The attention core's q | k | v layout built from separate q, k, v projections with the kv heads
// repeated, and its adjoint (private to src/train: gqa_attention.cc, tensor_parallel_gqa.cc).
#pragma once

#include <cstdint>
#include <cstring>

#include "switchyard/core/tensor.h"

namespace switchyard::train {

// Copies (or with `add`, adds) columns [src_col, src_col + width) of every row of src [n, ...]
// into [dst_col, dst_col + width) of dst [n, ...].
inline void MoveColumns(const Tensor& src, int64_t src_col, const Tensor& dst, int64_t dst_col,
                        int64_t width, bool add) {
  const int64_t n = src.size(0), sc = src.size(1), dc = dst.size(1);
  const float* s = src.data<float>();
  float* d = dst.data<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* from = s + t * sc + src_col;
    float* to = d + t * dc + dst_col;
    if (add) {
      for (int64_t j = 0; j < width; ++j) to[j] += from[j];
    } else {
      std::memcpy(to, from, sizeof(float) * static_cast<size_t>(width));
    }
  }
}

// q [n, H * d], k and v [n, KV * d] -> the attention core's q | k | v [n, 3 * H * d], query head
// h using kv head h / (H / KV) (Hugging Face's repeat_kv).
inline Tensor RepeatKvQkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads,
                          int64_t kv_heads, int64_t d) {
  const int64_t n = q.size(0), rep = heads / kv_heads, qd = heads * d;
  Tensor qkv = Tensor::Empty({n, 3 * qd});
  MoveColumns(q, 0, qkv, 0, qd, false);
  for (int64_t h = 0; h < heads; ++h) {
    MoveColumns(k, (h / rep) * d, qkv, qd + h * d, d, false);
    MoveColumns(v, (h / rep) * d, qkv, 2 * qd + h * d, d, false);
  }
  return qkv;
}

// The adjoint of RepeatKvQkv: dqkv [n, 3 * H * d] -> dq [n, H * d] and dk, dv [n, KV * d], each kv
// head's gradient the sum over the query heads that used it.
struct QkvGrads {
  Tensor dq, dk, dv;
};
inline QkvGrads RepeatKvQkvBackward(const Tensor& dqkv, int64_t heads, int64_t kv_heads,
                                    int64_t d) {
  const int64_t n = dqkv.size(0), rep = heads / kv_heads, qd = heads * d;
  QkvGrads g{Tensor::Empty({n, qd}), Tensor::Zeros({n, kv_heads * d}),
             Tensor::Zeros({n, kv_heads * d})};
  MoveColumns(dqkv, 0, g.dq, 0, qd, false);
  for (int64_t h = 0; h < heads; ++h) {
    MoveColumns(dqkv, qd + h * d, g.dk, (h / rep) * d, d, true);
    MoveColumns(dqkv, 2 * qd + h * d, g.dv, (h / rep) * d, d, true);
  }
  return g;
}

}  // namespace switchyard::train
