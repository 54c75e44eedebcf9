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
// score), then the token's priority, then (when any rank gives token indices) the token's global
// index as two words; floats travel as their bits.
int64_t RecordWords(int64_t k, bool with_index) { return 4 * k + 1 + (with_index ? 2 : 0); }

// Whether the ranks' token ranges [offset, offset + count) (the all-gathered (count, offset,
// flag) triples) overlap nowhere; empty ranges never overlap.
bool RangesAreDisjoint(const std::vector<int64_t>& sizes, int p_num) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int p = 0; p < p_num; ++p) {
    const int64_t n = sizes[3 * static_cast<size_t>(p)], at = sizes[3 * static_cast<size_t>(p) + 1];
    if (n > 0) ranges.emplace_back(at, at + n);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i - 1].second > ranges[i].first) return false;
  }
  return true;
}

}  // namespace

PairDecisions GlobalDecisions(const moe::LayerConfig& config, const moe::GateResult& gate,
                              const moe::PlanOptions& local, comm::Communicator& group,
                              CommStats* stats) {
  const int64_t t_num = gate.num_tokens, e_num = gate.num_experts, k = gate.top_k;
  const int p_num = group.size();
  moe::CheckTokenIndex(local.token_index, t_num);
  // 1. Token counts, offsets and whether token indices follow, of every rank.
  std::vector<int64_t> mine{t_num, local.global_token_offset, local.token_index.empty() ? 0 : 1};
  std::vector<int64_t> sizes = AllGather(group, mine, Traffic::kRouting, stats);
  auto count = [&](int p) { return sizes[3 * static_cast<size_t>(p)]; };
  auto offset = [&](int p) { return sizes[3 * static_cast<size_t>(p) + 1]; };
  int64_t t_max = 0, t_global = 0, start = 0;
  bool with_index = false, contiguous = true;
  for (int p = 0; p < p_num; ++p) {
    t_max = std::max(t_max, count(p));
    if (p < group.rank()) start += count(p);
    t_global += count(p);
    with_index = with_index || sizes[3 * static_cast<size_t>(p) + 2] != 0;
    if (p > 0) contiguous = contiguous && offset(p - 1) + count(p - 1) == offset(p);
  }
  // Ranges that overlap say nothing about the order (callers that leave every offset at 0, as
  // the Python module does): the ranks' tokens then go in rank order, as offsets that follow
  // each other would put them. Only the random drop policy keys a draw by a token's index across
  // ranks, and with overlapping ranges two tokens would share one.
  const bool disjoint = with_index || contiguous || RangesAreDisjoint(sizes, p_num);
  SY_REQUIRE(disjoint || config.drop_policy != moe::DropPolicy::kRandom || config.dropless,
             InvalidArgument,
             "global batch scope with drop_policy random: the ranks' token ranges overlap (give "
             "each rank its global_token_offset or token_index); rank {} has offset {}",
             group.rank(), local.global_token_offset);
  // 2. Every rank's gate decisions (and global token indices).
  const int64_t words = RecordWords(k, with_index);
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
    if (with_index) {
      const auto g = static_cast<uint64_t>(
          moe::GlobalTokenIndex(local.token_index, local.global_token_offset, t));
      rec[4 * k + 1] = static_cast<int32_t>(static_cast<uint32_t>(g));
      rec[4 * k + 2] = static_cast<int32_t>(static_cast<uint32_t>(g >> 32));
    }
  }
  Tensor all = AllGather(group, own, Traffic::kRouting, stats);
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
  // The batch's global token indices: gathered, or from the ranks' offsets when their ranges do
  // not follow each other; empty when they do (the identity from the first rank's offset).
  std::vector<int64_t> index;
  const bool from_offsets = !with_index && !contiguous && disjoint;
  if (with_index || from_offsets) index.resize(static_cast<size_t>(t_global));
  int64_t gt = 0;
  for (int p = 0; p < p_num; ++p) {
    for (int64_t t = 0; t < count(p); ++t, ++gt) {
      const int32_t* rec = ap + (p * t_max + t) * words;
      for (int64_t j = 0; j < k; ++j) {
        auto i = static_cast<size_t>(gt * k + j);
        g.experts[i] = rec[4 * j];
        g.routed[i] = static_cast<uint8_t>(rec[4 * j + 1]);
        g.gates[i] = std::bit_cast<float>(rec[4 * j + 2]);
        g.choice_scores[i] = std::bit_cast<float>(rec[4 * j + 3]);
      }
      g.priority[static_cast<size_t>(gt)] = std::bit_cast<float>(rec[4 * k]);
      if (with_index) {
        index[static_cast<size_t>(gt)] = static_cast<int64_t>(
            static_cast<uint64_t>(static_cast<uint32_t>(rec[4 * k + 1])) |
            (static_cast<uint64_t>(static_cast<uint32_t>(rec[4 * k + 2])) << 32));
      } else if (from_offsets) {
        index[static_cast<size_t>(gt)] = offset(p) + t;
      }
    }
  }
  // 3. The whole batch's plan, and this rank's part of it.
  moe::PlanOptions po;
  po.global_token_offset = p_num > 0 ? offset(0) : 0;
  po.step = local.step;
  po.global_max_load = local.global_max_load;
  po.token_index = index;
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
