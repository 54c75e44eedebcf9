// Predicted against measured: runs layouts the planner ranked with `switchyard train`'s own code
// on this machine (ranks as threads, emulated links) and compares step time and peak memory per
// rank with the step model's prediction (docs/planner.md, "Accuracy on this machine"). Used by
// `switchyard plan --validate` and `switchyard bench plan-check`.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cli/plan_calibrate.h"
#include "switchyard/plan/search.h"
#include "switchyard/train/config.h"

namespace switchyard::cli {

// The model and layout keys of `switchyard train`'s embedded default run (a 4-block MoE
// transformer on 4 ranks; cmd_train.cc adds its steps and directory): the model plan and bench
// plan-check start from.
train::TrainConfig PlanDefaultModel();

// `switchyard train --layout auto`: calibrates this machine for `resolved`'s ranks (ranks as
// threads, the emulated links of `calibration`), plans and returns `resolved` with the planner's
// first layout applied; prints which it is to `out`. InvalidArgument when a layout key other than
// ranks is set (the planner chooses them) or no layout fits.
train::ResolvedTrainConfig AutoLayout(const train::ResolvedTrainConfig& resolved,
                                      CalibrationOptions calibration, std::FILE* out);

// plan::SearchOptions::progress for a command: from 2 s into the search on, at most once a
// second, "plan: predicted N of M layouts (T s)" on stderr.
std::function<void(int64_t, int64_t)> SearchProgress();

// One layout run here and its prediction.
struct LayoutCheck {
  int64_t position = 0;  // 1-based place in the planner's ranking
  std::string flags;     // plan::FlagsText of its layout keys
  double predicted_s = 0, measured_s = 0;
  double predicted_bytes = 0, peak_bytes = 0;  // per rank: train's estimate, the measured peak
  double load = 0;                             // the machine's load average after the run
  double step_error() const { return (predicted_s - measured_s) / measured_s; }
  double memory_error() const { return (predicted_bytes - peak_bytes) / peak_bytes; }
};

// Indices of `k` of `n` ranked layouts, evenly spread, the first (the planner's choice) always.
std::vector<int64_t> SpreadIndices(int64_t n, int64_t k);

// Calibrates this machine (`calibration`: the ranks and emulated links), runs `layout` right
// after for `steps` steps (log every step, no evaluation, no sample, no checkpoint; the run
// directory is a temporary one, removed after) and calibrates again. Predicted step time: the
// mean of the predictions with the two calibrations; measured: the batch's tokens over the run's
// median tokens per second. Calibrating around each run keeps the prediction and the measurement
// in the same window of this shared machine's load.
LayoutCheck CheckLayoutHere(const plan::Layout& layout, int64_t position, int64_t steps,
                            const CalibrationOptions& calibration);

// Median and worst |relative error| of step time and memory, and how much slower the first
// check (the planner's #1) measured than the fastest measured. Precondition: `checks` not empty.
struct CheckSummary {
  double step_median = 0, step_worst = 0, memory_median = 0, memory_worst = 0;
  double first_vs_best = 0;  // measured(#1) / min(measured) - 1
};
CheckSummary Summarize(const std::vector<LayoutCheck>& checks);

void PrintCheckHeader();
void PrintCheckRow(const LayoutCheck& check);
// "step time: median |error| 12.3%, worst ...".
std::string SummaryText(const CheckSummary& summary);

}  // namespace switchyard::cli
