#include "switchyard/moe/router_stats.h"

#include <algorithm>
#include <cmath>

#include "switchyard/core/error.h"

namespace switchyard::moe {

void RouterSums::Add(const LayerOutput& out, int64_t tokens) {
  if (loads.empty()) loads.assign(out.expert_loads.size(), 0.0);
  SY_REQUIRE(loads.size() == out.expert_loads.size(), InvalidArgument,
             "RouterSums::Add: {} experts, then a call with {}", loads.size(),
             out.expert_loads.size());
  for (size_t e = 0; e < loads.size(); ++e) loads[e] += static_cast<double>(out.expert_loads[e]);
  num_tokens += static_cast<double>(tokens);
  dropped += static_cast<double>(out.dropped);
  entropy += out.entropy_sum;
  l_aux += out.l_aux;
  z_loss += out.z_loss;
  calls += 1;
}

std::vector<double> RouterSums::ToVector() const {
  std::vector<double> v{num_tokens, dropped, entropy, l_aux, z_loss, calls};
  v.insert(v.end(), loads.begin(), loads.end());
  return v;
}

RouterSums RouterSums::FromVector(std::span<const double> values) {
  SY_REQUIRE(values.size() >= 6, InvalidArgument,
             "RouterSums::FromVector: expected at least 6 values, got {}", values.size());
  RouterSums s;
  s.num_tokens = values[0];
  s.dropped = values[1];
  s.entropy = values[2];
  s.l_aux = values[3];
  s.z_loss = values[4];
  s.calls = values[5];
  s.loads.assign(values.begin() + 6, values.end());
  return s;
}

RouterStats RouterSums::Stats(const Tensor& expert_bias) const {
  RouterStats st;
  st.num_tokens = static_cast<int64_t>(std::llround(num_tokens));
  double routed = 0;
  for (double l : loads) routed += l;
  st.routed = static_cast<int64_t>(std::llround(routed));
  if (!loads.empty()) {
    const auto [lo, hi] = std::minmax_element(loads.begin(), loads.end());
    st.min_load = static_cast<int64_t>(std::llround(*lo));
    st.max_load = static_cast<int64_t>(std::llround(*hi));
    const double mean = routed / static_cast<double>(loads.size());
    if (mean > 0) {
      double var = 0;
      for (double l : loads) var += (l - mean) * (l - mean);
      var /= static_cast<double>(loads.size());
      st.max_over_mean = *hi / mean;
      st.cv = std::sqrt(var) / mean;
    }
  }
  st.dropped_share = routed > 0 ? dropped / routed : 0.0;
  st.entropy = num_tokens > 0 ? entropy / num_tokens : 0.0;
  st.l_aux = calls > 0 ? l_aux / calls : 0.0;
  st.z_loss = calls > 0 ? z_loss / calls : 0.0;
  if (expert_bias.defined() && expert_bias.numel() > 0) {
    const float* b = expert_bias.data<float>();
    const auto [lo, hi] = std::minmax_element(b, b + expert_bias.numel());
    st.bias_min = *lo;
    st.bias_max = *hi;
  }
  return st;
}

double RouterEntropySum(const LayerConfig& config, const GateResult& g) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  if (t_num == 0) return 0.0;
  const float* sc = g.scores.data<float>();
  const bool sigmoid = config.score_function == ScoreFunction::kSigmoid;
  double total = 0;
  for (int64_t t = 0; t < t_num; ++t) {
    const float* s = sc + t * e_num;
    double sum = 1.0;
    if (sigmoid) {
      sum = 0;
      for (int64_t e = 0; e < e_num; ++e) sum += s[e];
    }
    double h = 0;
    for (int64_t e = 0; e < e_num; ++e) {
      const double p = static_cast<double>(s[e]) / sum;
      if (p > 0) h -= p * std::log(p);
    }
    total += h;
  }
  return total;
}

}  // namespace switchyard::moe
