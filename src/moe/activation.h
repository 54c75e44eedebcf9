// Fused expert activations (private to moe): branch-free loops the compiler vectorizes (with
// -fno-trapping-math), with a polynomial exp and the Abramowitz-Stegun 7.1.26 erf
// (|error| <= 1.5e-7 + rounding), fused with the fc1 bias and its gradient so that the
// elementwise work stays one pass over the [rows, H] buffers. The forward evaluates the activation
// and its derivative together and keeps the derivative; the backward only multiplies.
// Tests compare them with kernels::ref.
#pragma once

#include <cstdint>

#include "switchyard/kernels/ops.h"

namespace switchyard::moe {

// On `rows` rows of `cols` columns (row-major, contiguous):
//   pre1 += bias (broadcast over rows; bias may be null), then
//   hidden = act(pre1) * pre3 (gated, pre3 != nullptr) or act(pre1).
// With save_scales (a forward that keeps what its backward needs), the inputs are then replaced by
// the derivatives of hidden, so the backward is two products and never evaluates the activation
// again: pre1 <- d hidden / d pre1 = act'(pre1) * pre3 (gated) or act'(pre1), and (gated)
// pre3 <- d hidden / d pre3 = act(pre1). pre1, pre3 and hidden must not overlap. hidden is the
// same with and without save_scales, bit for bit.
void ActivationForwardRows(kernels::Activation act, int64_t rows, int64_t cols, const float* bias,
                           float* pre1, float* pre3, float* hidden, bool save_scales);
// The same on a block of `rows` x `cols` inside buffers whose rows are `ld` floats apart (all
// four; bias holds the block's `cols` columns): the fused SwiGLU epilogue of the gate and up
// products runs it row block by row block (moe/experts.cc). Each element gets the same arithmetic
// as in ActivationForwardRows.
void ActivationForwardBlock(kernels::Activation act, int64_t rows, int64_t cols, int64_t ld,
                            const float* bias, float* pre1, float* pre3, float* hidden,
                            bool save_scales);

// In: d holds d hidden; scale1 / scale3 are the buffers ActivationForwardRows left with
// save_scales. Out: d holds d pre1 = d * scale1; d_pre3 (gated, scale3 != nullptr) receives
// d * scale3; bias_grad (may be null) accumulates the column sums of d pre1 (rows in order).
// No two of the five buffers may overlap.
void ActivationBackwardRows(int64_t rows, int64_t cols, const float* scale1, const float* scale3,
                            float* d, float* d_pre3, float* bias_grad);
// The same on a block inside buffers whose rows are `ld` floats apart (bias_grad holds the
// block's `cols` columns): the epilogue of the dh = dY W2 product (moe/experts.cc). Blocks of
// one column visited in row order give ActivationBackwardRows' bias sums bit for bit.
void ActivationBackwardBlock(int64_t rows, int64_t cols, int64_t ld, const float* scale1,
                             const float* scale3, float* d, float* d_pre3, float* bias_grad);

// Row-wise over [rows, cols]: y = softmax(x) (skipped when y is null) and lse[r] =
// log(sum_j exp(x[r, j])), with the vectorized exp. y may alias x.
void SoftmaxLseRows(const float* x, float* y, float* lse, int64_t rows, int64_t cols);

}  // namespace switchyard::moe
