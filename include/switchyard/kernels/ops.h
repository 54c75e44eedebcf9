// Element-wise, row-wise and index kernels on one rank (float32 unless stated).
// Every kernel has a plain reference in kernels/reference.h; tests compare the two.
// Pointers may be null when the corresponding size is 0. Outputs must not alias inputs unless
// stated.
#pragma once

#include <cstdint>
#include <string_view>

namespace switchyard::kernels {

// ---- softmax over the last dimension of [rows, cols] ----
// y = softmax(x) row by row (max-subtracted, computed in float32). y may alias x.
void SoftmaxRows(const float* x, float* y, int64_t rows, int64_t cols);
// dx = y * (dy - sum_j(dy_j * y_j)) row by row, from the softmax output y. dx may alias dy.
void SoftmaxRowsBackward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols);
// out[r] = log(sum_j exp(x[r, j])) computed stably.
void LogSumExpRows(const float* x, float* out, int64_t rows, int64_t cols);

// ---- top-k over the last dimension of [rows, cols], 1 <= k <= cols ----
// indices[r, j] / values[r, j] = the j-th largest element of row r (descending).
// Ties are broken by the lower column index (a stable order), so results are deterministic and
// equal on every rank. NaN compares as smaller than every number.
void TopK(const float* x, int64_t rows, int64_t cols, int64_t k, int32_t* indices, float* values);

// ---- cumulative sum along dim 0 of [rows, cols] (int32; counts and slot positions) ----
// exclusive: out[r, c] = sum_{i<r} in[i, c]; inclusive: sum_{i<=r}. out may alias in.
void CumsumDim0(const int32_t* in, int32_t* out, int64_t rows, int64_t cols, bool exclusive);

// ---- activations ----
enum class Activation : uint8_t { kRelu, kGelu, kSilu, kIdentity };
// "relu", "gelu" (exact, with erf), "silu", "identity"; throws InvalidArgument on other names.
Activation ActivationFromName(std::string_view name);
std::string_view ActivationName(Activation act);
// y = act(x), n elements. y may alias x.
void ActivationForward(Activation act, const float* x, float* y, int64_t n);
// dx = act'(x) * dy, from the pre-activation x. dx may alias dy.
void ActivationBackward(Activation act, const float* x, const float* dy, float* dx, int64_t n);

// ---- rows by index ----
// dst[i, :] = scale[i] * src[index[i], :] for i in [0, n); index[i] < 0 writes zeros.
// scale may be null (1). index values must be < src_rows (checked: InvalidArgument).
void GatherRows(const float* src, int64_t src_rows, int64_t cols, const int32_t* index,
                const float* scale, int64_t n, float* dst);
// dst[index[i], :] += scale[i] * src[i, :] for i in [0, n); index[i] < 0 is skipped.
// scale may be null (1). Rows are accumulated in order of i (deterministic).
void ScatterAddRows(const float* src, int64_t n, int64_t cols, const int32_t* index,
                    const float* scale, float* dst, int64_t dst_rows);
// out[i] = dot(a[i, :], b[i, :]) for i in [0, n).
void RowDot(const float* a, const float* b, int64_t n, int64_t cols, float* out);

}  // namespace switchyard::kernels
