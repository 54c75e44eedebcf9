// `switchyard bench plan-check`: the planner's accuracy on this machine (docs/planner.md,
// "Accuracy on this machine"): for 2-3 model sizes and two emulated link speeds, plan the layouts
// of 4 ranks as threads, run layouts spread over the ranking (the planner's first among them)
// with train's own code, and print predicted against measured step time and peak memory per
// rank, the median and worst errors, and the first choice against the fastest measured.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/plan_calibrate.h"
#include "cli/plan_check.h"
#include "switchyard/core/error.h"
#include "switchyard/plan/search.h"

namespace switchyard::cli {
namespace {

struct PlanCheckOptions {
  bool quick = false;
  int64_t steps = 0;     // 0: 6 (--quick: 4)
  int64_t per_case = 0;  // layouts run per model and link; 0: 4 (--quick: 3)
  int64_t top = 60;      // the ranking they are spread over
};

struct ModelCase {
  const char* name;
  std::map<std::string, std::string> flags;  // train keys over PlanDefaultModel()
};

struct LinkCase {
  double latency_us, gbps;
};

struct CaseResult {
  std::string model;
  LinkCase link;
  std::vector<LayoutCheck> checks;
  int refused = 0;  // layouts the planner emitted that train refused when run
};

std::vector<ModelCase> Models(bool quick) {
  std::vector<ModelCase> models = {
      {"small (d 64, seq 32, batch 16)",
       {{"model_dim", "64"}, {"hidden_dim", "256"}, {"seq_len", "32"}, {"batch_size", "16"}}},
      {"default (d 128, seq 64, batch 32)", {}},
  };
  if (!quick) {
    models.push_back({"wide (d 192, 8 experts, seq 64, batch 16)",
                      {{"model_dim", "192"},
                       {"hidden_dim", "768"},
                       {"num_experts", "8"},
                       {"batch_size", "16"}}});
  }
  return models;
}

CaseResult RunCase(const PlanCheckOptions& o, const ModelCase& model, const LinkCase& link) {
  const train::ResolvedTrainConfig base = train::ResolveTrainConfig(
      {.defaults = PlanDefaultModel(), .config_file = "", .flags = model.flags, .resume = ""});
  const CalibrationOptions calibration{
      .ranks = 4, .link_latency_us = link.latency_us, .link_gbps = link.gbps};
  const plan::PlanResult r = plan::PlanLayouts(
      base, CalibrateThisMachine(calibration),
      {.ranks = 4, .top = o.top, .memory_limit_bytes = 0, .run = {.ranks_are_threads = true}});
  fmt::print("\nmodel {}, links {} us / {} GB/s: {} layouts ranked, {} run for {} steps each\n",
             model.name, link.latency_us, link.gbps, r.layouts.size(), o.per_case, o.steps);
  PrintCheckHeader();
  CaseResult result{.model = model.name, .link = link, .checks = {}, .refused = 0};
  for (int64_t i : SpreadIndices(static_cast<int64_t>(r.layouts.size()), o.per_case)) {
    const plan::Layout& layout = r.layouts[static_cast<size_t>(i)];
    try {
      result.checks.push_back(CheckLayoutHere(layout, i + 1, o.steps, calibration));
    } catch (const InvalidArgument& e) {
      // A layout the planner emitted but the run refused: a planner bug, reported and counted.
      fmt::print("{:>3} refused by train: {} ({})\n", i + 1, e.what(),
                 plan::FlagsText(layout.flags));
      ++result.refused;
      continue;
    }
    PrintCheckRow(result.checks.back());
  }
  if (!result.checks.empty()) fmt::print("{}\n", SummaryText(Summarize(result.checks)));
  return result;
}

void PrintTable(const std::vector<CaseResult>& cases) {
  fmt::print(
      "\n| model, link | layouts (refused) | step time: median error | worst | memory: median "
      "error | worst | planner's #1 vs the fastest measured | load average |\n"
      "|---|---|---|---|---|---|---|---|\n");
  std::vector<LayoutCheck> all;
  for (const CaseResult& c : cases) {
    if (c.checks.empty()) continue;
    const CheckSummary s = Summarize(c.checks);
    double lo = 1e30, hi = 0;
    for (const LayoutCheck& k : c.checks) {
      lo = std::min(lo, k.load);
      hi = std::max(hi, k.load);
    }
    // The first check is the planner's #1 unless train refused that one.
    const std::string first = c.checks.front().position == 1
                                  ? fmt::format("{:.0f} % slower", 100 * s.first_vs_best)
                                  : std::string("#1 refused");
    fmt::print(
        "| {}, {} us / {} GB/s | {} ({}) | {:.0f} % | {:.0f} % | {:.0f} % | {:.0f} % | {} | "
        "{:.1f}-{:.1f} |\n",
        c.model, c.link.latency_us, c.link.gbps, c.checks.size(), c.refused, 100 * s.step_median,
        100 * s.step_worst, 100 * s.memory_median, 100 * s.memory_worst, first, lo, hi);
    all.insert(all.end(), c.checks.begin(), c.checks.end());
  }
  if (all.empty()) return;
  const CheckSummary s = Summarize(all);
  fmt::print(
      "all {} layouts: step time median |error| {:.1f}%, worst {:.1f}%; memory median "
      "{:.1f}%, worst {:.1f}% (goal: 10 %, 25 %, 10 %; #1 within 5 % of the fastest)\n",
      all.size(), 100 * s.step_median, 100 * s.step_worst, 100 * s.memory_median,
      100 * s.memory_worst);
}

int RunPlanCheck(PlanCheckOptions o) {
  if (o.steps == 0) o.steps = o.quick ? 4 : 6;
  if (o.per_case == 0) o.per_case = o.quick ? 3 : 4;
  fmt::print("plan-check: 4 ranks as threads, load average {:.1f} at the start\n", LoadAverage());
  std::vector<CaseResult> cases;
  for (const ModelCase& model : Models(o.quick)) {
    for (const LinkCase link : {LinkCase{50, 1}, LinkCase{500, 0.2}}) {
      cases.push_back(RunCase(o, model, link));
    }
  }
  PrintTable(cases);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "plan-check",
    "Run layouts the planner ranked here and compare predicted with measured step time and memory",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<PlanCheckOptions>();
      app.add_flag("--quick", o->quick,
                   "two model sizes, 3 layouts per model and link, 4 steps (a few minutes)");
      AddIntOption(app, "--steps", &o->steps, 0, 1000,
                   "training steps per layout (0: 6, --quick 4; the first is warm-up)");
      AddIntOption(app, "--per-case", &o->per_case, 0, 100,
                   "layouts run per model and link (0: 4, --quick 3)");
      AddIntOption(app, "--top", &o->top, 1, 1000, "the ranking they are spread over");
      return [o] { return RunPlanCheck(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
