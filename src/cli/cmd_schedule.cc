// `switchyard schedule`: a pipeline schedule (parallel/pipeline.h) as data: each rank's operations,
// its simulated timeline (bubble fraction against the theory, micro-batches in flight) and, with
// --out, the timeline drawn as an SVG (docs/pipeline.md shows the four kinds).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "switchyard/core/file_util.h"
#include "switchyard/parallel/pipeline.h"
#include "switchyard/train/svg.h"

namespace switchyard::cli {
namespace {

using parallel::OpKind;

struct ScheduleOptions {
  int pp = 4;
  int microbatches = 8;
  int virtual_stages = 1;
  std::string kind = "1f1b";
  std::string out;
  bool json = false;
};

std::string OpLabel(const parallel::PipelineOp& op, int virtual_stages) {
  std::string s = fmt::format("{}{}", parallel::OpKindName(op.kind), op.microbatch);
  if (virtual_stages > 1) s += fmt::format(".{}", op.chunk);
  return s;
}

const char* Colour(OpKind kind, int chunk) {
  switch (kind) {
    case OpKind::kForward: return chunk % 2 == 0 ? "#4e79a7" : "#76b7e5";
    case OpKind::kBackward: return chunk % 2 == 0 ? "#59a14f" : "#8cd17d";
    case OpKind::kBackwardInput: return "#59a14f";
    case OpKind::kBackwardWeight: return "#f28e2b";
    default: return "#bbbbbb";
  }
}

std::string TimelineSvg(const parallel::Schedule& s, const parallel::ScheduleSimulation& sim,
                        double theory) {
  const auto& c = s.config;
  const double unit = std::max(6.0, std::min(28.0, 900.0 / std::max(1.0, sim.makespan)));
  const double left = 70, top = 48, row = 34, width = left + sim.makespan * unit + 30;
  const double height = top + c.stages * row + 60;
  train::SvgWriter svg(width, height);
  svg.Text(left, 22,
           fmt::format("{}: p {}, m {}{}; bubble {:.1f}% (theory {:.1f}%)",
                       parallel::ScheduleKindName(c.kind), c.stages, c.microbatches,
                       c.virtual_stages > 1 ? fmt::format(", v {}", c.virtual_stages) : "",
                       100 * sim.bubble_fraction, 100 * theory),
           14);
  for (int r = 0; r < c.stages; ++r) {
    const double y = top + r * row;
    svg.Text(left - 8, y + row / 2 + 4, fmt::format("rank {}", r), 12, "end");
    svg.Rect(left, y, sim.makespan * unit, row - 6, "#f4f4f4");  // idle time shows through
    for (const parallel::TimedOp& t : sim.timeline[static_cast<size_t>(r)]) {
      const double x = left + t.start * unit, w = (t.end - t.start) * unit;
      svg.Rect(x, y, w, row - 6, Colour(t.op.kind, t.op.chunk), "#ffffff",
               OpLabel(t.op, c.virtual_stages));
      if (w >= 14) {
        svg.Text(x + w / 2, y + row / 2 + 1, fmt::format("{}", t.op.microbatch), 10, "middle",
                 "#ffffff");
      }
    }
  }
  const double ly = top + c.stages * row + 20;
  double lx = left;
  for (auto [kind, name] :
       {std::pair{OpKind::kForward, "F (forward)"}, std::pair{OpKind::kBackward, "B (backward)"},
        std::pair{OpKind::kBackwardWeight, "W (weight gradient)"}}) {
    svg.Rect(lx, ly, 14, 14, Colour(kind, 0));
    svg.Text(lx + 20, ly + 11, name, 11);
    lx += 160;
  }
  svg.Rect(lx, ly, 14, 14, "#f4f4f4", "#cccccc");
  svg.Text(lx + 20, ly + 11, "idle (bubble); numbers: micro-batch", 11);
  return svg.str();
}

int RunSchedule(const ScheduleOptions& o) {
  parallel::ScheduleConfig c;
  c.stages = o.pp;
  c.microbatches = o.microbatches;
  c.virtual_stages = o.virtual_stages;
  c.kind = parallel::ScheduleKindFromName(o.kind);
  const parallel::Schedule s = parallel::MakeSchedule(c);  // validated
  const parallel::ScheduleSimulation sim = parallel::SimulateSchedule(s);
  const double theory = parallel::TheoreticalBubbleFraction(c);
  if (!o.out.empty()) WriteTextFileAtomic(o.out, TimelineSvg(s, sim, theory));
  if (o.json) {
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < c.stages; ++r) {
      std::vector<std::string> ops;
      for (const auto& op : s.ops[static_cast<size_t>(r)]) {
        ops.push_back(fmt::format("{} {} {} {}", parallel::OpKindName(op.kind), op.microbatch,
                                  op.chunk, op.peer));
      }
      ranks.push_back({{"rank", r},
                       {"ops", ops},
                       {"peak_in_flight", sim.peak_in_flight[static_cast<size_t>(r)]}});
    }
    nlohmann::json j = {{"kind", o.kind},
                        {"pp", c.stages},
                        {"microbatches", c.microbatches},
                        {"virtual_stages", c.virtual_stages},
                        {"makespan", sim.makespan},
                        {"bubble_fraction", sim.bubble_fraction},
                        {"theoretical_bubble_fraction", theory},
                        {"ranks", ranks}};
    if (!o.out.empty()) j["svg"] = o.out;
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print("schedule {}: {} stages, {} micro-batches{} (valid: complete, matched, no deadlock)\n",
             o.kind, c.stages, c.microbatches,
             c.virtual_stages > 1 ? fmt::format(", {} chunks per rank", c.virtual_stages) : "");
  for (int r = 0; r < c.stages; ++r) {
    std::vector<std::string> compute;
    for (const auto& op : s.ops[static_cast<size_t>(r)]) {
      if (op.kind == OpKind::kForward || op.kind == OpKind::kBackward ||
          op.kind == OpKind::kBackwardInput || op.kind == OpKind::kBackwardWeight) {
        compute.push_back(OpLabel(op, c.virtual_stages));
      }
    }
    fmt::print("rank {}: {}   (peak in flight {})\n", r, fmt::join(compute, " "),
               sim.peak_in_flight[static_cast<size_t>(r)]);
  }
  fmt::print(
      "bubble fraction (F 1, B 2 = Bi 1 + W 1): {:.3f} simulated, {:.3f} theory; makespan "
      "{:g} units\n",
      sim.bubble_fraction, theory, sim.makespan);
  if (!o.out.empty()) fmt::print("timeline: {}\n", o.out);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "schedule",
    "A pipeline schedule as data: each rank's operations, its bubble and memory, an SVG timeline",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<ScheduleOptions>();
      AddIntOption(app, "--pp", &o->pp, 1, 1024, "pipeline stages");
      AddIntOption(app, "--microbatches", &o->microbatches, 1, 1 << 16, "micro-batches per step");
      AddIntOption(app, "--virtual", &o->virtual_stages, 1, 64,
                   "model chunks per rank (interleaved)");
      app.add_option("--kind", o->kind, "fthenb | 1f1b | interleaved | zb-h1")
          ->check(CLI::IsMember({"fthenb", "1f1b", "interleaved", "zb-h1"}));
      app.add_option("--out", o->out, "write the timeline as an SVG file");
      app.add_flag("--json", o->json, "print one JSON object");
      return [o] { return RunSchedule(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
