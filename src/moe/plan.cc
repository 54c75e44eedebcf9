#include "switchyard/moe/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/rng.h"

namespace switchyard::moe {
namespace {

// The largest capacity: every row index of the [E, C, M] expert buffer must fit in int32.
constexpr int64_t kMaxCapacity = std::numeric_limits<int32_t>::max();

int64_t RoundUp(int64_t v, int64_t multiple) {
  SY_REQUIRE(v <= kMaxCapacity - (multiple - 1), InvalidArgument,
             "capacity {} rounded up to a multiple of alignment {} exceeds the largest capacity {}",
             v, multiple, kMaxCapacity);
  return (v + multiple - 1) / multiple * multiple;
}

// A capacity formula's value, computed in double: `value` must be a finite number in
// [0, kMaxCapacity] (a capacity_factor of 1e30 would otherwise convert to an arbitrary integer,
// in practice 0 or INT64_MIN, and silently drop every token).
int64_t CheckedCapacity(double value, const LayerConfig& c, std::string_view formula) {
  return CheckedToInt64(
      value,
      fmt::format("capacity from capacity_factor {:g} ({} formula {})", c.capacity_factor,
                  CapacityFormulaName(c.capacity_formula), formula),
      0, kMaxCapacity);
}

// Tutel's formula for cf > 0: k * floor(cf * ceil(T / E)).
double TutelCapacity(double cf, int64_t k, int64_t t_num, int64_t e_num) {
  int64_t spe = (t_num + e_num - 1) / e_num;
  return static_cast<double>(k) * std::floor(cf * static_cast<double>(spe));
}

// DeepSpeed's: ceil(T / E * (cf * k)), the product evaluated in float32 as torch does it (an
// overflow of float32 gives infinity, which the caller rejects).
double DeepSpeedCapacity(double cf, int64_t k, int64_t t_num, int64_t e_num) {
  auto ratio = static_cast<float>(static_cast<double>(t_num) / static_cast<double>(e_num));
  auto factor = static_cast<float>(cf * static_cast<double>(k));
  return static_cast<double>(std::ceil(ratio * factor));
}

// The local tokens in ascending global index (ties: local order). Empty `index`: the local order.
// A micro-batch's tokens are a permutation of a contiguous range of indices: placed directly,
// O(T); anything else is sorted.
std::vector<int32_t> GlobalOrder(std::span<const int64_t> index, int64_t t_num) {
  std::vector<int32_t> order(static_cast<size_t>(t_num));
  if (!index.empty()) {
    const auto [lo, hi] = std::minmax_element(index.begin(), index.end());
    if (*hi - *lo == t_num - 1) {
      std::fill(order.begin(), order.end(), -1);
      bool permutation = true;
      for (int64_t t = 0; t < t_num && permutation; ++t) {
        int32_t& at = order[static_cast<size_t>(index[static_cast<size_t>(t)] - *lo)];
        permutation = at < 0;
        at = static_cast<int32_t>(t);
      }
      if (permutation) return order;
    }
  }
  std::iota(order.begin(), order.end(), 0);
  if (!index.empty()) {
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return index[static_cast<size_t>(a)] < index[static_cast<size_t>(b)];
    });
  }
  return order;
}

}  // namespace

int64_t ComputeCapacity(const LayerConfig& c, int64_t num_tokens, int64_t max_load) {
  SY_REQUIRE(num_tokens >= 0 && max_load >= 0, InvalidArgument,
             "ComputeCapacity: num_tokens {} and max_load {} must be >= 0", num_tokens, max_load);
  int64_t cap;
  if (c.capacity) {
    cap = *c.capacity;
  } else {
    const int64_t k = EffectiveTopK(c), e_num = c.num_experts;
    const double cf = c.capacity_factor;
    const bool deepspeed = c.capacity_formula == CapacityFormula::kDeepSpeed;
    auto formula = [&](double f) {
      return deepspeed ? DeepSpeedCapacity(f, k, num_tokens, e_num)
                       : TutelCapacity(f, k, num_tokens, e_num);
    };
    const char* text = deepspeed ? "ceil(T / E * cf * k)" : "k * floor(cf * ceil(T / E))";
    if (cf > 0) {
      cap = CheckedCapacity(formula(cf), c, text);
    } else if (cf == 0) {
      cap = max_load;
    } else {
      // A cap on the largest load: a cap above it (however large) leaves the largest load.
      const double bound = formula(-cf);
      cap = bound >= static_cast<double>(max_load) ? max_load : CheckedCapacity(bound, c, text);
    }
    cap = std::max(cap, c.min_capacity);
  }
  return RoundUp(cap, c.alignment);
}

namespace {

// Bytes of `rows` expert-buffer rows: input and output rows of M floats, two hidden rows of H
// (three when gated), and the plan's row_tokens / row_pairs (int32 each).
void RequireRowsMemory(const LayerConfig& c, int64_t rows, const std::string& what) {
  const int64_t per_row =
      CheckedMul(2 * c.model_dim + (c.gated ? 3 : 2) * c.hidden_dim, 4, "bytes per expert row") + 8;
  const int64_t bytes = CheckedMul(rows, per_row, "expert buffer bytes");
  RequireMemory(static_cast<uint64_t>(bytes), what);
}

}  // namespace

void RequireExpertBufferMemory(const LayerConfig& c, int64_t num_experts, int64_t capacity) {
  const int64_t rows = CheckedMul(num_experts, capacity, "num_experts x capacity");
  SY_REQUIRE(rows < std::numeric_limits<int32_t>::max(), InvalidArgument,
             "num_experts * capacity = {} x {} exceeds the int32 index range", num_experts,
             capacity);
  RequireRowsMemory(c, rows,
                    fmt::format("the expert buffer (num_experts {} x capacity {} rows of model_dim "
                                "{} and hidden_dim {})",
                                num_experts, capacity, c.model_dim, c.hidden_dim));
}

DispatchPlan MakeDispatchPlan(const LayerConfig& c, const GateResult& gate,
                              const PlanOptions& options) {
  const int64_t t_num = gate.num_tokens, e_num = gate.num_experts, k = gate.top_k;
  const size_t tk = static_cast<size_t>(t_num * k);
  SY_CHECK(gate.experts.size() == tk && gate.routed.size() == tk && gate.gates.size() == tk);
  SY_REQUIRE(t_num * k < std::numeric_limits<int32_t>::max(), InvalidArgument,
             "num_tokens * top_k = {} exceeds the int32 index range", t_num * k);
  DispatchPlan p;
  p.num_tokens = t_num;
  p.num_experts = e_num;
  p.top_k = k;
  p.dropless = c.dropless;

  // 1. Token order: global token index, or descending priority (batch-prioritized routing; ties
  //    keep the lower global index first).
  CheckTokenIndex(options.token_index, t_num);
  std::vector<int32_t> order = GlobalOrder(options.token_index, t_num);
  if (c.batch_prioritized_routing) {
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return gate.priority[static_cast<size_t>(a)] > gate.priority[static_cast<size_t>(b)];
    });
  }

  // 2. Slots before drops: a running count per expert, choice-major or token-major.
  std::vector<int64_t> running(static_cast<size_t>(e_num), 0);
  std::vector<int32_t> slot(tk, -1);
  auto place = [&](int32_t t, int64_t j) {
    size_t i = static_cast<size_t>(t * k + j);
    if (!gate.routed[i]) return;
    auto e = static_cast<size_t>(gate.experts[i]);
    slot[i] = static_cast<int32_t>(running[e]++);
  };
  if (c.slot_order == SlotOrder::kChoiceMajor) {
    for (int64_t j = 0; j < k; ++j) {
      for (int32_t t : order) place(t, j);
    }
  } else {
    for (int32_t t : order) {
      for (int64_t j = 0; j < k; ++j) place(t, j);
    }
  }
  p.loads = running;
  int64_t max_load = 0;
  for (int64_t l : p.loads) max_load = std::max(max_load, l);

  // 3. Pairs of each expert in slot order (a counting sort by expert).
  std::vector<int64_t> load_begin(static_cast<size_t>(e_num) + 1, 0);
  for (int64_t e = 0; e < e_num; ++e) {
    load_begin[static_cast<size_t>(e) + 1] =
        load_begin[static_cast<size_t>(e)] + p.loads[static_cast<size_t>(e)];
  }
  std::vector<int32_t> by_expert(static_cast<size_t>(load_begin.back()));
  for (size_t i = 0; i < tk; ++i) {
    if (slot[i] < 0) continue;
    by_expert[static_cast<size_t>(load_begin[static_cast<size_t>(gate.experts[i])] + slot[i])] =
        static_cast<int32_t>(i);
  }

  // 4. Capacity and drops.
  if (c.dropless) {
    p.capacity = max_load;
    RequireRowsMemory(c, load_begin.back(),
                      fmt::format("the dropless expert buffer ({} routed rows of model_dim {} and "
                                  "hidden_dim {})",
                                  load_begin.back(), c.model_dim, c.hidden_dim));
  } else {
    p.capacity = ComputeCapacity(c, t_num, options.global_max_load.value_or(max_load));
  }
  if (!c.dropless) RequireExpertBufferMemory(c, e_num, p.capacity);
  std::vector<uint8_t> keep(tk, 0);
  const uint64_t key = StepSeed(c.seed, options.step);
  CounterRng drop_rng(key, kStreamDropPriority);
  std::vector<int32_t> ranked;
  for (int64_t e = 0; e < e_num; ++e) {
    int32_t* pairs = by_expert.data() + load_begin[static_cast<size_t>(e)];
    int64_t load = p.loads[static_cast<size_t>(e)];
    if (c.dropless || load <= p.capacity || c.drop_policy == DropPolicy::kPosition) {
      int64_t n = c.dropless ? load : std::min(load, p.capacity);
      for (int64_t s = 0; s < n; ++s) keep[static_cast<size_t>(pairs[s])] = 1;
      continue;
    }
    // probs: highest score first; random: highest random priority (per global token) first.
    // Ties keep slot order. `ranked` holds positions within the expert's slot order.
    ranked.resize(static_cast<size_t>(load));
    std::iota(ranked.begin(), ranked.end(), 0);
    std::vector<float> prio(static_cast<size_t>(load));
    for (int64_t s = 0; s < load; ++s) {
      auto i = static_cast<size_t>(pairs[s]);
      if (c.drop_policy == DropPolicy::kProbs) {
        prio[static_cast<size_t>(s)] = gate.choice_scores[i];
      } else {
        auto t = static_cast<int64_t>(i) / k;
        prio[static_cast<size_t>(s)] = drop_rng.Uniform(static_cast<uint64_t>(
            GlobalTokenIndex(options.token_index, options.global_token_offset, t)));
      }
    }
    std::stable_sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {
      return prio[static_cast<size_t>(a)] > prio[static_cast<size_t>(b)];
    });
    for (int64_t r = 0; r < p.capacity; ++r) {
      keep[static_cast<size_t>(pairs[ranked[static_cast<size_t>(r)]])] = 1;
    }
  }

  // 5. Final slots (survivors compacted in slot order), rows and the inverse maps.
  p.counts.assign(static_cast<size_t>(e_num), 0);
  p.offsets.assign(static_cast<size_t>(e_num) + 1, 0);
  p.slots.assign(tk, -1);
  p.rows.assign(tk, -1);
  for (int64_t e = 0; e < e_num; ++e) {
    const int32_t* pairs = by_expert.data() + load_begin[static_cast<size_t>(e)];
    int64_t n = 0;
    for (int64_t s = 0; s < p.loads[static_cast<size_t>(e)]; ++s) {
      auto i = static_cast<size_t>(pairs[s]);
      if (keep[i]) p.slots[i] = static_cast<int32_t>(n++);
    }
    p.counts[static_cast<size_t>(e)] = n;
    p.dropped += p.loads[static_cast<size_t>(e)] - n;
    p.offsets[static_cast<size_t>(e) + 1] =
        p.offsets[static_cast<size_t>(e)] + (c.dropless ? n : p.capacity);
  }
  p.num_rows = p.offsets.back();
  p.row_tokens.assign(static_cast<size_t>(p.num_rows), -1);
  p.row_pairs.assign(static_cast<size_t>(p.num_rows), -1);
  for (size_t i = 0; i < tk; ++i) {
    if (p.slots[i] < 0) continue;
    int64_t row = p.offsets[static_cast<size_t>(gate.experts[i])] + p.slots[i];
    p.rows[i] = static_cast<int32_t>(row);
    p.row_tokens[static_cast<size_t>(row)] = static_cast<int32_t>(static_cast<int64_t>(i) / k);
    p.row_pairs[static_cast<size_t>(row)] = static_cast<int32_t>(i);
  }

  // 6. Combine weights.
  p.weights.assign(tk, 0.0f);
  const bool renorm = c.renormalize_after_drop && k > 1;
  for (int64_t t = 0; t < t_num; ++t) {
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      size_t i = static_cast<size_t>(t * k + j);
      if (p.rows[i] >= 0) sum += gate.gates[i];
    }
    float denom = renorm ? std::max(sum, kGateEps) : 1.0f;
    for (int64_t j = 0; j < k; ++j) {
      size_t i = static_cast<size_t>(t * k + j);
      if (p.rows[i] >= 0) p.weights[i] = gate.gates[i] / denom;
    }
  }
  return p;
}

std::vector<float> CombineWeightsBackward(const LayerConfig& c, const GateResult& gate,
                                          const DispatchPlan& plan,
                                          std::span<const float> d_weights) {
  const int64_t t_num = plan.num_tokens, k = plan.top_k;
  SY_CHECK(static_cast<int64_t>(d_weights.size()) == t_num * k);
  std::vector<float> dg(d_weights.size(), 0.0f);
  const bool renorm = c.renormalize_after_drop && k > 1;
  for (int64_t t = 0; t < t_num; ++t) {
    float sum = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) {
      size_t i = static_cast<size_t>(t * k + j);
      if (plan.rows[i] < 0) continue;
      sum += gate.gates[i];
      dot += d_weights[i] * plan.weights[i];
    }
    for (int64_t j = 0; j < k; ++j) {
      size_t i = static_cast<size_t>(t * k + j);
      if (plan.rows[i] < 0) continue;
      if (!renorm) {
        dg[i] = d_weights[i];
      } else if (sum > kGateEps) {
        // w_j = g_j / S over survivors: dg_j = (dw_j - sum_i dw_i w_i) / S.
        dg[i] = (d_weights[i] - dot) / sum;
      } else {
        dg[i] = d_weights[i] / kGateEps;
      }
    }
  }
  return dg;
}

}  // namespace switchyard::moe
