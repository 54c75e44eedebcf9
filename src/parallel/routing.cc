#include "parallel/routing.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <tuple>

#include "parallel/collectives.h"
#include "switchyard/core/error.h"

namespace switchyard::parallel::internal {

PairDecisions PerRankDecisions(const moe::LayerConfig& config, const moe::GateResult& gate,
                               const moe::PlanOptions& options) {
  moe::DispatchPlan plan = moe::MakeDispatchPlan(config, gate, options);
  PairDecisions d;
  d.num_tokens = plan.num_tokens;
  d.num_experts = plan.num_experts;
  d.top_k = plan.top_k;
  d.experts = gate.experts;
  d.order = plan.slots;
  d.locations = plan.slots;
  d.weights = plan.weights;
  d.loads = plan.loads;
  d.capacity = plan.capacity;
  int64_t max_count = 0;
  for (int64_t c : plan.counts) max_count = std::max(max_count, c);
  d.local_capacity = config.dropless ? max_count : plan.capacity;
  return d;
}

namespace {

// Words of one token's record in the routing all-gather: per choice (expert, routed, gate,
// score), then the token's priority; floats travel as their bits.
int64_t RecordWords(int64_t k) { return 4 * k + 1; }

}  // namespace

PairDecisions GlobalDecisions(const moe::LayerConfig& config, const moe::GateResult& gate,
                              int64_t offset, uint64_t step, comm::Communicator& tokens,
                              CommStats* stats) {
  const int64_t t_num = gate.num_tokens, e_num = gate.num_experts, k = gate.top_k;
  const int p_num = tokens.size();
  // 1. Token counts and offsets of every rank.
  std::vector<int64_t> mine{t_num, offset};
  std::vector<int64_t> sizes = AllGather(tokens, mine, Traffic::kRouting, stats);
  int64_t t_max = 0, t_global = 0, start = 0;
  for (int p = 0; p < p_num; ++p) {
    t_max = std::max(t_max, sizes[2 * static_cast<size_t>(p)]);
    if (p < tokens.rank()) start += sizes[2 * static_cast<size_t>(p)];
    t_global += sizes[2 * static_cast<size_t>(p)];
  }
  if (config.drop_policy == moe::DropPolicy::kRandom && !config.dropless) {
    for (int p = 0; p + 1 < p_num; ++p) {
      int64_t end = sizes[2 * static_cast<size_t>(p)] + sizes[2 * static_cast<size_t>(p) + 1];
      SY_REQUIRE(end == sizes[2 * static_cast<size_t>(p) + 3], InvalidArgument,
                 "global batch scope with drop_policy random: the ranks' tokens must be "
                 "contiguous in global index (rank {} ends at {}, rank {} starts at {})",
                 p, end, p + 1, sizes[2 * static_cast<size_t>(p) + 3]);
    }
  }
  // 2. Every rank's gate decisions.
  const int64_t words = RecordWords(k);
  Tensor own = Tensor::Zeros({std::max<int64_t>(t_max, 0), words}, DType::kInt32);
  int32_t* op = own.data<int32_t>();
  for (int64_t t = 0; t < t_num; ++t) {
    int32_t* rec = op + t * words;
    for (int64_t j = 0; j < k; ++j) {
      auto i = static_cast<size_t>(t * k + j);
      rec[4 * j] = gate.experts[i];
      rec[4 * j + 1] = gate.routed[i];
      rec[4 * j + 2] = std::bit_cast<int32_t>(gate.gates[i]);
      rec[4 * j + 3] = std::bit_cast<int32_t>(gate.choice_scores[i]);
    }
    rec[4 * k] = std::bit_cast<int32_t>(gate.priority[static_cast<size_t>(t)]);
  }
  Tensor all = AllGather(tokens, own, Traffic::kRouting, stats);
  const int32_t* ap = all.data<int32_t>();

  moe::GateResult g;
  g.num_tokens = t_global;
  g.num_experts = e_num;
  g.top_k = k;
  const auto tk = static_cast<size_t>(t_global * k);
  g.experts.resize(tk);
  g.routed.resize(tk);
  g.gates.resize(tk);
  g.choice_scores.resize(tk);
  g.priority.resize(static_cast<size_t>(t_global));
  int64_t gt = 0;
  for (int p = 0; p < p_num; ++p) {
    for (int64_t t = 0; t < sizes[2 * static_cast<size_t>(p)]; ++t, ++gt) {
      const int32_t* rec = ap + (p * t_max + t) * words;
      for (int64_t j = 0; j < k; ++j) {
        auto i = static_cast<size_t>(gt * k + j);
        g.experts[i] = rec[4 * j];
        g.routed[i] = static_cast<uint8_t>(rec[4 * j + 1]);
        g.gates[i] = std::bit_cast<float>(rec[4 * j + 2]);
        g.choice_scores[i] = std::bit_cast<float>(rec[4 * j + 3]);
      }
      g.priority[static_cast<size_t>(gt)] = std::bit_cast<float>(rec[4 * k]);
    }
  }
  // 3. The whole batch's plan, and this rank's part of it.
  moe::PlanOptions po;
  po.global_token_offset = sizes[1];
  po.step = step;
  moe::DispatchPlan plan = moe::MakeDispatchPlan(config, g, po);

  PairDecisions d;
  d.num_tokens = t_num;
  d.num_experts = e_num;
  d.top_k = k;
  d.experts = gate.experts;
  d.capacity = plan.capacity;
  const size_t lo = static_cast<size_t>(start * k), n = static_cast<size_t>(t_num * k);
  d.locations.assign(plan.slots.begin() + static_cast<std::ptrdiff_t>(lo),
                     plan.slots.begin() + static_cast<std::ptrdiff_t>(lo + n));
  d.weights.assign(plan.weights.begin() + static_cast<std::ptrdiff_t>(lo),
                   plan.weights.begin() + static_cast<std::ptrdiff_t>(lo + n));
  d.loads.assign(static_cast<size_t>(e_num), 0);
  // Kept pairs of each expert, ordered by their global slot.
  std::vector<std::tuple<int32_t, int32_t, int32_t>> kept;  // (expert, slot, pair)
  for (size_t i = 0; i < n; ++i) {
    if (gate.routed[i]) ++d.loads[static_cast<size_t>(gate.experts[i])];
    if (d.locations[i] >= 0)
      kept.emplace_back(gate.experts[i], d.locations[i], static_cast<int32_t>(i));
  }
  std::sort(kept.begin(), kept.end());
  d.order.assign(n, -1);
  int32_t prev = -1, next = 0;
  for (auto [e, slot, i] : kept) {
    if (e != prev) next = 0, prev = e;
    d.order[static_cast<size_t>(i)] = next++;
    d.local_capacity = std::max<int64_t>(d.local_capacity, next);
  }
  return d;
}

moe::DispatchPlan LayoutPlan(const PairDecisions& d, int64_t stride) {
  const int64_t t_num = d.num_tokens, e_num = d.num_experts, k = d.top_k;
  const auto tk = static_cast<size_t>(t_num * k);
  moe::DispatchPlan p;
  p.num_tokens = t_num;
  p.num_experts = e_num;
  p.top_k = k;
  p.dropless = stride == 0;
  p.capacity = d.capacity;
  p.loads = d.loads;
  p.counts.assign(static_cast<size_t>(e_num), 0);
  for (size_t i = 0; i < tk; ++i) {
    if (d.order[i] >= 0) ++p.counts[static_cast<size_t>(d.experts[i])];
  }
  p.offsets.assign(static_cast<size_t>(e_num) + 1, 0);
  for (int64_t e = 0; e < e_num; ++e) {
    const int64_t c = p.counts[static_cast<size_t>(e)];
    SY_CHECK(stride == 0 || c <= stride, "expert {} keeps {} rows, more than the stride {}", e, c,
             stride);
    p.offsets[static_cast<size_t>(e) + 1] =
        p.offsets[static_cast<size_t>(e)] + (stride ? stride : c);
  }
  p.num_rows = p.offsets.back();
  int64_t routed = 0, kept = 0;
  for (int64_t l : p.loads) routed += l;
  for (int64_t c : p.counts) kept += c;
  p.dropped = routed - kept;
  p.slots.assign(tk, -1);
  p.rows.assign(tk, -1);
  p.row_tokens.assign(static_cast<size_t>(p.num_rows), -1);
  p.row_pairs.assign(static_cast<size_t>(p.num_rows), -1);
  p.weights.assign(tk, 0.0f);
  for (size_t i = 0; i < tk; ++i) {
    if (d.order[i] < 0) continue;
    const int64_t row = p.offsets[static_cast<size_t>(d.experts[i])] + d.order[i];
    p.slots[i] = d.order[i];
    p.rows[i] = static_cast<int32_t>(row);
    p.row_tokens[static_cast<size_t>(row)] = static_cast<int32_t>(static_cast<int64_t>(i) / k);
    p.row_pairs[static_cast<size_t>(row)] = static_cast<int32_t>(i);
    p.weights[i] = d.weights[i];
  }
  return p;
}

}  // namespace switchyard::parallel::internal
