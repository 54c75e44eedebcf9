#include "switchyard/moe/dispatch.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "moe/activation.h"
#include "moe/parallel_for.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/reduce.h"

namespace switchyard::moe {
namespace {

// Rows per thread below which a loop stays on one thread.
constexpr int64_t kRowGrain = 64;

void CheckRows(std::string_view name, const Tensor& t, int64_t rows, int64_t cols) {
  ExpectDType(name, t, DType::kFloat32);
  ExpectShape(name, t, {rows, cols});
}

inline void Scale(float* __restrict dst, const float* __restrict src, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = s * src[i];
}
inline void Axpy(float* __restrict dst, const float* __restrict src, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += s * src[i];
}

// The [num_rows, M] expert buffers that Dispatch and CombineBackward write are read back by the
// expert GEMMs expert by expert, starting with the rows written first. When the buffer is larger
// than the last-level cache (32 MiB on the VMs of docs/PERFORMANCE.md) those rows are gone from
// it by then, so the rows are written with non-temporal stores: no read of each destination line
// before it is written (a third of the copy's memory traffic). Smaller buffers stay in cache for
// the GEMMs and are written normally. The values are those of the plain loops (one rounding of
// s * x per element).
constexpr int64_t kStreamMinBytes = int64_t{32} << 20;

// Whether rows of `cols` floats of a `rows`-row buffer at `base` are written with streaming
// stores (x86-64 only; 16-byte aligned rows).
bool StreamRows(const float* base, int64_t rows, int64_t cols) {
#if defined(__x86_64__)
  return rows * cols * static_cast<int64_t>(sizeof(float)) >= kStreamMinBytes && cols % 4 == 0 &&
         reinterpret_cast<uintptr_t>(base) % 16 == 0;
#else
  (void)base, (void)rows, (void)cols;
  return false;
#endif
}

// dst = s * src (scale) or dst = src (!scale) over n floats, streaming when `stream`.
inline void WriteRow(float* __restrict dst, const float* __restrict src, float s, bool scale,
                     int64_t n, bool stream) {
#if defined(__x86_64__)
  if (stream) {
    const __m128 vs = _mm_set1_ps(s);
    for (int64_t i = 0; i < n; i += 4) {
      const __m128 v = _mm_loadu_ps(src + i);
      _mm_stream_ps(dst + i, scale ? _mm_mul_ps(vs, v) : v);
    }
    return;
  }
#endif
  if (scale) {
    Scale(dst, src, s, n);
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}

// Makes a thread's streaming stores visible before it reports its rows done.
inline void StreamFence(bool stream) {
#if defined(__x86_64__)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

}  // namespace

Tensor Dispatch(const DispatchPlan& plan, const Tensor& x, bool prescore, int threads) {
  ExpectDType("x", x, DType::kFloat32);
  ExpectShape("x", x, {plan.num_tokens, kAnySize});
  const int64_t m_dim = x.size(1);
  Tensor out = Tensor::Empty({plan.num_rows, m_dim});
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  const bool stream = StreamRows(op, plan.num_rows, m_dim);
  ParallelFor(plan.num_rows, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t t = plan.row_tokens[static_cast<size_t>(r)];
      float* dst = op + r * m_dim;
      if (t < 0) {
        std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
      } else {
        const float w =
            prescore ? plan.weights[static_cast<size_t>(plan.row_pairs[static_cast<size_t>(r)])]
                     : 1.0f;
        WriteRow(dst, xp + int64_t{t} * m_dim, w, prescore, m_dim, stream);
      }
    }
    StreamFence(stream);
  });
  return out;
}

Tensor Combine(const DispatchPlan& plan, const Tensor& expert_out, bool prescore, int threads) {
  ExpectDType("expert_out", expert_out, DType::kFloat32);
  ExpectShape("expert_out", expert_out, {plan.num_rows, kAnySize});
  const int64_t m_dim = expert_out.size(1), k = plan.top_k;
  Tensor y = Tensor::Empty({plan.num_tokens, m_dim});
  const float* ep = expert_out.data<float>();
  float* yp = y.data<float>();
  ParallelFor(plan.num_tokens, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = yp + t * m_dim;
      bool first = true;
      for (int64_t j = 0; j < k; ++j) {
        auto i = static_cast<size_t>(t * k + j);
        int32_t r = plan.rows[i];
        if (r < 0) continue;
        float w = prescore ? 1.0f : plan.weights[i];
        if (first) {
          Scale(dst, ep + int64_t{r} * m_dim, w, m_dim);
          first = false;
        } else {
          Axpy(dst, ep + int64_t{r} * m_dim, w, m_dim);
        }
      }
      if (first) std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
    }
  });
  return y;
}

CombineGradients CombineBackward(const DispatchPlan& plan, const Tensor& dy,
                                 const Tensor& expert_out, bool prescore, int threads) {
  ExpectDType("dy", dy, DType::kFloat32);
  ExpectShape("dy", dy, {plan.num_tokens, kAnySize});
  const int64_t m_dim = dy.size(1), k = plan.top_k;
  CheckRows("expert_out", expert_out, plan.num_rows, m_dim);
  CombineGradients g;
  g.expert_out = Tensor::Empty({plan.num_rows, m_dim});
  g.weights.assign(static_cast<size_t>(plan.num_tokens * k), 0.0f);
  const float* dyp = dy.data<float>();
  const float* ep = expert_out.data<float>();
  float* dp = g.expert_out.data<float>();
  const bool stream = StreamRows(dp, plan.num_rows, m_dim);
  ParallelFor(plan.num_rows, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t t = plan.row_tokens[static_cast<size_t>(r)];
      float* dst = dp + r * m_dim;
      if (t < 0) {
        std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
        continue;
      }
      auto pair = static_cast<size_t>(plan.row_pairs[static_cast<size_t>(r)]);
      WriteRow(dst, dyp + int64_t{t} * m_dim, plan.weights[pair], !prescore, m_dim, stream);
      if (!prescore) {
        g.weights[pair] = kernels::Dot(dyp + int64_t{t} * m_dim, ep + r * m_dim, m_dim);
      }
    }
    StreamFence(stream);
  });
  return g;
}

DispatchGradients DispatchBackward(const DispatchPlan& plan, const Tensor& d_expert_in,
                                   const Tensor& x, bool prescore, int threads) {
  ExpectDType("x", x, DType::kFloat32);
  ExpectShape("x", x, {plan.num_tokens, kAnySize});
  const int64_t m_dim = x.size(1), k = plan.top_k;
  CheckRows("d_expert_in", d_expert_in, plan.num_rows, m_dim);
  DispatchGradients g;
  g.x = Tensor::Empty({plan.num_tokens, m_dim});
  g.weights.assign(static_cast<size_t>(plan.num_tokens * k), 0.0f);
  const float* dp = d_expert_in.data<float>();
  const float* xp = x.data<float>();
  float* dxp = g.x.data<float>();
  ParallelFor(plan.num_tokens, threads, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = dxp + t * m_dim;
      bool first = true;
      for (int64_t j = 0; j < k; ++j) {
        auto i = static_cast<size_t>(t * k + j);
        int32_t r = plan.rows[i];
        if (r < 0) continue;
        const float* src = dp + int64_t{r} * m_dim;
        float w = prescore ? plan.weights[i] : 1.0f;
        if (prescore) g.weights[i] = kernels::Dot(xp + t * m_dim, src, m_dim);
        if (first) {
          Scale(dst, src, w, m_dim);
          first = false;
        } else {
          Axpy(dst, src, w, m_dim);
        }
      }
      if (first) std::memset(dst, 0, static_cast<size_t>(m_dim) * sizeof(float));
    }
  });
  return g;
}

}  // namespace switchyard::moe
