// What one training step reports, summed over the ranks in one all-reduce: the losses and token
// count, the MoE blocks' routing statistics, the time and traffic figures. A named struct in
// place of an array read by index; Pack and Unpack are the one place that knows the wire order.
//
// Thread-safety: a plain value.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "switchyard/moe/router_stats.h"
#include "switchyard/train/feed_forward.h"

namespace switchyard::train::internal {

struct StepSums {
  // Each MoE block's routing over the step (the ranks that report routing), summed over its
  // calls (micro-batches x ranks).
  struct Routing {
    double routed = 0;
    double dropped = 0;
    double num_tokens = 0;
    double entropy = 0;                // sum over the tokens of the router entropy
    double l_aux = 0;                  // sum over the calls
    double z_loss = 0;                 // sum over the calls
    double calls = 0;                  // calls summed
    double bias_min = 0;               // sum over the calls of the expert bias's minimum
    double bias_max = 0;               // ... and maximum (each call routes with the same bias)
    std::vector<double> expert_loads;  // [num_experts of the block]
    // [num_experts of the block] the (token, choice) pairs each expert kept (after capacity
    // drops: the expert bias's counts), or empty in every block (not summed).
    std::vector<double> expert_counts;

    // Adds one call (padding the loads to the longer of the two).
    void Add(const RoutingStats& call);
    // The sums as moe::RouterSums, and the block's statistics (docs/observability.md).
    moe::RouterSums Sums() const;
    moe::RouterStats Stats() const;
  };

  double ce_sum = 0;             // cross-entropy x tokens (the ranks that report the loss)
  double tokens = 0;             // counted target tokens
  double ffn_loss = 0;           // the MoE blocks' loss terms, over micro-batches and replicas
  double aux_loss = 0;           // l_aux, likewise
  double z_loss = 0;             // the z-loss, likewise
  double moe_s = 0;              // seconds in the MoE layers (every rank)
  double moe_comm_s = 0;         // of which blocked in their collectives
  double nonfinite = 0;          // non-finite values in the MoE inputs
  double rank_time_s = 0;        // each rank's step time up to the reduction
  double tp_bytes = 0;           // tensor-parallel bytes on the wire
  double tp_comm_s = 0;          // blocked in tensor-parallel collectives
  double cp_bytes = 0;           // context-parallel bytes on the wire
  double cp_comm_s = 0;          // blocked in context-parallel collectives
  std::vector<Routing> routing;  // per MoE block, in block order

  // The fields in wire order: the 13 scalars, then per MoE block its 9 scalars and loads, then
  // (when the blocks have them) per MoE block the kept counts.
  std::vector<double> Pack() const;
  // The inverse of Pack for blocks with `experts[b]` experts each (the routing's sizes); the
  // kept counts are read when `values` holds them (their length tells).
  static StepSums Unpack(std::span<const double> values, std::span<const int64_t> experts);
};

}  // namespace switchyard::train::internal
