// What one training step reports, summed over the ranks in one all-reduce: the losses and token
// count, the MoE blocks' routing statistics, the time and traffic figures. A named struct in
// place of an array read by index; Pack and Unpack are the one place that knows the wire order.
//
// Thread-safety: a plain value.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace switchyard::train::internal {

struct StepSums {
  // Each MoE block's routing over the step (the ranks that report routing).
  struct Routing {
    double routed = 0;
    double dropped = 0;
    std::vector<double> expert_loads;  // [num_experts of the block]
    // [num_experts of the block] the (token, choice) pairs each expert kept (after capacity
    // drops: the expert bias's counts), or empty in every block (not summed).
    std::vector<double> expert_counts;
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

  // The fields in wire order: the 13 scalars, then per MoE block routed, dropped, loads, then
  // (when the blocks have them) per MoE block the kept counts.
  std::vector<double> Pack() const;
  // The inverse of Pack for blocks with `experts[b]` experts each (the routing's sizes); the
  // kept counts are read when `values` holds them (their length tells).
  static StepSums Unpack(std::span<const double> values, std::span<const int64_t> experts);
};

}  // namespace switchyard::train::internal
