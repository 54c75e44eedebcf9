#include "switchyard/kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/reduce.h"
#include "switchyard/kernels/vec_math.h"

namespace switchyard::kernels {

void SoftmaxRows(const float* x, float* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    const float mx = Max(xr, cols);
    for (int64_t j = 0; j < cols; ++j) yr[j] = vec::Exp(xr[j] - mx);
    const float inv = 1.0f / Sum(yr, cols);
    for (int64_t j = 0; j < cols; ++j) yr[j] *= inv;
  }
}

void SoftmaxRowsBackward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * cols;
    const float* dyr = dy + r * cols;
    float* dxr = dx + r * cols;
    const float dot = Dot(yr, dyr, cols);
    for (int64_t j = 0; j < cols; ++j) dxr[j] = yr[j] * (dyr[j] - dot);
  }
}

void LogSumExpRows(const float* x, float* out, int64_t rows, int64_t cols) {
  // exp(x - max) goes through a small buffer, a block at a time, so that both the exponentials
  // and their sum vectorize.
  constexpr int64_t kBlock = 256;
  float block[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    const float mx = Max(xr, cols);
    if (!std::isfinite(mx)) {
      out[r] = mx;
      continue;
    }
    float sum = 0.0f;
    for (int64_t j0 = 0; j0 < cols; j0 += kBlock) {
      const int64_t m = std::min(kBlock, cols - j0);
      for (int64_t j = 0; j < m; ++j) block[j] = vec::Exp(xr[j0 + j] - mx);
      sum += Sum(block, m);
    }
    out[r] = mx + std::log(sum);
  }
}

namespace {
// a ranks before b: larger value first, NaN last, lower index first on ties.
inline bool Before(float va, int32_t ia, float vb, int32_t ib) {
  bool na = std::isnan(va), nb = std::isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}
}  // namespace

void TopK(const float* x, int64_t rows, int64_t cols, int64_t k, int32_t* indices, float* values) {
  SY_REQUIRE(k >= 1 && k <= cols, InvalidArgument, "TopK: k = {} must be in [1, cols = {}]", k,
             cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    int32_t* ir = indices + r * k;
    float* vr = values + r * k;
    // Insertion into a sorted list of length <= k: O(cols * k), fast for the small k of gating.
    int64_t len = 0;
    for (int64_t j = 0; j < cols; ++j) {
      float v = xr[j];
      auto idx = static_cast<int32_t>(j);
      if (len == k && !Before(v, idx, vr[k - 1], ir[k - 1])) continue;
      int64_t pos = len < k ? len++ : k - 1;
      while (pos > 0 && Before(v, idx, vr[pos - 1], ir[pos - 1])) {
        vr[pos] = vr[pos - 1];
        ir[pos] = ir[pos - 1];
        --pos;
      }
      vr[pos] = v;
      ir[pos] = idx;
    }
  }
}

void CumsumDim0(const int32_t* in, int32_t* out, int64_t rows, int64_t cols, bool exclusive) {
  if (cols <= 0) return;
  std::vector<int32_t> run(static_cast<size_t>(cols), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      int32_t v = in[r * cols + c];
      auto& acc = run[static_cast<size_t>(c)];
      if (exclusive) {
        out[r * cols + c] = acc;
        acc += v;
      } else {
        acc += v;
        out[r * cols + c] = acc;
      }
    }
  }
}

Activation ActivationFromName(std::string_view name) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "silu" || name == "swish") return Activation::kSilu;
  if (name == "identity") return Activation::kIdentity;
  throw InvalidArgument(
      fmt::format("unknown activation '{}': expected one of relu, gelu, silu, identity", name));
}

std::string_view ActivationName(Activation act) {
  switch (act) {
    case Activation::kRelu: return "relu";
    case Activation::kGelu: return "gelu";
    case Activation::kSilu: return "silu";
    case Activation::kIdentity: return "identity";
  }
  return "?";
}

namespace {
constexpr float kInvSqrt2 = 0.70710678118654752440f;
}  // namespace

void ActivationForward(Activation act, const float* x, float* y, int64_t n) {
  switch (act) {
    case Activation::kRelu:
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
      break;
    case Activation::kGelu:
      for (int64_t i = 0; i < n; ++i) y[i] = 0.5f * x[i] * (1.0f + vec::Erf(x[i] * kInvSqrt2));
      break;
    case Activation::kSilu:
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] / (1.0f + vec::Exp(-x[i]));
      break;
    case Activation::kIdentity:
      if (y != x && n > 0) std::memcpy(y, x, static_cast<size_t>(n) * sizeof(float));
      break;
  }
}

void ActivationBackward(Activation act, const float* x, const float* dy, float* dx, int64_t n) {
  switch (act) {
    case Activation::kRelu:
      for (int64_t i = 0; i < n; ++i) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
      break;
    case Activation::kGelu:
      for (int64_t i = 0; i < n; ++i) {
        vec::CdfPdf c = vec::NormalCdfPdf(x[i]);
        dx[i] = dy[i] * (c.cdf + x[i] * c.pdf);
      }
      break;
    case Activation::kSilu:
      for (int64_t i = 0; i < n; ++i) {
        float s = 1.0f / (1.0f + vec::Exp(-x[i]));
        dx[i] = dy[i] * s * (1.0f + x[i] * (1.0f - s));
      }
      break;
    case Activation::kIdentity:
      if (dx != dy && n > 0) std::memcpy(dx, dy, static_cast<size_t>(n) * sizeof(float));
      break;
  }
}

void GatherRows(const float* src, int64_t src_rows, int64_t cols, const int32_t* index,
                const float* scale, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    int32_t s = index[i];
    float* d = dst + i * cols;
    if (s < 0) {
      std::fill_n(d, cols, 0.0f);
      continue;
    }
    SY_REQUIRE(s < src_rows, InvalidArgument, "GatherRows: index[{}] = {} >= source rows {}", i, s,
               src_rows);
    const float* sr = src + static_cast<int64_t>(s) * cols;
    if (scale == nullptr) {
      std::memcpy(d, sr, static_cast<size_t>(cols) * sizeof(float));
    } else {
      float g = scale[i];
      for (int64_t j = 0; j < cols; ++j) d[j] = g * sr[j];
    }
  }
}

void ScatterAddRows(const float* src, int64_t n, int64_t cols, const int32_t* index,
                    const float* scale, float* dst, int64_t dst_rows) {
  for (int64_t i = 0; i < n; ++i) {
    int32_t t = index[i];
    if (t < 0) continue;
    SY_REQUIRE(t < dst_rows, InvalidArgument,
               "ScatterAddRows: index[{}] = {} >= destination rows {}", i, t, dst_rows);
    float* d = dst + static_cast<int64_t>(t) * cols;
    const float* s = src + i * cols;
    float g = scale ? scale[i] : 1.0f;
    for (int64_t j = 0; j < cols; ++j) d[j] += g * s[j];
  }
}

void RowDot(const float* a, const float* b, int64_t n, int64_t cols, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = Dot(a + i * cols, b + i * cols, cols);
  }
}

}  // namespace switchyard::kernels
