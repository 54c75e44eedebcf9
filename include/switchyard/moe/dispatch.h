// Dispatch (encode) and combine (decode) by index (docs/moe.md, "Dispatch, experts, combine"),
// forward and backward.
//
// Rows are gathered and summed through the plan's index arrays: O(T * k * M) work, never the
// one-hot [T, E, C] einsum of the GShard pseudo-code (O(T * E * C * M)).
//   post-score (default)  expert_in[r] = x[t(r)];             y[t] = sum_j w_tj * expert_out[r_tj]
//   pre-score             expert_in[r] = w_{pair(r)} x[t(r)];  y[t] = sum_j expert_out[r_tj]
// Padding rows of the expert buffer are zero. Every output row is written by exactly one thread,
// in a fixed order: results do not depend on the thread count.
//
// `threads` is the number of compute threads this call may use (<= the rank's budget).
#pragma once

#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/plan.h"

namespace switchyard::moe {

// x [T, M] float32 -> expert input [num_rows, M] float32.
Tensor Dispatch(const DispatchPlan& plan, const Tensor& x, bool prescore, int threads = 1);

// expert_out [num_rows, M] float32 -> y [T, M] float32.
Tensor Combine(const DispatchPlan& plan, const Tensor& expert_out, bool prescore, int threads = 1);

struct CombineGradients {
  Tensor expert_out;           // [num_rows, M] float32; zero on padding rows
  std::vector<float> weights;  // [T, k] d combine weights (post-score; zeros with prescore)
};
// dy [T, M] float32; expert_out as produced by the forward.
CombineGradients CombineBackward(const DispatchPlan& plan, const Tensor& dy,
                                 const Tensor& expert_out, bool prescore, int threads = 1);

struct DispatchGradients {
  Tensor x;                    // [T, M] float32
  std::vector<float> weights;  // [T, k] d combine weights (prescore; zeros with post-score)
};
// d_expert_in [num_rows, M] float32; x [T, M] the forward input.
DispatchGradients DispatchBackward(const DispatchPlan& plan, const Tensor& d_expert_in,
                                   const Tensor& x, bool prescore, int threads = 1);

}  // namespace switchyard::moe
