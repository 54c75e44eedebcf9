// Hugging Face's load-balancing loss (`load_balancing_loss_func` of the Mixtral, Qwen2-MoE and
// OLMoE modeling code), which differs from the per-layer losses of losses.h in two ways: the
// router logits of ALL MoE layers are concatenated into one [N = sum of the layers' tokens, E]
// batch before one loss is computed (not a per-layer loss averaged), and the fraction counts every
// one of the k choices:
//   P = softmax(logits) over all E,  c_e = (# of (row, choice) pairs choosing e) / N,
//   p_e = sum_rows P[row, e] / N,    l = E * sum_e c_e * p_e
// (the top k are taken of P; equal values go to the lower expert). Uniform routing gives l = k.
// The model adds router_aux_loss_coef * l to its cross-entropy. The gradient flows through p_e
// only (c_e counts discrete choices), as in PyTorch.
//
// Every quantity is a per-expert sum over rows, so a batch split over ranks or pipeline stages
// accumulates RouterLoadSums per layer and per rank, adds them (ToVector / an all-reduce), and
// then has the loss of the concatenation and each layer's share of its gradient.
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "switchyard/core/tensor.h"

namespace switchyard::moe {

struct RouterLoadSums {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  double num_rows = 0;          // N
  std::vector<double> probs;    // [E] sum over rows of P[row, e]
  std::vector<double> choices;  // [E] (row, choice) pairs that chose e

  RouterLoadSums() = default;
  RouterLoadSums(int64_t experts, int64_t k);

  // Adds another part of the concatenation (another layer, another rank's rows). InvalidArgument
  // unless E and k agree.
  void Add(const RouterLoadSums& other);
  // [num_rows, probs..., choices...] (2E + 1 values), for an all-reduce.
  std::vector<double> ToVector() const;
  // Inverse of ToVector; InvalidArgument on a size mismatch.
  static RouterLoadSums FromVector(int64_t num_experts, int64_t top_k,
                                   std::span<const double> values);
};

// One layer's (or one rank's) router logits [rows, E] float32 -> its sums; top_k in [1, E]
// (InvalidArgument naming it otherwise).
RouterLoadSums ComputeRouterLoadSums(const Tensor& logits, int64_t top_k);

// l = E * sum_e (choices_e / N) * (probs_e / N); 0 when N = 0.
double RouterLoadLoss(const RouterLoadSums& sums);

// The loss of the concatenated logits of several layers (what Hugging Face returns as aux_loss).
double RouterLoadLoss(std::span<const Tensor> layer_logits, int64_t top_k);

// Adds coef * d l / d logits into d_logits [rows, E] for one part of the concatenation, whose
// logits are `logits`; `total` is the sums of the whole concatenation.
void RouterLoadLossBackward(const Tensor& logits, const RouterLoadSums& total, float coef,
                            const Tensor& d_logits);

}  // namespace switchyard::moe
