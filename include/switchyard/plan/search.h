// The search (docs/planner.md, "The search"): every layout of a model on a cluster's ranks that
// `switchyard train` accepts, predicted by the step model and ranked by step time under the
// memory limit.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "switchyard/plan/cluster.h"
#include "switchyard/plan/step_model.h"
#include "switchyard/train/config.h"

namespace switchyard::plan {

// Layout keys and their command-line text, in flag order ({"tp", "2"}, {"pp", "2"}, ...).
using LayoutFlags = std::vector<std::pair<std::string, std::string>>;

struct Layout {
  LayoutFlags flags;
  train::TrainConfig config;  // the base config with the flags applied
  StepPrediction prediction;
};

// `--ranks 4 --tp 2 ...`: the flags as `switchyard train` takes them (dashes, values as given).
std::string FlagsText(const LayoutFlags& flags);

// Every candidate layout of `ranks` ranks for `base`'s model: tp, sequence parallelism and its
// overlap, cp and its algorithm, pp with its schedule and virtual stages, ep, etp (Megatron
// arrangement), ZeRO stage, micro-batches, recompute, dispatcher, adaptive r, overlap degree.
// Only keys that act in the layout are set; train's validation decides which are valid.
// `fixed` (keys as train spells them, `plan --fix`): every candidate takes these values, tp, cp,
// pp and ep restricted to them, the other keys set (or added) in each candidate, duplicates
// dropped (so a value the enumeration does not try, e.g. 120 micro-batches, can be given).
std::vector<LayoutFlags> EnumerateLayouts(const train::TrainConfig& base, int64_t ranks,
                                          const LayoutFlags& fixed = {});

// `base` with the layout's keys set as flags would set them (train::SetTrainConfigValue), the
// keys recorded as explicit flags.
train::ResolvedTrainConfig ApplyLayout(const train::ResolvedTrainConfig& base,
                                       const LayoutFlags& flags);

// Throws train's InvalidArgument when `switchyard train` would refuse the layout before its
// first step: train::ValidateTrainConfig (ranges, divisibility, keys that cannot act),
// train::TrainParallelOptions (expert parallelism) and train::ValidateBatchSplit.
void CheckLayout(const train::ResolvedTrainConfig& resolved, const train::TrainRunContext& run);

struct SearchOptions {
  int64_t ranks = 0;  // 0: every device of the cluster
  int64_t top = 10;   // layouts returned, best first
  // Per-rank memory limit in bytes; 0: the cluster's memory_gib.
  double memory_limit_bytes = 0;
  LayoutFlags fixed = {};  // layout keys held at a value (EnumerateLayouts)
  // Called now and then while the candidates are predicted (done, total): long searches
  // report their progress through it. Empty: nothing is called.
  std::function<void(int64_t, int64_t)> progress = {};
  train::TrainRunContext run;  // where train will run (ranks as threads or not)
};

struct PlanResult {
  std::vector<Layout> layouts;  // the fastest valid layouts under the limit, best first
  int64_t enumerated = 0;       // candidates considered
  int64_t rejected = 0;         // refused by train's validation (among those looked at)
  int64_t over_memory = 0;      // valid but over the memory limit
  double memory_limit_bytes = 0;
  // When no layout fits: the valid layout with the least memory (its prediction says by how
  // much it is over).
  std::vector<Layout> smallest_over_limit;
};

// Ranks the layouts. InvalidArgument when ranks exceed the cluster's devices. An empty
// `layouts` means none fits; `smallest_over_limit` then holds the closest.
PlanResult PlanLayouts(const train::ResolvedTrainConfig& base, const Cluster& cluster,
                       const SearchOptions& options);

// One sentence on why `first` beats `second` (the parts of the step that differ most).
std::string WhyFirstWins(const Layout& first, const Layout& second);

}  // namespace switchyard::plan
