// Fused expert activations (private to moe): branch-free loops the compiler vectorizes (with
// -fno-trapping-math), with a polynomial exp and the Abramowitz-Stegun 7.1.26 erf
// (|error| <= 1.5e-7 + rounding), fused with the fc1 bias and its gradient so that the
// elementwise work stays one pass over the [rows, H] buffers. Tests compare them with kernels::ref.
#pragma once

#include <cstdint>

#include "switchyard/kernels/ops.h"

namespace switchyard::moe {

// On `rows` rows of `cols` columns (row-major, contiguous):
//   pre1 += bias (broadcast over rows; bias may be null), then
//   hidden = act(pre1) * pre3 (gated, pre3 != nullptr) or act(pre1).
void ActivationForwardRows(kernels::Activation act, int64_t rows, int64_t cols, const float* bias,
                           float* pre1, const float* pre3, float* hidden);

// In: d holds d hidden. Out: d holds d pre1; d_pre3 (gated, pre3 != nullptr) receives d pre3;
// bias_grad (may be null) accumulates the column sums of d pre1 (rows in order).
void ActivationBackwardRows(kernels::Activation act, int64_t rows, int64_t cols, const float* pre1,
                            const float* pre3, float* d, float* d_pre3, float* bias_grad);

// Row-wise over [rows, cols]: y = softmax(x) (skipped when y is null) and lse[r] =
// log(sum_j exp(x[r, j])), with the vectorized exp. y may alias x.
void SoftmaxLseRows(const float* x, float* y, float* lse, int64_t rows, int64_t cols);

}  // namespace switchyard::moe
