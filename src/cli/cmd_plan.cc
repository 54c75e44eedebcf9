// `switchyard plan`: predicts the step time and memory of every layout `switchyard train` accepts
// for a model on a cluster (a JSON file, or this machine measured now), ranks them and prints the
// best; --validate K runs the first K here and compares (docs/planner.md).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/plan_calibrate.h"
#include "cli/plan_check.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/plan/search.h"

namespace switchyard::cli {
namespace {

using nlohmann::json;

struct PlanOptions {
  std::string cluster = "this";
  std::string config_file;
  int64_t ranks = 0;
  int64_t top = 10;
  double memory_limit_mib = 0;
  bool json = false;
  int64_t validate = 0;
  int64_t validate_steps = 8;
  double link_latency_us = 0;
  double link_gbps = 0;
  std::vector<std::string> fix;               // --fix KEY=VALUE[,KEY=VALUE...]
  std::map<std::string, std::string> values;  // model keys given as flags
};

// --fix's words as layout flags (dashes or underscores; `tp=1,pp=4` or repeated).
plan::LayoutFlags FixedKeys(const std::vector<std::string>& words) {
  plan::LayoutFlags out;
  for (const std::string& word : words) {
    size_t begin = 0;
    while (begin <= word.size()) {
      const size_t end = std::min(word.find(',', begin), word.size());
      const std::string item = word.substr(begin, end - begin);
      const size_t eq = item.find('=');
      SY_REQUIRE(eq != std::string::npos && eq > 0 && eq + 1 < item.size(), InvalidArgument,
                 "plan: --fix '{}': expected KEY=VALUE (e.g. --fix tp=1,pp=4)", item);
      std::string key = item.substr(0, eq);
      std::replace(key.begin(), key.end(), '-', '_');
      out.emplace_back(key, item.substr(eq + 1));
      begin = end + 1;
    }
  }
  return out;
}

std::string ShellWord(const std::string& text) {
  const bool plain = !text.empty() && std::all_of(text.begin(), text.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) ||
           std::string_view("-_.,/:=+").find(ch) != std::string_view::npos;
  });
  if (plain) return text;
  std::string out = "'";
  for (char ch : text) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// The flags `switchyard train` takes to run the layout on the same model: the model keys given
// to plan (those the layout does not set), then the layout's.
std::string TrainFlags(const PlanOptions& o, const plan::Layout& layout) {
  std::string text;
  if (!o.config_file.empty()) text = "--config " + ShellWord(o.config_file);
  for (const auto& [key, value] : o.values) {
    const bool set_by_layout = std::any_of(layout.flags.begin(), layout.flags.end(),
                                           [&](const auto& f) { return f.first == key; });
    if (set_by_layout) continue;
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    text += fmt::format("{}--{} {}", text.empty() ? "" : " ", flag, ShellWord(value));
  }
  const std::string layout_text = plan::FlagsText(layout.flags);
  return text.empty() ? layout_text : text + " " + layout_text;
}

double Ms(double seconds) { return 1e3 * seconds; }
double MiB(double bytes) { return bytes / (1024.0 * 1024.0); }

json LayoutJson(const PlanOptions& o, const plan::Layout& l) {
  const plan::StepPrediction& p = l.prediction;
  return {{"train_flags", TrainFlags(o, l)},
          {"step_ms", Ms(p.step_s)},
          {"memory_mib", MiB(static_cast<double>(p.memory.total()))},
          {"compute_ms", Ms(p.compute_s())},
          {"compute",
           {{"gemm_ms", Ms(p.gemm_s)},
            {"attention_ms", Ms(p.attention_s)},
            {"elementwise_ms", Ms(p.elementwise_s)},
            {"optimizer_ms", Ms(p.optimizer_s)}}},
          {"exposed_comm_ms",
           {{"tp", Ms(p.tp_exposed_s)},
            {"cp", Ms(p.cp_exposed_s)},
            {"ep", Ms(p.ep_exposed_s)},
            {"dp", Ms(p.dp_exposed_s)},
            {"pp", Ms(p.pp_exposed_s)}}},
          {"comm_ms",
           {{"tp", Ms(p.tp_comm_s)},
            {"cp", Ms(p.cp_comm_s)},
            {"ep", Ms(p.ep_comm_s)},
            {"dp", Ms(p.dp_comm_s)},
            {"pp", Ms(p.pp_comm_s)}}},
          {"bubble_ms", Ms(p.bubble_s)},
          {"memory",
           {{"parameters_mib", MiB(static_cast<double>(p.memory.parameter_bytes))},
            {"optimizer_mib", MiB(static_cast<double>(p.memory.optimizer_bytes))},
            {"activations_mib", MiB(static_cast<double>(p.memory.activation_bytes))},
            {"reduction_mib", MiB(static_cast<double>(p.memory.reduction_bytes))},
            {"build_mib", MiB(static_cast<double>(p.memory.build_bytes))}}}};
}

void PrintTable(const PlanOptions& o, const plan::Cluster& cluster, const plan::PlanResult& r) {
  fmt::print("cluster: {} ({} x {} devices){}\n", cluster.name, cluster.nodes,
             cluster.devices_per_node,
             cluster.source.empty() ? "" : fmt::format("\n  {}", cluster.source));
  fmt::print(
      "{} layouts enumerated, {} refused by train's validation, {} over the memory limit "
      "{:.0f} MiB\n",
      r.enumerated, r.rejected, r.over_memory, MiB(r.memory_limit_bytes));
  fmt::print("{:>3} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}  {}\n", "#", "step ms",
             "compute", "tp", "cp", "ep", "dp", "pp", "bubble", "mem MiB", "layout (train flags)");
  for (size_t i = 0; i < r.layouts.size(); ++i) {
    const plan::StepPrediction& p = r.layouts[i].prediction;
    fmt::print(
        "{:>3} {:>9.2f} {:>9.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} "
        "{:>9.1f}  {}\n",
        i + 1, Ms(p.step_s), Ms(p.compute_s()), Ms(p.tp_exposed_s), Ms(p.cp_exposed_s),
        Ms(p.ep_exposed_s), Ms(p.dp_exposed_s), Ms(p.pp_exposed_s), Ms(p.bubble_s),
        MiB(static_cast<double>(p.memory.total())), plan::FlagsText(r.layouts[i].flags));
  }
  fmt::print("(tp .. pp: exposed communication by kind, after overlap)\n");
  if (r.layouts.size() >= 2) {
    fmt::print("why #1: {}\n", plan::WhyFirstWins(r.layouts[0], r.layouts[1]));
  }
  if (!r.layouts.empty()) {
    fmt::print("run it: switchyard train {}\n", TrainFlags(o, r.layouts[0]));
  }
}

// Runs K of the layouts for a few steps here (ranks as threads, the links --cluster this was
// calibrated with; recalibrated right before each run) and prints predicted against measured
// step time and peak memory.
void Validate(const PlanOptions& o, const plan::PlanResult& r) {
  const CalibrationOptions calibration{.ranks = static_cast<int>(r.layouts.front().config.ranks),
                                       .link_latency_us = o.link_latency_us,
                                       .link_gbps = o.link_gbps};
  fmt::print(
      "\nvalidation: {} steps per layout, ranks as threads{}, this machine recalibrated "
      "before each\n",
      o.validate_steps,
      o.link_latency_us > 0 || o.link_gbps > 0
          ? fmt::format(", emulated links {} us / {} GB/s", o.link_latency_us, o.link_gbps)
          : "");
  PrintCheckHeader();
  std::vector<LayoutCheck> checks;
  const std::vector<int64_t> spread =
      SpreadIndices(static_cast<int64_t>(r.layouts.size()), o.validate);
  for (int64_t i : spread) {
    checks.push_back(
        CheckLayoutHere(r.layouts[static_cast<size_t>(i)], i + 1, o.validate_steps, calibration));
    PrintCheckRow(checks.back());
  }
  if (!checks.empty()) fmt::print("{}\n", SummaryText(Summarize(checks)));
}

int RunPlan(PlanOptions o) {
  if (auto it = o.values.find("ranks"); it != o.values.end()) {
    o.ranks = ParseInt64InRange(it->second, "--ranks", 1, 4096);
    o.values.erase(it);
  }
  train::ResolvedTrainConfig base = train::ResolveTrainConfig({.defaults = PlanDefaultModel(),
                                                               .config_file = o.config_file,
                                                               .flags = o.values,
                                                               .resume = ""});
  for (const auto& [key, source] : base.explicit_keys) {
    SY_REQUIRE(!train::IsLayoutKey(key) || key == "threads", InvalidArgument,
               "plan: '{}' ({}) is a layout key, which the planner chooses: give the model "
               "and batch only (--ranks for the number of ranks; --fix {}=VALUE holds a layout "
               "key at a value)",
               key, source, key);
  }
  const bool here = o.cluster == "this";
  SY_REQUIRE(o.validate == 0 || here, InvalidArgument,
             "plan: --validate runs the layouts on this machine: it needs --cluster this, got "
             "--cluster {}",
             o.cluster);
  plan::Cluster cluster;
  if (here) {
    cluster = CalibrateThisMachine({.ranks = static_cast<int>(o.ranks > 0 ? o.ranks : 4),
                                    .link_latency_us = o.link_latency_us,
                                    .link_gbps = o.link_gbps});
  } else {
    SY_REQUIRE(o.link_latency_us == 0 && o.link_gbps == 0, InvalidArgument,
               "plan: --link-latency-us / --link-gbps describe this machine's emulated links: "
               "they go with --cluster this (a cluster file has its own links)");
    cluster = plan::LoadClusterFile(o.cluster);
  }
  plan::SearchOptions search{.ranks = o.ranks,
                             .top = o.top,
                             .memory_limit_bytes = o.memory_limit_mib * 1024 * 1024,
                             .fixed = FixedKeys(o.fix),
                             .progress = SearchProgress(),
                             .run = {.ranks_are_threads = here}};
  const plan::PlanResult r = plan::PlanLayouts(base, cluster, search);
  if (r.layouts.empty()) {
    SY_REQUIRE(!r.smallest_over_limit.empty(), InvalidArgument,
               "plan: none of the {} layouts of {} ranks is accepted by `switchyard train` for "
               "this model and batch (batch_size {}, seq_len {}): check that the batch splits over "
               "the ranks",
               r.enumerated, search.ranks > 0 ? search.ranks : cluster.devices(),
               base.config.batch_size, base.config.model.seq_len);
    const plan::Layout& l = r.smallest_over_limit.front();
    const double need = static_cast<double>(l.prediction.memory.total());
    throw InvalidArgument(fmt::format(
        "plan: no layout fits the memory limit of {:.0f} MiB per rank: the smallest, {}, needs "
        "{:.0f} MiB ({:.0f} MiB, {:.0f}% over); use more devices, a smaller batch or model",
        MiB(r.memory_limit_bytes), plan::FlagsText(l.flags), MiB(need),
        MiB(need - r.memory_limit_bytes), 100 * (need / r.memory_limit_bytes - 1)));
  }
  if (o.json) {
    json layouts = json::array();
    for (const plan::Layout& l : r.layouts) layouts.push_back(LayoutJson(o, l));
    json out = {{"cluster", json::parse(plan::ClusterToJson(cluster))},
                {"enumerated", r.enumerated},
                {"rejected", r.rejected},
                {"over_memory", r.over_memory},
                {"memory_limit_mib", MiB(r.memory_limit_bytes)},
                {"layouts", layouts}};
    if (r.layouts.size() >= 2) out["why_first"] = plan::WhyFirstWins(r.layouts[0], r.layouts[1]);
    fmt::print("{}\n", out.dump(2));
  } else {
    PrintTable(o, cluster, r);
  }
  if (o.validate > 0) Validate(o, r);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "plan",
    "Predict step time and memory of every parallel layout of a model on a cluster and rank them",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<PlanOptions>();
      app.add_option("--cluster", o->cluster,
                     "cluster JSON file (docs/planner.md), or 'this': this machine, measured now");
      app.add_option("--config", o->config_file, "JSON file of model keys (as train's --config)");
      AddIntOption(app, "--top", &o->top, 1, 1000, "layouts to print, best first");
      app.add_option("--memory-limit-mib", o->memory_limit_mib,
                     "per-rank memory limit (0: the cluster's device memory)")
          ->check(FiniteIn(0, 1e12));
      app.add_flag("--json", o->json, "print the layouts as JSON");
      app.add_option("--fix", o->fix,
                     "KEY=VALUE[,KEY=VALUE]: hold layout keys at these values (e.g. tp=1,pp=4, "
                     "microbatches=64) and search the rest");
      AddIntOption(app, "--validate", &o->validate, 0, 100,
                   "run K of the printed layouts here (--cluster this; evenly spread over "
                   "--top, the first among them) and compare");
      AddIntOption(app, "--validate-steps", &o->validate_steps, 3, 1000,
                   "training steps per validated layout");
      app.add_option("--link-latency-us", o->link_latency_us,
                     "with --cluster this: the emulated link latency train will use")
          ->check(FiniteIn(0, 1e6));
      app.add_option("--link-gbps", o->link_gbps,
                     "with --cluster this: the emulated link bandwidth train will use (GB/s)")
          ->check(FiniteIn(0, 1e6));
      // Model and batch keys as train spells them (--ranks: the ranks to plan for; default every
      // device of the cluster, 4 with 'this'); other layout keys are the planner's to choose.
      AddTrainConfigFlags(
          app, [o](const std::string& key, const std::string& text) { o->values[key] = text; });
      return [o] { return RunPlan(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
