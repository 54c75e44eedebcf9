// Expert FFNs over an expert buffer (docs/moe.md, "Dispatch, experts, combine"), forward and
// backward.
//
// Per expert e, on its rows X_e of the buffer:
//   plain   h = act(X_e W1_e^T + b1_e),                  Y_e = h W2_e^T + b2_e
//   gated   h = act(X_e W1_e^T + b1_e) * (X_e W3_e^T),   Y_e = h W2_e^T + b2_e   (SwiGLU form)
// Weights use PyTorch's Linear layout stacked over experts:
//   fc1_weight [G, H, M], fc1_bias [G, H], fc2_weight [G, M, H], fc2_bias [G, M],
//   fc3_weight [G, H, M] (gated only). Biases are optional (undefined = none).
// The work is split into tasks of up to 1024 rows of one group (variable-sized groups in dropless
// mode, the filled part of each expert's capacity in capacity mode), spread over `threads`. A
// forward task runs fc1 (fc3) -> bias + activation -> fc2 + fc2 bias on its rows, so the [rows, H]
// block is read back from cache rather than in separate passes over the whole hidden tensor; a
// backward task runs dh = dY W2 -> the activation's backward (and fc1 bias partial sums) -> dX.
// The biases and activations are the GEMMs' epilogues (kernels::TileEpilogue): on the packed
// kernel they run row block by row block while those rows are in cache.
// The weight gradients, which reduce over a group's rows, are one grouped GEMM over the experts
// after that. Each product goes through moe::ExpertGroupedGemm's choice of kernel. Padding rows
// are neither read nor computed; their outputs and gradients are zero. Results do not depend on
// the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/moe/plan.h"

namespace switchyard::moe {

struct ExpertWeights {
  Tensor fc1_weight;  // [G, H, M]
  Tensor fc1_bias;    // [G, H] or undefined
  Tensor fc2_weight;  // [G, M, H]
  Tensor fc2_bias;    // [G, M] or undefined
  Tensor fc3_weight;  // [G, H, M] (gated) or undefined
};

struct ExpertOptions {
  kernels::Activation activation = kernels::Activation::kGelu;
  bool gated = false;
};

// Rows [begin[g], begin[g] + rows[g]) of the buffer belong to expert g.
struct ExpertGroups {
  std::vector<int64_t> begin;
  std::vector<int64_t> rows;
  int64_t total_rows() const;
};

// The groups of a plan: expert e's kept rows (capacity mode: the filled slots only).
ExpertGroups GroupsOf(const DispatchPlan& plan);
// G groups of `capacity` rows each, padding included (what a receiver without counts computes).
ExpertGroups FullCapacityGroups(int64_t num_groups, int64_t capacity);

// What the backward needs; filled by ExpertsForward. The [*, H] intermediates hold the groups'
// rows only, back to back in group order (groups.total_rows() rows), so capacity padding costs
// no memory there.
// The activation is not evaluated again in the backward: the forward keeps the derivatives of
// h = act(a1) (* a3 gated) with a1 = X W1^T + b1, a3 = X W3^T, in the buffers a1 and a3 were
// computed in (no extra memory).
struct ExpertActivations {
  Tensor input;   // [rows, M] the forward input (shared, not copied)
  Tensor dh_da1;  // [used, H] dh / da1 = act'(a1) (* a3 gated)
  Tensor dh_da3;  // [used, H] dh / da3 = act(a1) (gated) or undefined
  Tensor hidden;  // [used, H] h
  ExpertGroups groups;
};

// input [rows, M] float32 -> output [rows, M] float32. `saved` may be null (inference).
Tensor ExpertsForward(const ExpertOptions& options, const ExpertWeights& weights,
                      const Tensor& input, const ExpertGroups& groups, ExpertActivations* saved,
                      int threads = 1);

struct ExpertGradients {
  Tensor input;           // [rows, M] float32
  ExpertWeights weights;  // same shapes as the weights (undefined where the weight is)
};
// d_output [rows, M] float32.
ExpertGradients ExpertsBackward(const ExpertOptions& options, const ExpertWeights& weights,
                                const ExpertActivations& saved, const Tensor& d_output,
                                int threads = 1);

// Checks the weights against G, M, H and the options; throws InvalidArgument naming `prefix` +
// the tensor (e.g. "experts.fc1.weight: expected shape [8, 2048, 512], got [8, 512, 2048]").
void CheckExpertWeights(std::string_view prefix, const ExpertWeights& weights, int64_t groups,
                        int64_t model_dim, int64_t hidden_dim, const ExpertOptions& options,
                        bool bias);

// Useful FLOPs of the expert GEMMs for `rows` token rows (forward only; x3 for forward+backward).
double ExpertFlops(int64_t rows, int64_t model_dim, int64_t hidden_dim, bool gated);

}  // namespace switchyard::moe
