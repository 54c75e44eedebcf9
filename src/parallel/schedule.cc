#include "switchyard/parallel/schedule.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <numeric>

#include "parallel/collectives.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"
#include "switchyard/core/tensor.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/experts.h"

namespace switchyard::parallel {

namespace {

// Median of three timed runs of fn.
template <typename Fn>
double TimeIt(Fn&& fn) {
  double t[3];
  for (double& v : t) {
    const double t0 = NowSeconds();
    fn();
    v = NowSeconds() - t0;
  }
  std::sort(t, t + 3);
  return t[1];
}

}  // namespace

CostModel MeasureCostModel(comm::Communicator& group, const CostModel& model, int64_t model_dim,
                           int64_t hidden_dim, int threads) {
  (void)threads;  // the GEMM runs with the process's BLAS threads, as the experts do
  CostModel out = model;
  const int p = group.size();
  // [latency s, seconds per byte, gemm seconds per flop], the slowest over the group.
  std::vector<float> figures(3, 0.0f);
  if (p > 1 && out.link_gbps <= 0) {
    std::vector<float> small(static_cast<size_t>(p)), small_out(small.size());
    const double t_small =
        TimeIt([&] { group.AllToAll(small.data(), small_out.data(), 1, DType::kFloat32).Wait(); });
    const size_t per_peer = size_t{1} << 18;  // floats: 1 MiB
    std::vector<float> big(per_peer * static_cast<size_t>(p)), big_out(big.size());
    const double t_big = TimeIt(
        [&] { group.AllToAll(big.data(), big_out.data(), per_peer, DType::kFloat32).Wait(); });
    const double bytes = static_cast<double>(per_peer * sizeof(float)) * (p - 1);
    figures[0] = static_cast<float>(t_small / (p - 1));
    figures[1] = static_cast<float>(std::max(1e-12, (t_big - t_small) / bytes));
  }
  if (out.gemm_gflops <= 0) {
    const int64_t rows = 256;
    Tensor a = Tensor::Full({rows, model_dim}, 0.5f),
           w = Tensor::Full({hidden_dim, model_dim}, 0.25f);
    Tensor c = Tensor::Empty({rows, hidden_dim});
    const double t = TimeIt([&] {
      kernels::Gemm(kernels::Trans::kNo, kernels::Trans::kYes, rows, hidden_dim, model_dim, 1.0f,
                    a.data<float>(), model_dim, w.data<float>(), model_dim, 0.0f, c.data<float>(),
                    hidden_dim);
    });
    figures[2] = static_cast<float>(t / (2.0 * rows * hidden_dim * model_dim));
  }
  if (p > 1) {
    comm::AllReduceOptions max;
    max.reduce_op = comm::ReduceOp::kMax;
    group.AllReduce(figures.data(), figures.data(), figures.size(), DType::kFloat32, max).Wait();
  }
  if (out.link_gbps <= 0) {
    out.link_latency_us = figures[0] * 1e6;
    out.link_gbps = figures[1] > 0 ? 1e-9 / figures[1] : 1e3;
  }
  if (out.gemm_gflops <= 0) out.gemm_gflops = figures[2] > 0 ? 1e-9 / figures[2] : 1.0;
  return out;
}

int SmartGroupFromString(std::string_view text) {
  if (text == "auto") return kSmartAuto;
  if (text == "off") return kSmartOff;
  int g = -1;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), g);
  SY_REQUIRE(ec == std::errc() && ptr == text.data() + text.size() && g >= 0, InvalidArgument,
             "smart schedule: expected 'auto', 'off' or a group size >= 1, got '{}'", text);
  return g;
}

double SmartScheduleSeconds(int group_size, int ranks, double bytes, double flops,
                            const CostModel& model) {
  SY_CHECK(group_size >= 1 && ranks % group_size == 0);
  const double n = static_cast<double>(ranks / group_size);
  const double c = bytes / (n * model.link_gbps * 1e9) + (ranks - 1) * model.link_latency_us * 1e-6;
  const double f = flops / (n * model.gemm_gflops * 1e9);
  return 2 * c + f + std::max((n - 1) * f, 2 * (n - 1) * c);
}

int ChooseSmartGroup(int ranks, double bytes, double flops, const CostModel& model) {
  int best = ranks;
  double best_t = SmartScheduleSeconds(ranks, ranks, bytes, flops, model);
  for (int g = ranks - 1; g >= 1; --g) {
    if (ranks % g != 0) continue;
    const double t = SmartScheduleSeconds(g, ranks, bytes, flops, model);
    if (t < best_t) best = g, best_t = t;
  }
  return best;
}

ShadowOptions ShadowFromString(std::string_view text) {
  ShadowOptions o;
  if (text == "none" || text.empty()) return o;
  if (text == "auto") {
    o.policy = ShadowPolicy::kAuto;
    return o;
  }
  o.policy = ShadowPolicy::kList;
  while (!text.empty()) {
    size_t comma = text.find(',');
    std::string_view item = text.substr(0, comma);
    int64_t e = -1;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), e);
    SY_REQUIRE(ec == std::errc() && ptr == item.data() + item.size() && e >= 0, InvalidArgument,
               "shadow: expected 'none', 'auto' or expert indices like '0,3', got '{}'", item);
    o.experts.push_back(e);
    text.remove_prefix(comma == std::string_view::npos ? text.size() : comma + 1);
  }
  return o;
}

std::string ShadowToString(const ShadowOptions& shadow) {
  if (shadow.policy == ShadowPolicy::kNone) return "none";
  if (shadow.policy == ShadowPolicy::kAuto) return "auto";
  return fmt::format("{}", fmt::join(shadow.experts, ","));
}

double ShadowStepSeconds(const ShadowProblem& pr, const std::vector<char>& shadowed,
                         const CostModel& model) {
  const int p_num = pr.ranks;
  const int64_t e_num = pr.num_experts, el = e_num / p_num;
  const double row_flops = 3.0 * moe::ExpertFlops(1, pr.model_dim, pr.hidden_dim, pr.gated);
  const double row_bytes = 4.0 * static_cast<double>(pr.model_dim);
  const double params = static_cast<double>(pr.hidden_dim * pr.model_dim) * (pr.gated ? 3 : 2) +
                        (pr.bias ? static_cast<double>(pr.hidden_dim + pr.model_dim) : 0.0);
  auto count = [&](int p, int64_t e) {
    return static_cast<double>(pr.counts[static_cast<size_t>(p * e_num + e)]);
  };
  double worst = 0;
  int shadows = 0;
  for (int64_t e = 0; e < e_num; ++e) shadows += shadowed[static_cast<size_t>(e)] ? 1 : 0;
  for (int p = 0; p < p_num; ++p) {
    double rows = 0, moved = 0;
    for (int64_t e = 0; e < e_num; ++e) {
      const bool owned = e / el == p;
      if (shadowed[static_cast<size_t>(e)]) {
        rows += count(p, e);
        continue;
      }
      if (owned) {
        for (int q = 0; q < p_num; ++q) {
          rows += count(q, e);
          if (q != p) moved += count(q, e);  // outputs returned
        }
      } else {
        moved += count(p, e);  // rows sent
      }
    }
    const double t = rows * row_flops / (model.gemm_gflops * 1e9) +
                     2.0 * moved * row_bytes / (model.link_gbps * 1e9);
    worst = std::max(worst, t);
  }
  // Broadcast of the parameters and reduction of their gradients, each about the parameter bytes
  // on the critical path, plus two messages' latency.
  const double per_shadow =
      2.0 * (4.0 * params / (model.link_gbps * 1e9) + model.link_latency_us * 1e-6);
  return worst + shadows * per_shadow;
}

std::vector<int64_t> ChooseShadowExperts(const ShadowProblem& pr, const CostModel& model) {
  const int64_t e_num = pr.num_experts;
  SY_CHECK(pr.ranks >= 1 && e_num % pr.ranks == 0);
  SY_CHECK(static_cast<int64_t>(pr.counts.size()) == pr.ranks * e_num);
  std::vector<double> load(static_cast<size_t>(e_num), 0);
  for (int p = 0; p < pr.ranks; ++p) {
    for (int64_t e = 0; e < e_num; ++e) {
      load[static_cast<size_t>(e)] +=
          static_cast<double>(pr.counts[static_cast<size_t>(p * e_num + e)]);
    }
  }
  std::vector<int64_t> order(static_cast<size_t>(e_num));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return load[static_cast<size_t>(a)] > load[static_cast<size_t>(b)];
  });
  // The cheapest prefix of the experts in decreasing load (a prefix, not single steps: with two
  // hot experts on different ranks, shadowing either alone moves the bottleneck to the other).
  std::vector<char> set(static_cast<size_t>(e_num), 0);
  double best = ShadowStepSeconds(pr, set, model);
  size_t best_len = 0;
  for (size_t j = 0; j < order.size(); ++j) {
    if (load[static_cast<size_t>(order[j])] <= 0) break;
    set[static_cast<size_t>(order[j])] = 1;
    const double t = ShadowStepSeconds(pr, set, model);
    if (t < best) best = t, best_len = j + 1;
  }
  std::fill(set.begin(), set.end(), 0);
  for (size_t j = 0; j < best_len; ++j) set[static_cast<size_t>(order[j])] = 1;
  std::vector<int64_t> chosen;
  for (int64_t e = 0; e < e_num; ++e) {
    if (set[static_cast<size_t>(e)]) chosen.push_back(e);
  }
  return chosen;
}

}  // namespace switchyard::parallel
