// Plain reference kernels: straight loops, float64 accumulation. See kernels/reference.h.
#include "switchyard/kernels/reference.h"

#include <cmath>
#include <limits>
#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::kernels::ref {

void Gemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        double av = trans_a == Trans::kNo ? a[i * lda + p] : a[p * lda + i];
        double bv = trans_b == Trans::kNo ? b[p * ldb + j] : b[j * ldb + p];
        acc += av * bv;
      }
      double old = beta == 0.0f ? 0.0 : static_cast<double>(beta) * c[i * ldc + j];
      c[i * ldc + j] = static_cast<float>(alpha * acc + old);
    }
  }
}

void SoftmaxRows(const float* x, float* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < cols; ++j) mx = std::max(mx, static_cast<double>(x[r * cols + j]));
    double sum = 0.0;
    for (int64_t j = 0; j < cols; ++j) sum += std::exp(x[r * cols + j] - mx);
    for (int64_t j = 0; j < cols; ++j) {
      y[r * cols + j] = static_cast<float>(std::exp(x[r * cols + j] - mx) / sum);
    }
  }
}

void SoftmaxRowsBackward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    // d softmax_j / d x_i = y_j (delta_ij - y_i)  =>  dx_i = sum_j dy_j y_j (delta_ij - y_i)
    for (int64_t i = 0; i < cols; ++i) {
      double acc = 0.0;
      for (int64_t j = 0; j < cols; ++j) {
        double jac =
            static_cast<double>(y[r * cols + j]) * ((i == j ? 1.0 : 0.0) - y[r * cols + i]);
        acc += dy[r * cols + j] * jac;
      }
      dx[r * cols + i] = static_cast<float>(acc);
    }
  }
}

void LogSumExpRows(const float* x, float* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int64_t j = 0; j < cols; ++j) sum += std::exp(static_cast<double>(x[r * cols + j]));
    out[r] = static_cast<float>(std::log(sum));
  }
}

void TopK(const float* x, int64_t rows, int64_t cols, int64_t k, int32_t* indices, float* values) {
  SY_REQUIRE(k >= 1 && k <= cols, InvalidArgument, "TopK: k = {} must be in [1, cols = {}]", k,
             cols);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<bool> taken(static_cast<size_t>(cols), false);
    for (int64_t j = 0; j < k; ++j) {
      // Selection: first not-taken maximum, scanning left to right (lower index wins ties);
      // NaN is smaller than everything.
      int64_t best = -1;
      for (int64_t c = 0; c < cols; ++c) {
        if (taken[static_cast<size_t>(c)]) continue;
        if (best < 0) {
          best = c;
          continue;
        }
        float v = x[r * cols + c], bv = x[r * cols + best];
        if (std::isnan(bv) && !std::isnan(v))
          best = c;
        else if (!std::isnan(v) && v > bv)
          best = c;
      }
      taken[static_cast<size_t>(best)] = true;
      indices[r * k + j] = static_cast<int32_t>(best);
      values[r * k + j] = x[r * cols + best];
    }
  }
}

void CumsumDim0(const int32_t* in, int32_t* out, int64_t rows, int64_t cols, bool exclusive) {
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      int64_t acc = 0;
      for (int64_t i = 0; i < (exclusive ? r : r + 1); ++i) acc += in[i * cols + c];
      out[r * cols + c] = static_cast<int32_t>(acc);
    }
  }
}

namespace {
double ActRef(Activation act, double x) {
  switch (act) {
    case Activation::kRelu: return x > 0 ? x : 0;
    case Activation::kGelu: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::kSilu: return x / (1.0 + std::exp(-x));
    case Activation::kIdentity: return x;
  }
  return 0;
}
}  // namespace

void ActivationForward(Activation act, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(ActRef(act, x[i]));
}

void ActivationBackward(Activation act, const float* x, const float* dy, float* dx, int64_t n) {
  // Central difference of the float64 reference (h chosen for double precision), except at the
  // relu kink where the convention is derivative 0 at x = 0.
  for (int64_t i = 0; i < n; ++i) {
    double xi = x[i], d;
    if (act == Activation::kRelu) {
      d = xi > 0 ? 1.0 : 0.0;
    } else {
      double h = 1e-6 * std::max(1.0, std::abs(xi));
      d = (ActRef(act, xi + h) - ActRef(act, xi - h)) / (2 * h);
    }
    dx[i] = static_cast<float>(d * dy[i]);
  }
}

void GatherRows(const float* src, int64_t src_rows, int64_t cols, const int32_t* index,
                const float* scale, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      int32_t s = index[i];
      SY_REQUIRE(s < src_rows, InvalidArgument, "GatherRows: index out of range");
      dst[i * cols + j] = s < 0 ? 0.0f : (scale ? scale[i] : 1.0f) * src[s * cols + j];
    }
  }
}

void ScatterAddRows(const float* src, int64_t n, int64_t cols, const int32_t* index,
                    const float* scale, float* dst, int64_t dst_rows) {
  for (int64_t t = 0; t < dst_rows; ++t) {
    for (int64_t j = 0; j < cols; ++j) {
      double acc = dst[t * cols + j];
      for (int64_t i = 0; i < n; ++i) {
        if (index[i] == t) acc += static_cast<double>(scale ? scale[i] : 1.0f) * src[i * cols + j];
      }
      dst[t * cols + j] = static_cast<float>(acc);
    }
  }
}

}  // namespace switchyard::kernels::ref
