#include "train/step_sums.h"

#include "switchyard/core/error.h"

namespace switchyard::train::internal {
namespace {

constexpr size_t kRoutingScalars = 9;  // Routing's scalars on the wire

void AddPadded(std::span<const int64_t> from, std::vector<double>& to) {
  if (to.size() < from.size()) to.resize(from.size(), 0.0);
  for (size_t e = 0; e < from.size(); ++e) to[e] += static_cast<double>(from[e]);
}

}  // namespace

void StepSums::Routing::Add(const RoutingStats& call) {
  AddPadded(call.expert_loads, expert_loads);
  AddPadded(call.expert_counts, expert_counts);
  routed += static_cast<double>(call.routed);
  dropped += static_cast<double>(call.dropped);
  num_tokens += static_cast<double>(call.num_tokens);
  entropy += call.entropy_sum;
  l_aux += call.l_aux;
  z_loss += call.z_loss;
  calls += 1;
  bias_min += call.bias_min;
  bias_max += call.bias_max;
}

moe::RouterSums StepSums::Routing::Sums() const {
  moe::RouterSums s;
  s.loads = expert_loads;
  s.num_tokens = num_tokens;
  s.dropped = dropped;
  s.entropy = entropy;
  s.l_aux = l_aux;
  s.z_loss = z_loss;
  s.calls = calls;
  return s;
}

moe::RouterStats StepSums::Routing::Stats() const {
  moe::RouterStats st = Sums().Stats();
  // Every call routed with the same bias: the mean over the calls is that bias's range.
  st.bias_min = calls > 0 ? bias_min / calls : 0.0;
  st.bias_max = calls > 0 ? bias_max / calls : 0.0;
  return st;
}

std::vector<double> StepSums::Pack() const {
  std::vector<double> v = {ce_sum,    tokens,     ffn_loss,  aux_loss,    z_loss,
                           moe_s,     moe_comm_s, nonfinite, rank_time_s, tp_bytes,
                           tp_comm_s, cp_bytes,   cp_comm_s};
  for (const Routing& r : routing) {
    v.insert(v.end(), {r.routed, r.dropped, r.num_tokens, r.entropy, r.l_aux, r.z_loss, r.calls,
                       r.bias_min, r.bias_max});
    v.insert(v.end(), r.expert_loads.begin(), r.expert_loads.end());
  }
  const bool counts = !routing.empty() && !routing.front().expert_counts.empty();
  for (const Routing& r : routing) {
    SY_CHECK(r.expert_counts.size() == (counts ? r.expert_loads.size() : 0),
             "step sums: {} kept counts for {} experts (every block has them, or none)",
             r.expert_counts.size(), r.expert_loads.size());
    v.insert(v.end(), r.expert_counts.begin(), r.expert_counts.end());
  }
  return v;
}

StepSums StepSums::Unpack(std::span<const double> values, std::span<const int64_t> experts) {
  size_t total = 13, counted = 0;
  for (int64_t e : experts) {
    total += kRoutingScalars + static_cast<size_t>(e);
    counted += static_cast<size_t>(e);
  }
  const bool counts = counted > 0 && values.size() == total + counted;
  SY_CHECK(values.size() == total || counts, "step sums: {} values, expected {} or {}",
           values.size(), total, total + counted);
  StepSums s;
  size_t k = 0;
  for (double* field :
       {&s.ce_sum, &s.tokens, &s.ffn_loss, &s.aux_loss, &s.z_loss, &s.moe_s, &s.moe_comm_s,
        &s.nonfinite, &s.rank_time_s, &s.tp_bytes, &s.tp_comm_s, &s.cp_bytes, &s.cp_comm_s}) {
    *field = values[k++];
  }
  for (int64_t e : experts) {
    Routing r;
    for (double* field : {&r.routed, &r.dropped, &r.num_tokens, &r.entropy, &r.l_aux, &r.z_loss,
                          &r.calls, &r.bias_min, &r.bias_max}) {
      *field = values[k++];
    }
    r.expert_loads.assign(values.begin() + static_cast<std::ptrdiff_t>(k),
                          values.begin() + static_cast<std::ptrdiff_t>(k) + e);
    k += static_cast<size_t>(e);
    s.routing.push_back(std::move(r));
  }
  for (size_t b = 0; counts && b < experts.size(); ++b) {
    const auto e = static_cast<std::ptrdiff_t>(experts[b]);
    const auto at = values.begin() + static_cast<std::ptrdiff_t>(k);
    s.routing[b].expert_counts.assign(at, at + e);
    k += static_cast<size_t>(e);
  }
  return s;
}

}  // namespace switchyard::train::internal
