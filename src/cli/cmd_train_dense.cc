// `switchyard train-dense`: the trainer of src/train alone, over a one-rank world of its own
// (`switchyard train` runs the same trainer on several ranks with expert parallelism). Dense by
// default; --moe-every N puts single-rank MoE layers in every N-th block. Resumes checkpoints of
// either command; --resume continues a run in its own directory unless --out says where. Every
// TrainConfig key is a flag (--model-dim 128, --steps 500, ...) and a key of the JSON file given
// with --config; flags override the file.
#include <fmt/format.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/peak_flops.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/run_dir.h"
#include "switchyard/train/stop_signal.h"
#include "switchyard/train/trainer.h"

namespace switchyard::cli {
namespace {

struct TrainDenseOptions {
  std::string config_file;
  std::string resume;
  bool resume_given = false;  // --resume was on the command line (also as "")
  bool plain = false;
  std::map<std::string, std::string> values;  // flag -> text, only for flags given
};

int RunTrainDense(const TrainDenseOptions& o) {
  train::TrainConfig defaults;
  defaults.out = "runs/train-dense";
  // Defaults < the resumed checkpoint < --config < flags < (for the keys none of them set) the
  // moe_layer_config file (train/config.h: ResolveTrainConfig).
  train::ResolvedTrainConfig resolved = train::ResolveTrainConfig(
      {.defaults = defaults, .config_file = o.config_file, .flags = o.values, .resume = o.resume});
  // The model's vocabulary follows a SentencePiece tokenizer (and must match a checkpoint's).
  train::ApplyTokenizerVocabulary(resolved);
  train::TrainConfig config = resolved.config;
  // A resumed run continues in its own run directory.
  if (!o.resume.empty() && !resolved.out_given) {
    config.out = train::RunDirectoryOfCheckpoint(o.resume);
  }
  // Every key checked before anything is written; the layout keys cannot act on one rank.
  train::ResolvedTrainConfig checked = resolved;
  checked.config = config;
  for (const std::string& notice : train::ValidateTrainConfig(
           checked, {.dense = true, .resume_flag_empty = o.resume_given && o.resume.empty()})) {
    fmt::print(stderr, "{}\n", notice);
  }
  KeepFreedMemoryForTraining();
  kernels::SetBlasThreads(1);  // the trainer splits its GEMMs over its own threads
  train::RunOptions run;
  run.resume = o.resume;
  run.config_file = o.config_file;
  if (o.plain) run.interactive = 0;
  train::RequireRunInputsOutsideRunDirectory(config, run.config_file,
                                             run.resume);  // the first error, before any work
  train::Trainer trainer(config);
  // SIGINT / SIGTERM: the step under way finishes and is saved (train/stop_signal.h).
  train::ScopedStopSignals stop;
  run.stop_signal = stop.flag();
  train::RunSummary summary = trainer.Run(run);
  if (summary.stop_signal != 0) return 128 + summary.stop_signal;
  // The limit, measured in the same run: the FMA peak of the compute threads used.
  PeakFlops peak = MeasurePeakFlops();
  double limit = peak.gflops * trainer.threads();
  double achieved = summary.tokens_per_s * summary.flops_per_token / 1e9;
  if (!(limit > 0) || !std::isfinite(achieved) || !(achieved > 0)) return 0;
  fmt::print(
      "  FMA peak ({}, measured now) x {} thread(s): {:.1f} GFLOP/s -> model FLOPs at "
      "{:.0f}% of it\n",
      peak.isa, trainer.threads(), limit, 100 * achieved / limit);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "train-dense",
    "Train the transformer on one rank without communication (dense; MoE with --moe-every)",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<TrainDenseOptions>();
      app.add_option("--config", o->config_file, "JSON file whose keys are the flags below");
      CLI::Option* resume =
          app.add_option("--resume", o->resume,
                         "continue from a checkpoint, checkpoints or run directory, in that run's "
                         "directory unless --out is given");
      app.add_flag("--plain", o->plain, "print progress as plain lines even on a terminal");
      AddTrainConfigFlags(
          app, [o](const std::string& key, const std::string& text) { o->values[key] = text; });
      return [o, resume] {
        o->resume_given = resume->count() > 0;
        return RunTrainDense(*o);
      };
    }});

}  // namespace
}  // namespace switchyard::cli
