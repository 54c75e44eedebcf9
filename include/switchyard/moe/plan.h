// From routing to a dispatch plan (docs/moe.md, "Slots and capacity"): capacity, slot order, drops,
// combine weights.
//
// The plan is DeepEP's "handle": it says where every (token, choice) goes in the expert buffer and
// is reused by dispatch, combine and every backward step. The expert buffer has `num_rows` rows:
//   capacity mode  [E, C, M] flattened: expert e owns rows [e * C, e * C + C); slot c of expert e
//   is
//                  row e * C + c; rows past the expert's count are zero padding.
//   dropless mode  [sum_e counts_e, M]: tokens sorted by expert, expert e owns rows
//                  [offsets[e], offsets[e + 1]).
// Within an expert, kept pairs occupy slots 0..count-1 in slot order (see docs/moe.md).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"

namespace switchyard::moe {

// Capacity C per docs/moe.md, "Slots and capacity" (explicit capacity > capacity_formula, then
// min_capacity and alignment; the explicit capacity is only rounded up to `alignment`).
//   num_tokens  T on this rank
//   max_load    the largest number of routed (token, choice) pairs of any expert, maximised over
//               the ranks of the EP group; used only when capacity_factor <= 0
int64_t ComputeCapacity(const LayerConfig& config, int64_t num_tokens, int64_t max_load);

// Throws InvalidArgument, before anything is allocated, when the capacity-mode expert buffers of
// one layer step — rows = num_experts * capacity rows of the dispatched input [E, C, M], the
// expert output [E, C, M], the hidden activations [E, C, H] (two or three of them) and the plan's
// per-row indices — do not fit in the memory available (core/limits.h RequireMemory). The
// message names E, C, M, H and the bytes needed, so a layer.json `capacity` of 1e8 is refused up
// front instead of being found by the kernel's OOM killer. Also refuses rows above the int32 index
// range. (MakeDispatchPlan calls it; in dropless mode it checks the routed rows the same way.)
void RequireExpertBufferMemory(const LayerConfig& config, int64_t num_experts, int64_t capacity);

struct PlanOptions {
  int64_t global_token_offset = 0;  // keys the random drop priority
  uint64_t step = 0;                // keys the random drop priority (with config.seed)
  // capacity_factor <= 0: the largest expert load over the EP group. Unset: this rank's largest
  // load (a single rank is its own group). A distributed caller all-reduces the local max.
  std::optional<int64_t> global_max_load;
  // [T] the global index of each token, as GateOptions::token_index (empty: the identity
  // global_token_offset + t). The plan visits the tokens in global order (ascending index), so
  // slots, drops and the random drop priority do not depend on the order of the local rows.
  std::span<const int64_t> token_index = {};
};

struct DispatchPlan {
  int64_t num_tokens = 0;   // T
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // k
  bool dropless = false;
  int64_t capacity = 0;  // C (capacity mode); dropless: the largest count (for reporting)
  int64_t num_rows = 0;  // rows of the expert buffer: E * C, or sum of counts (dropless)
  int64_t dropped = 0;   // routed pairs dropped for capacity

  std::vector<int64_t> loads;       // [E] routed pairs per expert, before drops
  std::vector<int64_t> counts;      // [E] kept pairs per expert (<= C)
  std::vector<int64_t> offsets;     // [E + 1] first row of expert e; offsets[E] = num_rows
  std::vector<int32_t> slots;       // [T, k] slot within the expert, -1 dropped or not routed
  std::vector<int32_t> rows;        // [T, k] row of the expert buffer, -1 dropped or not routed
  std::vector<int32_t> row_tokens;  // [num_rows] token of each row, -1 for padding
  std::vector<int32_t> row_pairs;   // [num_rows] t * k + j of each row, -1 for padding
  std::vector<float> weights;       // [T, k] combine weights (0 where dropped), see below
};

// Assigns slots and drops. Tokens are visited in ascending global index (PlanOptions::token_index),
// so a permutation of the rows (with their indices) permutes the plan and changes nothing else.
// Combine weights: the gate values g_j of surviving choices, renormalized
// over the survivors of each token when renormalize_after_drop (and k > 1); 0 for dropped choices.
DispatchPlan MakeDispatchPlan(const LayerConfig& config, const GateResult& gate,
                              const PlanOptions& options);

// Backward of the combine weights: d_weights [T, k] -> d gates [T, k]. Dropped choices pass none.
std::vector<float> CombineWeightsBackward(const LayerConfig& config, const GateResult& gate,
                                          const DispatchPlan& plan,
                                          std::span<const float> d_weights);

}  // namespace switchyard::moe
