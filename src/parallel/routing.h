// Routing of one rank's tokens in the parallel layer: from the gate's choices to a DispatchPlan
// whose expert buffer has the layout the dispatcher sends. Private to src/parallel.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/comm_stats.h"

namespace switchyard::parallel::internal {

// Which (token, choice) pairs of this rank are kept, where, and with what combine weight.
struct PairDecisions {
  int64_t num_tokens = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  std::vector<int32_t> experts;    // [T, k] chosen expert
  std::vector<int32_t> order;      // [T, k] kept: position among the expert's kept pairs in
                                   // slot order (any increasing key); -1: dropped / not routed
  std::vector<int32_t> locations;  // [T, k] reported slot (-1 dropped): the plan's slots
  std::vector<float> weights;      // [T, k] combine weights (0 where dropped)
  std::vector<int64_t> loads;      // [E] routed pairs of this rank, before drops
  int64_t capacity = 0;            // reported capacity
  int64_t local_capacity = 0;      // rows per expert this rank's plan needs (capacity mode:
                                   // its C; dropless / global scope: its largest count)
};

// Per-rank routing: the single-rank plan of this rank's tokens (moe::MakeDispatchPlan).
PairDecisions PerRankDecisions(const moe::LayerConfig& config, const moe::GateResult& gate,
                               const moe::PlanOptions& options);

// Routing over a group of ranks whose tokens make one batch (the token group in the global
// scope; the context-parallel group in the per-rank scope): the gate decisions of every rank of
// `group` are all-gathered and the single-rank plan of the whole batch is computed on every rank;
// this rank's part of it is returned. The batch's tokens are visited in global order, so the
// result does not depend on how the ranks hold them. Collective over `group`.
//   local  this rank's global token indices (token_index, or global_token_offset + t), the step,
//          and for capacity_factor <= 0 an optional largest load (unset: the batch's)
PairDecisions GlobalDecisions(const moe::LayerConfig& config, const moe::GateResult& gate,
                              const moe::PlanOptions& local, comm::Communicator& group,
                              CommStats* stats);

// The plan of this rank's kept pairs with expert e owning rows [e * stride, e * stride + stride)
// (stride > 0: fixed capacity, padding after the kept rows) or packed (stride == 0). The plan's
// slots are the positions within the expert (from decisions.order).
moe::DispatchPlan LayoutPlan(const PairDecisions& decisions, int64_t stride);

}  // namespace switchyard::parallel::internal
