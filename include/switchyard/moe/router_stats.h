// Routing statistics of one MoE layer (docs/observability.md): how evenly the experts are loaded,
// what was dropped, how sure the router is, the balancing losses and the expert-bias range. They
// are built from sums (RouterSums) so that a step's statistics add up its micro-batches and ranks
// exactly: a caller adds RouterSums::ToVector() over them (an all-reduce) and then calls Stats.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/layer.h"

namespace switchyard::moe {

struct RouterStats {
  int64_t num_tokens = 0;    // tokens routed
  int64_t routed = 0;        // (token, choice) pairs routed, before drops
  double max_over_mean = 0;  // max_e load_e / mean_e load_e: 1 is perfect balance (0: no pairs)
  double cv = 0;             // std_e(load) / mean_e(load), population std (0: no pairs)
  int64_t min_load = 0;      // the least-loaded expert's pairs
  int64_t max_load = 0;      // the most-loaded expert's pairs
  double dropped_share = 0;  // pairs dropped for capacity / routed pairs
  double entropy = 0;        // mean over tokens of -sum_e P log P (nats; at most log E)
  double l_aux = 0;          // mean over the calls of l_aux (before its coefficient)
  double z_loss = 0;         // mean over the calls of the z-loss
  double bias_min = 0;       // expert bias range (0 and 0 without expert_bias)
  double bias_max = 0;
};

// What RouterStats is made of, summed over calls (micro-batches) and ranks.
struct RouterSums {
  std::vector<double> loads;  // [E] routed pairs per expert, before drops
  double num_tokens = 0;
  double dropped = 0;
  double entropy = 0;  // sum over tokens of -sum_e P log P
  double l_aux = 0;    // sum over calls
  double z_loss = 0;   // sum over calls
  double calls = 0;    // calls summed (micro-batches x ranks that report them)

  // Adds one call's output (entropy from LayerOutput::entropy_sum: ForwardOptions::entropy).
  void Add(const LayerOutput& out, int64_t num_tokens);
  // [num_tokens, dropped, entropy, l_aux, z_loss, calls, loads...] and back (the same E).
  std::vector<double> ToVector() const;
  static RouterSums FromVector(std::span<const double> values);
  // expert_bias [E] float32, or undefined (no bias).
  RouterStats Stats(const Tensor& expert_bias = {}) const;
};

// Sum over the gate's tokens of the entropy -sum_e P log P of the aux probabilities P (the softmax
// over all E, or the sigmoid scores normalized per token; 0 log 0 = 0).
double RouterEntropySum(const LayerConfig& config, const GateResult& gate);

}  // namespace switchyard::moe
