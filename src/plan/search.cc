#include "switchyard/plan/search.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string>

#include "plan/config_view.h"
#include "plan/predict.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/train/distributed.h"

namespace switchyard::plan {

namespace {

std::vector<int64_t> Divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i) {
    if (n % i == 0) out.push_back(i);
  }
  return out;
}

std::string Dashed(const std::string& key) {
  std::string flag = key;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

// The keys of one pipeline choice: schedule and virtual stages.
std::vector<LayoutFlags> PipelineChoices(int64_t pp, int64_t layers) {
  if (pp == 1) return {{}};
  std::vector<LayoutFlags> out = {{{"pipeline_schedule", "1f1b"}},
                                  {{"pipeline_schedule", "zb-h1"}}};
  if (2 * pp <= layers) {
    out.push_back({{"pipeline_schedule", "interleaved"}, {"virtual_stages", "2"}});
  }
  return out;
}

// The MoE exchange: dispatcher and Tutel's overlap degree (only where tokens are exchanged).
std::vector<LayoutFlags> DispatchChoices(bool exchanges, bool split_experts) {
  if (!exchanges) return {{}};
  std::vector<LayoutFlags> out = {{{"dispatch", "alltoall"}},
                                  {{"dispatch", "alltoall"}, {"overlap_degree", "2"}},
                                  {{"dispatch", "alltoall"}, {"overlap_degree", "4"}},
                                  {{"dispatch", "alltoallv"}},
                                  {{"dispatch", "allgather"}}};
  if (split_experts) out.push_back({{"dispatch", "alltoall"}, {"adaptive_r", "auto"}});
  return out;
}

// `config` with the flags set as `switchyard train` sets them (SetTrainConfigValue's reading of
// the text), in one pass over the config.
train::TrainConfig WithFlags(const train::TrainConfig& config, const LayoutFlags& flags) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, text] : flags) {
    try {
      j[key] = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception&) {
      j[key] = text;
    }
  }
  return train::TrainConfigFromJson(j.dump(), config);
}

LayoutFlags Concat(LayoutFlags a, const LayoutFlags& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

std::string FlagsText(const LayoutFlags& flags) {
  std::string out;
  for (const auto& [key, value] : flags) {
    out += fmt::format("{}--{} {}", out.empty() ? "" : " ", Dashed(key), value);
  }
  return out;
}

namespace {

// The value `fixed` holds for `key`, or nullptr.
const std::string* FixedValue(const LayoutFlags& fixed, std::string_view key) {
  for (const auto& [k, v] : fixed) {
    if (k == key) return &v;
  }
  return nullptr;
}

// The divisors of n, or only the fixed value of `key` (none when it does not divide n).
std::vector<int64_t> Degrees(int64_t n, const LayoutFlags& fixed, std::string_view key) {
  std::vector<int64_t> out = Divisors(n);
  if (const std::string* v = FixedValue(fixed, key)) {
    std::erase_if(out, [&](int64_t x) { return std::to_string(x) != *v; });
  }
  return out;
}

// `f` with the fixed keys' values: replaced where `f` sets the key, appended where it does not.
LayoutFlags WithFixed(LayoutFlags f, const LayoutFlags& fixed) {
  for (const auto& [key, value] : fixed) {
    auto it = std::find_if(f.begin(), f.end(), [&](const auto& kv) { return kv.first == key; });
    if (it != f.end()) {
      it->second = value;
    } else {
      f.emplace_back(key, value);
    }
  }
  return f;
}

}  // namespace

std::vector<LayoutFlags> EnumerateLayouts(const train::TrainConfig& base, int64_t ranks,
                                          const LayoutFlags& fixed) {
  const internal::ModelView m = internal::ReadModel(base);
  const bool moe = m.moe_blocks > 0;
  std::vector<LayoutFlags> out;
  std::set<std::string> seen;  // with fixed keys, candidates that became equal
  auto add = [&](LayoutFlags f) {
    if (fixed.empty()) {
      out.push_back(std::move(f));
      return;
    }
    f = WithFixed(std::move(f), fixed);
    LayoutFlags sorted = f;  // the same keys set in another order are the same layout
    std::sort(sorted.begin(), sorted.end());
    if (seen.insert(FlagsText(sorted)).second) out.push_back(std::move(f));
  };
  for (int64_t tp : Degrees(ranks, fixed, "tp")) {
    // Sequence parallelism (and its overlapped rings) only with tp > 1.
    std::vector<LayoutFlags> tp_choices = {{{"tp", std::to_string(tp)}}};
    if (tp > 1) {
      tp_choices.push_back({{"tp", std::to_string(tp)}, {"sequence_parallel", "true"}});
      tp_choices.push_back(
          {{"tp", std::to_string(tp)}, {"sequence_parallel", "true"}, {"tp_comm_overlap", "true"}});
    }
    for (int64_t cp : Degrees(ranks / tp, fixed, "cp")) {
      std::vector<LayoutFlags> cp_choices = {{{"cp", std::to_string(cp)}}};
      if (cp > 1) cp_choices.push_back({{"cp", std::to_string(cp)}, {"cp_algo", "ulysses"}});
      for (int64_t pp : Degrees(ranks / (tp * cp), fixed, "pp")) {
        const int64_t dp = ranks / (tp * cp * pp);
        std::vector<int64_t> eps = {1};
        if (moe) eps = Degrees(ranks / pp, fixed, "ep");
        for (int64_t ep : eps) {
          const bool exchanges = moe && ep > 1;
          for (const LayoutFlags& t : tp_choices) {
            for (const LayoutFlags& cpf : cp_choices) {
              for (const LayoutFlags& pipe : PipelineChoices(pp, m.num_layers)) {
                for (const LayoutFlags& disp : DispatchChoices(exchanges, ep > m.num_experts)) {
                  for (int64_t mb = 1; mb <= 16; mb *= 2) {
                    // train: stages would run in turn (unless the micro-batches are fixed)
                    if (pp > 1 && mb < pp && FixedValue(fixed, "microbatches") == nullptr) {
                      continue;
                    }
                    // ZeRO 2 is left out: its gradient sharding is neither in train's memory
                    // estimate nor in the traffic (the same as stage 1 here).
                    for (int64_t zero :
                         dp* cp > 1 ? std::vector<int64_t>{0, 1, 3} : std::vector<int64_t>{0}) {
                      for (const char* rc : {"none", "selective", "full"}) {
                        if (cp > 1 && std::string_view(rc) == "selective") continue;
                        LayoutFlags f = {{"ranks", std::to_string(ranks)}};
                        f = Concat(f, t);
                        f = Concat(f, cpf);
                        f.push_back({"pp", std::to_string(pp)});
                        f = Concat(f, pipe);
                        if (moe) f.push_back({"ep", std::to_string(ep)});
                        f = Concat(f, disp);
                        f.push_back({"zero_stage", std::to_string(zero)});
                        f.push_back({"microbatches", std::to_string(mb)});
                        f.push_back({"recompute", rc});
                        add(std::move(f));
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

namespace {

// `base` resolved with `config` (= WithFlags(base.config, flags)), the flags' keys explicit.
train::ResolvedTrainConfig Resolved(const train::ResolvedTrainConfig& base,
                                    train::TrainConfig config, const LayoutFlags& flags) {
  train::ResolvedTrainConfig r{.config = std::move(config),
                               .explicit_keys = base.explicit_keys,
                               .out_given = base.out_given};
  for (const auto& [key, value] : flags) r.explicit_keys[key] = "--" + Dashed(key);
  return r;
}

}  // namespace

train::ResolvedTrainConfig ApplyLayout(const train::ResolvedTrainConfig& base,
                                       const LayoutFlags& flags) {
  return Resolved(base, WithFlags(base.config, flags), flags);
}

void CheckLayout(const train::ResolvedTrainConfig& resolved, const train::TrainRunContext& run) {
  (void)train::ValidateTrainConfig(resolved, run);
  const train::TrainConfig& c = resolved.config;
  const parallel::ParallelOptions options =
      train::TrainParallelOptions(c, static_cast<int>(c.ranks));
  if (train::NumMoeBlocks(c.model) > 0) {
    // The MoE blocks' mesh as the run builds it (its ep / dp / cp divisibility by arrangement).
    moe::LayerConfig layer;
    layer.num_experts = c.num_experts;
    layer.hidden_dim = c.expert_hidden_dim > 0 ? c.expert_hidden_dim : c.model.hidden_dim;
    (void)parallel::LayerMesh(layer, options, static_cast<int>(c.ranks));
  }
  const internal::LayoutView l = internal::ReadLayout(c);
  train::ValidateBatchSplit(c, l.dp, l.tp, l.sequence_parallel);
}

PlanResult PlanLayouts(const train::ResolvedTrainConfig& base, const Cluster& cluster,
                       const SearchOptions& options) {
  const int64_t ranks = options.ranks > 0 ? options.ranks : cluster.devices();
  SY_REQUIRE(ranks <= cluster.devices(), InvalidArgument,
             "plan: {} ranks requested but the cluster '{}' has {} devices ({} nodes x {} per "
             "node)",
             ranks, cluster.name, cluster.devices(), cluster.nodes, cluster.devices_per_node);
  PlanResult result;
  result.memory_limit_bytes = options.memory_limit_bytes > 0
                                  ? options.memory_limit_bytes
                                  : cluster.memory_gib * 1024.0 * 1024.0 * 1024.0;
  std::vector<Layout> candidates;
  // The model and the base layout read once; each candidate's layout from its flags.
  const internal::ModelView model = internal::ReadModel(base.config);
  const internal::LayoutView base_layout = internal::ReadLayout(base.config);
  if (!options.fixed.empty()) {
    // A fixed value train cannot read is an error naming it, not a search that finds nothing.
    for (const auto& [key, value] : options.fixed) {
      const bool searched = key == "microbatches" || key == "recompute";  // not layout keys
      SY_REQUIRE((train::IsLayoutKey(key) || searched) && key != "ranks", InvalidArgument,
                 "plan: --fix {}={}: '{}' is not a layout key the planner chooses (tp, cp, pp, "
                 "ep, zero_stage, microbatches, recompute, dispatch, ...)",
                 key, value, key);
    }
    (void)WithFlags(base.config, options.fixed);
  }
  std::vector<LayoutFlags> all = EnumerateLayouts(base.config, ranks, options.fixed);
  const auto total = static_cast<int64_t>(all.size());
  for (LayoutFlags& flags : all) {
    ++result.enumerated;
    if (options.progress && result.enumerated % 2000 == 0) {
      options.progress(result.enumerated, total);
    }
    Layout layout;
    try {
      train::TrainConfig config = WithFlags(base.config, flags);
      layout.prediction = internal::PredictStepOf(
          config, model, internal::LayoutWithFlags(base_layout, flags, config), cluster);
      layout.config = std::move(config);
    } catch (const InvalidArgument&) {
      ++result.rejected;  // sizes train would refuse as well (checked below when they rank)
      continue;
    }
    layout.flags = std::move(flags);
    candidates.push_back(std::move(layout));
  }
  // Fastest first; ties by memory, then by the flags' text (a stable, total order).
  auto faster = [](const Layout& a, const Layout& b) {
    if (a.prediction.step_s != b.prediction.step_s)
      return a.prediction.step_s < b.prediction.step_s;
    if (a.prediction.memory.total() != b.prediction.memory.total()) {
      return a.prediction.memory.total() < b.prediction.memory.total();
    }
    return FlagsText(a.flags) < FlagsText(b.flags);
  };
  std::sort(candidates.begin(), candidates.end(), faster);
  auto valid = [&](const Layout& layout) {
    try {
      CheckLayout(Resolved(base, layout.config, layout.flags), options.run);
      return true;
    } catch (const InvalidArgument&) {
      ++result.rejected;
      return false;
    }
  };
  for (const Layout& layout : candidates) {
    if (static_cast<int64_t>(result.layouts.size()) >= options.top) break;
    if (static_cast<double>(layout.prediction.memory.total()) > result.memory_limit_bytes) {
      ++result.over_memory;
      continue;
    }
    if (valid(layout)) result.layouts.push_back(layout);
  }
  if (result.layouts.empty()) {
    std::stable_sort(candidates.begin(), candidates.end(), [](const Layout& a, const Layout& b) {
      return a.prediction.memory.total() < b.prediction.memory.total();
    });
    for (const Layout& layout : candidates) {
      if (valid(layout)) {
        result.smallest_over_limit.push_back(layout);
        break;
      }
    }
  }
  return result;
}

std::string WhyFirstWins(const Layout& first, const Layout& second) {
  const StepPrediction& a = first.prediction;
  const StepPrediction& b = second.prediction;
  struct Part {
    const char* name;
    double delta;  // second - first, seconds
  };
  std::vector<Part> parts = {
      {"compute", b.compute_s() - a.compute_s()},
      {"tensor-parallel communication", b.tp_exposed_s - a.tp_exposed_s},
      {"context-parallel communication", b.cp_exposed_s - a.cp_exposed_s},
      {"expert all-to-all", b.ep_exposed_s - a.ep_exposed_s},
      {"gradient reduction / ZeRO", b.dp_exposed_s - a.dp_exposed_s},
      {"pipeline transfers", b.pp_exposed_s - a.pp_exposed_s},
      {"pipeline bubble", b.bubble_s - a.bubble_s},
  };
  std::sort(parts.begin(), parts.end(),
            [](const Part& x, const Part& y) { return std::abs(x.delta) > std::abs(y.delta); });
  const std::string text =
      b.step_s > a.step_s
          ? fmt::format("{:.3g} ms faster than the runner-up ({})", 1e3 * (b.step_s - a.step_s),
                        FlagsText(second.flags))
          : fmt::format(
                "predicted as fast as the runner-up ({}), and first by less memory or by "
                "the order of its flags",
                FlagsText(second.flags));
  std::string reasons;
  for (const Part& p : parts) {
    if (std::abs(p.delta) < 1e-3 * std::max(a.step_s, 1e-12) || reasons.size() > 200) continue;
    reasons += fmt::format("{}{} {} {:.3g} ms", reasons.empty() ? "" : ", ", p.name,
                           p.delta > 0 ? "saves" : "costs", 1e3 * std::abs(p.delta));
  }
  return reasons.empty() ? text : text + ": " + reasons;
}

}  // namespace switchyard::plan
