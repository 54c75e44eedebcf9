// `switchyard report RUN` (docs/observability.md): the routing of a finished or running training
// run, from its metrics.jsonl (the expert loads of every MoE layer per logged step) or from a
// router trace (--trace DIR: the recorded routes of every recorded step). Writes two pictures,
// expert_load.svg (a heatmap per MoE layer: tokens per expert over the steps) and imbalance.svg
// (per layer, the most-loaded expert over the mean over the steps), and prints per layer the
// imbalance of the last and of the worst step, then the worst layer and step.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cli/command.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/router_stats.h"
#include "switchyard/train/metrics.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/svg.h"

namespace switchyard::cli {
namespace {

struct ReportOptions {
  std::string run;    // run directory (metrics.jsonl)
  std::string trace;  // router trace directory
  std::string out;    // where the pictures go ("": <run or trace>/report)
};

moe::RouterStats StatsOf(const std::vector<double>& loads) {
  moe::RouterSums s;
  s.loads = loads;
  return s.Stats();
}

// Loads per MoE layer over the steps: loads[layer][step][expert] (routed pairs), and the
// statistics of each: stats[layer][step] (a run's logged "router" statistics; for a trace, or a
// run written before they were logged, those of the loads alone).
struct LoadHistory {
  std::vector<std::string> layers;
  std::vector<double> steps;
  std::vector<std::vector<std::vector<double>>> loads;
  std::vector<std::vector<moe::RouterStats>> stats;
  bool logged_stats = false;  // every step's stats are logged ones (entropy, drops, bias)

  // Fills `stats` from the loads where the source had none.
  void CountMissingStats() {
    stats.resize(loads.size());
    for (size_t l = 0; l < loads.size(); ++l) {
      for (size_t t = stats[l].size(); t < loads[l].size(); ++t) {
        stats[l].push_back(StatsOf(loads[l][t]));
      }
    }
  }
};

LoadHistory FromRun(const std::string& run) {
  const std::string path = (std::filesystem::path(run) / "metrics.jsonl").string();
  SY_REQUIRE(std::filesystem::is_regular_file(path), InvalidArgument,
             "report: {} has no metrics.jsonl: expected a run directory of `switchyard train`",
             run);
  LoadHistory h;
  for (const train::StepMetrics& m : train::ReadMetrics(path)) {
    if (m.expert_load.empty()) continue;
    if (h.layers.empty()) {
      for (size_t l = 0; l < m.expert_load.size(); ++l) {
        h.layers.push_back(fmt::format("MoE layer {}", l));
      }
      h.loads.resize(m.expert_load.size());
      h.stats.resize(m.expert_load.size());
      h.logged_stats = true;
    }
    SY_REQUIRE(m.expert_load.size() == h.layers.size(), InvalidArgument,
               "report: {} step {} has loads of {} MoE layers, earlier steps of {}", path, m.step,
               m.expert_load.size(), h.layers.size());
    h.steps.push_back(static_cast<double>(m.step));
    // Lines written before the statistics were logged (a resumed older run) have loads only.
    const bool logged = m.router.size() == m.expert_load.size();
    h.logged_stats = h.logged_stats && logged;
    for (size_t l = 0; l < m.expert_load.size(); ++l) {
      h.loads[l].emplace_back(m.expert_load[l].begin(), m.expert_load[l].end());
      h.stats[l].push_back(logged ? m.router[l] : StatsOf(h.loads[l].back()));
    }
  }
  SY_REQUIRE(!h.steps.empty(), InvalidArgument,
             "report: {} holds no expert loads (a dense model, or no step logged yet)", path);
  return h;
}

// The trace's steps in order; per step and layer, each token counted once (tensor-parallel ranks
// record the same tokens). The experts of a layer are 0 .. the largest id recorded.
LoadHistory FromTrace(const std::string& dir) {
  std::vector<std::filesystem::path> steps;
  SY_REQUIRE(std::filesystem::is_directory(dir), InvalidArgument,
             "report: --trace {} is not a directory", dir);
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_directory() && e.path().filename().string().starts_with("step_")) {
      steps.push_back(e.path());
    }
  }
  std::sort(steps.begin(), steps.end());
  SY_REQUIRE(!steps.empty(), InvalidArgument,
             "report: --trace {} holds no step_* directory of a router trace", dir);
  std::map<std::string, size_t> layer_of;
  LoadHistory h;
  std::vector<std::map<std::string, std::vector<double>>> per_step;
  for (const auto& step_dir : steps) {
    std::map<std::string, std::set<int64_t>> seen;
    std::map<std::string, std::vector<double>> counts;
    for (const auto& f : std::filesystem::directory_iterator(step_dir)) {
      if (f.path().extension() != ".safetensors") continue;
      const TensorMap t = ReadSafetensors(f.path().string());
      for (const auto& [name, stored] : t) {
        if (!name.ends_with("experts")) continue;
        const Tensor experts = train::TraceExpertIdsAsInt32(stored);
        if (!experts.defined()) continue;
        const std::string prefix = name.substr(0, name.size() - 7);
        auto tok = t.find(prefix + "tokens");
        SY_REQUIRE(tok != t.end() && tok->second.dtype() == DType::kInt64 &&
                       tok->second.numel() == experts.size(0),
                   InvalidArgument, "report: {}: {} without matching {}tokens", f.path().string(),
                   name, prefix);
        std::vector<double>& c = counts[prefix];
        std::set<int64_t>& s = seen[prefix];
        const int64_t k = experts.size(1);
        for (int64_t i = 0; i < experts.size(0); ++i) {
          if (!s.insert(tok->second.data<int64_t>()[i]).second) continue;
          for (int64_t j = 0; j < k; ++j) {
            const auto e = static_cast<size_t>(experts.data<int32_t>()[i * k + j]);
            if (c.size() <= e) c.resize(e + 1, 0.0);
            c[e] += 1;
          }
        }
        if (!layer_of.contains(prefix)) layer_of.emplace(prefix, layer_of.size());
      }
    }
    h.steps.push_back(std::stod(step_dir.filename().string().substr(5)));
    per_step.push_back(std::move(counts));
  }
  h.layers.resize(layer_of.size());
  for (const auto& [prefix, l] : layer_of) h.layers[l] = prefix;
  h.loads.resize(layer_of.size());
  for (const auto& [prefix, l] : layer_of) {
    size_t experts = 0;
    for (const auto& s : per_step) {
      if (auto it = s.find(prefix); it != s.end()) experts = std::max(experts, it->second.size());
    }
    for (const auto& s : per_step) {
      std::vector<double> c(experts, 0.0);
      if (auto it = s.find(prefix); it != s.end())
        std::copy(it->second.begin(), it->second.end(), c.begin());
      h.loads[l].push_back(std::move(c));
    }
  }
  return h;
}

int RunReport(const ReportOptions& o) {
  SY_REQUIRE(!o.run.empty() || !o.trace.empty(), InvalidArgument,
             "report: give a run directory (RUN) or a router trace (--trace DIR)");
  LoadHistory h = o.trace.empty() ? FromRun(o.run) : FromTrace(o.trace);
  h.CountMissingStats();
  const std::string out =
      o.out.empty() ? (std::filesystem::path(o.trace.empty() ? o.run : o.trace) / "report").string()
                    : o.out;
  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  SY_REQUIRE(!ec, IoError, "report: cannot create {}: {}", out, ec.message());
  std::vector<train::HeatmapPanel> panels;
  std::vector<train::PlotSeries> curves;
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  double worst = 0, worst_step = 0;
  std::string worst_layer;
  fmt::print("{:<24} {:>8} {:>10} {:>8} {:>14} {:>10}{}\n", "layer", "steps", "max/mean", "cv",
             "worst max/mean", "at step",
             h.logged_stats
                 ? fmt::format(" {:>9} {:>9} {:>19}", "dropped", "entropy", "expert bias")
                 : "");
  for (size_t l = 0; l < h.layers.size(); ++l) {
    train::HeatmapPanel p{h.layers[l], {}};
    train::PlotSeries s{h.layers[l], colors[l % 6], h.steps, {}};
    const size_t experts = h.loads[l].empty() ? 0 : h.loads[l][0].size();
    p.values.assign(experts, std::vector<double>(h.steps.size(), 0.0));
    double layer_worst = 0, layer_worst_step = 0;
    for (size_t t = 0; t < h.steps.size(); ++t) {
      for (size_t e = 0; e < experts; ++e) p.values[e][t] = h.loads[l][t][e];
      const moe::RouterStats& st = h.stats[l][t];
      s.y.push_back(st.max_over_mean);
      if (st.max_over_mean > layer_worst)
        layer_worst = st.max_over_mean, layer_worst_step = h.steps[t];
    }
    const moe::RouterStats& last = h.stats[l].back();
    fmt::print("{:<24} {:>8} {:>10.3f} {:>8.3f} {:>14.3f} {:>10}{}\n", h.layers[l], h.steps.size(),
               last.max_over_mean, last.cv, layer_worst, layer_worst_step,
               h.logged_stats
                   ? fmt::format(" {:>8.2f}% {:>9.3f} {:>9.4f}..{:.4f}", 100 * last.dropped_share,
                                 last.entropy, last.bias_min, last.bias_max)
                   : "");
    if (layer_worst > worst)
      worst = layer_worst, worst_step = layer_worst_step, worst_layer = h.layers[l];
    panels.push_back(std::move(p));
    curves.push_back(std::move(s));
  }
  const std::string source = o.trace.empty() ? o.run : o.trace;
  train::HeatmapOptions ho;
  ho.title = fmt::format("expert load (routed pairs) of {}", source);
  WriteTextFileAtomic((std::filesystem::path(out) / "expert_load.svg").string(),
                      train::HeatmapSvg(panels, h.steps, ho));
  train::LinePlotOptions lo;
  lo.title = fmt::format("imbalance of {}: most-loaded expert / mean", source);
  lo.y_label = "max / mean";
  lo.reference_lines.push_back({"balanced", 1.0, "#888"});
  WriteTextFileAtomic((std::filesystem::path(out) / "imbalance.svg").string(),
                      train::LinePlotSvg(curves, lo));
  fmt::print("worst: {} at step {}: max/mean {:.3f}\nwrote {}/expert_load.svg, {}/imbalance.svg\n",
             worst_layer, worst_step, worst, out, out);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "report", "Draw the expert load and imbalance of a training run or a router trace",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<ReportOptions>();
      app.add_option("RUN", o->run, "run directory of `switchyard train` (metrics.jsonl)")
          ->type_name("DIR");
      app.add_option("--trace", o->trace, "a router trace directory (train --router-trace)")
          ->type_name("DIR");
      app.add_option("--out", o->out, "directory for the pictures (default: <source>/report)")
          ->type_name("DIR");
      return [o] { return RunReport(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
