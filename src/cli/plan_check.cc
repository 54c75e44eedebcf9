#include "cli/plan_check.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/launch.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/distributed.h"

namespace switchyard::cli {

train::TrainConfig PlanDefaultModel() {
  train::TrainConfig c;
  c.arch = train::Arch::kMixtral;  // the preset's model at these sizes (docs/training.md)
  c.model.moe_every = 2;
  c.num_experts = 4;
  c.top_k = 2;
  c.ranks = 4;
  return c;
}

std::function<void(int64_t, int64_t)> SearchProgress() {
  const auto start = std::chrono::steady_clock::now();
  auto last = std::make_shared<double>(0.0);
  return [start, last](int64_t done, int64_t total) {
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (t < 2 || t - *last < 1) return;
    *last = t;
    fmt::print(stderr, "plan: predicted {} of {} layouts ({:.0f} s)\n", done, total, t);
  };
}

train::ResolvedTrainConfig AutoLayout(const train::ResolvedTrainConfig& resolved,
                                      CalibrationOptions calibration, std::FILE* out) {
  for (const auto& [key, source] : resolved.explicit_keys) {
    SY_REQUIRE(!train::IsLayoutKey(key) || key == "ranks" || key == "threads", InvalidArgument,
               "train: --layout auto chooses the layout, but '{}' is set ({}): give the model, "
               "the batch and --ranks only, or drop --layout auto",
               key, source);
  }
  // The keys' values (ranks in its range, ...) before calibrating and searching for them.
  train::ValidateTrainConfig(resolved.config);
  const auto t0 = std::chrono::steady_clock::now();
  calibration.ranks = static_cast<int>(resolved.config.ranks);
  const plan::Cluster cluster = CalibrateThisMachine(calibration);
  const plan::PlanResult r = plan::PlanLayouts(resolved, cluster,
                                               {.ranks = resolved.config.ranks,
                                                .top = 1,
                                                .progress = SearchProgress(),
                                                .run = {.ranks_are_threads = true}});
  SY_REQUIRE(!r.layouts.empty(), InvalidArgument,
             "train: --layout auto: no layout of {} ranks fits this machine's memory ({:.0f} MiB "
             "per rank) and passes train's checks for this model and batch; run `switchyard "
             "plan --cluster this` with the same flags to see why",
             resolved.config.ranks, r.memory_limit_bytes / (1024.0 * 1024.0));
  const plan::Layout& first = r.layouts.front();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(out,
             "layout auto: the planner's first choice for this machine (calibrated and ranked "
             "{} layouts in {:.1f} s): {}; predicted {:.1f} ms per step, {:.1f} MiB per rank\n",
             r.enumerated, seconds, plan::FlagsText(first.flags), 1e3 * first.prediction.step_s,
             static_cast<double>(first.prediction.memory.total()) / (1024.0 * 1024.0));
  return plan::ApplyLayout(resolved, first.flags);
}

std::vector<int64_t> SpreadIndices(int64_t n, int64_t k) {
  k = std::min(k, n);
  std::vector<int64_t> out;
  for (int64_t j = 0; j < k; ++j) out.push_back(k == 1 ? 0 : j * (n - 1) / (k - 1));
  return out;
}

LayoutCheck CheckLayoutHere(const plan::Layout& layout, int64_t position, int64_t steps,
                            const CalibrationOptions& calibration) {
  KeepFreedMemoryForTraining();
  const plan::Cluster cluster = CalibrateThisMachine(calibration);
  kernels::SetBlasThreads(1);
  comm::InProcessOptions inprocess;
  if (calibration.link_latency_us > 0 || calibration.link_gbps > 0) {
    const comm::LinkModel link{calibration.link_latency_us, calibration.link_gbps};
    inprocess.emulation = comm::EmulationOptions{link, link};
  }
  train::TrainConfig c = layout.config;
  c.steps = steps;
  c.log_every = 1;
  c.eval_every = 0;
  c.val_fraction = 0;
  c.sample_tokens = 0;
  c.checkpoint_every = 0;
  c.keep_checkpoints = 1;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      fmt::format("switchyard-plan-check-{}-{}", ::getpid(), position);
  c.out = dir.string();
  std::FILE* sink = std::fopen("/dev/null", "w");
  train::RunSummary s;
  {
    auto launcher = MakeLauncher("inproc", static_cast<int>(c.ranks), inprocess, "plan");
    train::DistributedRunOptions run;
    run.run.out = sink != nullptr ? sink : stderr;
    run.run.interactive = 0;
    s = train::RunDistributedTraining(*launcher, c, run);
  }
  if (sink != nullptr) std::fclose(sink);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  // The machine's load changes from minute to minute (other processes): the prediction is the
  // mean of those with the calibrations just before and just after the run.
  const plan::StepPrediction p = plan::PredictStep(layout.config, cluster);
  const plan::StepPrediction after =
      plan::PredictStep(layout.config, CalibrateThisMachine(calibration));
  return {.position = position,
          .flags = plan::FlagsText(layout.flags),
          .predicted_s = (p.step_s + after.step_s) / 2,
          .measured_s = static_cast<double>(c.batch_size * c.model.seq_len) / s.tokens_per_s,
          .predicted_bytes = static_cast<double>(p.memory.total()),
          .peak_bytes = s.memory_train_peak_bytes,
          .load = LoadAverage()};
}

CheckSummary Summarize(const std::vector<LayoutCheck>& checks) {
  auto median_and_worst = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return std::pair{v[v.size() / 2], v.back()};
  };
  std::vector<double> steps, memory, measured;
  for (const LayoutCheck& k : checks) {
    steps.push_back(std::abs(k.step_error()));
    memory.push_back(std::abs(k.memory_error()));
    measured.push_back(k.measured_s);
  }
  CheckSummary s;
  std::tie(s.step_median, s.step_worst) = median_and_worst(steps);
  std::tie(s.memory_median, s.memory_worst) = median_and_worst(memory);
  s.first_vs_best =
      checks.front().measured_s / *std::min_element(measured.begin(), measured.end()) - 1;
  return s;
}

void PrintCheckHeader() {
  fmt::print("{:>3} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7} {:>5}  {}\n", "#", "pred ms", "meas ms",
             "err", "pred MiB", "peak MiB", "err", "load", "layout");
}

void PrintCheckRow(const LayoutCheck& k) {
  constexpr double kMiB = 1024.0 * 1024.0;
  fmt::print("{:>3} {:>10.2f} {:>10.2f} {:>6.1f}% {:>10.1f} {:>10.1f} {:>6.1f}% {:>5.1f}  {}\n",
             k.position, 1e3 * k.predicted_s, 1e3 * k.measured_s, 100 * k.step_error(),
             k.predicted_bytes / kMiB, k.peak_bytes / kMiB, 100 * k.memory_error(), k.load,
             k.flags);
  std::fflush(stdout);
}

std::string SummaryText(const CheckSummary& s) {
  return fmt::format(
      "step time: median |error| {:.1f}%, worst {:.1f}%; peak memory: median |error| {:.1f}%, "
      "worst {:.1f}%; the planner's #1 measured {:.1f}% slower than the fastest measured",
      100 * s.step_median, 100 * s.step_worst, 100 * s.memory_median, 100 * s.memory_worst,
      100 * s.first_vs_best);
}

}  // namespace switchyard::cli
