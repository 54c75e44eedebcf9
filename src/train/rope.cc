// Rotary position embeddings ("rotate half" form), forward and adjoint.
#include "switchyard/train/rope.h"

#include <cmath>
#include <vector>

#include "switchyard/core/error.h"
#include "train/parallel_for.h"

namespace switchyard::train {
namespace {

// Rotates every head of every row by +angle (sign 1) or -angle (sign -1).
Tensor Rotate(const Tensor& x, std::span<const int64_t> positions, int64_t head_dim, double theta,
              float sign, int threads, const char* what) {
  SY_REQUIRE(x.defined() && x.dim() == 2 && x.dtype() == DType::kFloat32, InvalidArgument,
             "{}: expected float32 [num_tokens, num_heads * head_dim], got {}", what,
             x.defined() ? ShapeToString(x.shape()) : "undefined");
  SY_REQUIRE(head_dim > 0 && head_dim % 2 == 0 && x.size(1) % head_dim == 0, InvalidArgument,
             "{}: head_dim {} must be even and divide the {} columns", what, head_dim, x.size(1));
  SY_REQUIRE(static_cast<int64_t>(positions.size()) == x.size(0), InvalidArgument,
             "{}: expected {} positions (one per token), got {}", what, x.size(0),
             positions.size());
  SY_REQUIRE(theta > 0 && std::isfinite(theta), InvalidArgument,
             "{}: rope_theta must be positive and finite, got {}", what, theta);
  const int64_t n = x.size(0), cols = x.size(1), half = head_dim / 2;
  for (int64_t t = 0; t < n; ++t) {
    SY_REQUIRE(positions[static_cast<size_t>(t)] >= 0, InvalidArgument,
               "{}: positions[{}] = {}: expected >= 0", what, t, positions[static_cast<size_t>(t)]);
  }
  // inv_freq as Hugging Face computes it: arange(0, d, 2).float() / d, theta ** that, 1 / that,
  // all in float32.
  std::vector<float> inv_freq(static_cast<size_t>(half));
  const float base = static_cast<float>(theta);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[static_cast<size_t>(i)] = 1.0f / std::pow(base, exponent);
  }
  Tensor y = Tensor::Empty({n, cols});
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = positions[static_cast<size_t>(t)];
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pos) * inv_freq[static_cast<size_t>(i)];
        c[static_cast<size_t>(i)] = std::cos(angle);
        s[static_cast<size_t>(i)] = sign * std::sin(angle);
      }
      for (int64_t h = 0; h < cols; h += head_dim) {
        const float* xr = xp + t * cols + h;
        float* yr = yp + t * cols + h;
        for (int64_t i = 0; i < half; ++i) {
          const float a = xr[i], b = xr[i + half];
          const float ci = c[static_cast<size_t>(i)], si = s[static_cast<size_t>(i)];
          yr[i] = a * ci - b * si;
          yr[i + half] = b * ci + a * si;
        }
      }
    }
  });
  return y;
}

}  // namespace

Tensor RopeForward(const Tensor& x, std::span<const int64_t> positions, int64_t head_dim,
                   double theta, int threads) {
  return Rotate(x, positions, head_dim, theta, 1.0f, threads, "rope x");
}

Tensor RopeBackward(const Tensor& dy, std::span<const int64_t> positions, int64_t head_dim,
                    double theta, int threads) {
  return Rotate(dy, positions, head_dim, theta, -1.0f, threads, "rope dy");
}

std::vector<int64_t> SequencePositions(int64_t batch_size, int64_t seq_len) {
  std::vector<int64_t> p(static_cast<size_t>(batch_size * seq_len));
  for (int64_t i = 0; i < batch_size * seq_len; ++i) p[static_cast<size_t>(i)] = i % seq_len;
  return p;
}

}  // namespace switchyard::train
