#include "train/step_sums.h"

#include "switchyard/core/error.h"

namespace switchyard::train::internal {

std::vector<double> StepSums::Pack() const {
  std::vector<double> v = {ce_sum,    tokens,     ffn_loss,  aux_loss,    z_loss,
                           moe_s,     moe_comm_s, nonfinite, rank_time_s, tp_bytes,
                           tp_comm_s, cp_bytes,   cp_comm_s};
  for (const Routing& r : routing) {
    v.push_back(r.routed);
    v.push_back(r.dropped);
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
    total += 2 + static_cast<size_t>(e);
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
    r.routed = values[k++];
    r.dropped = values[k++];
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
