// `switchyard train`: the main job. With no arguments it trains the embedded default: a 4-block
// byte-level Mixtral-style transformer (the `mixtral` preset: an MoE FFN in every block, SwiGLU
// experts, RoPE, RMSNorm; `--arch gpt` is the GPT-2-style model that was the default before), on
// 4 ranks as threads of this process with the experts spread over them (expert parallelism) and
// the fortunes corpus.
// Every TrainConfig key is a flag (--ranks 2, --ep 2, --zero-stage 3, --steps 500, ...) and a
// key of the JSON file given with --config; flags override the file. Under mpirun each process
// is one rank (--transport mpi, or detected). --resume continues a run in its own directory
// (the one holding the checkpoint's checkpoints/) unless --out says where.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/peak_flops.h"
#include "cli/plan_check.h"
#include "switchyard/core/error.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/hf_names.h"
#include "switchyard/train/stop_signal.h"
#include "switchyard/train/upcycle.h"

namespace switchyard::cli {
namespace {

struct TrainOptions {
  std::string config_file;
  std::string resume;
  std::string init_from;     // a Hugging Face directory or a checkpoint: the new run's weights
  std::string upcycle_from;  // a dense checkpoint or Hugging Face directory: upcycled to MoE
  bool upcycle_zero_router = false;
  bool resume_given = false;  // --resume was on the command line (also as "")
  std::string transport = "auto";
  bool plain = false;
  double link_latency_us = 0;  // emulated link between in-process ranks (0 and 0: none)
  double link_gbps = 0;
  std::string layout;                         // "auto": the planner's first choice for this machine
  std::map<std::string, std::string> values;  // flag -> text, only for flags given
};

// The embedded default run (the README's main job): the `mixtral` preset at the sizes of
// PlanDefaultModel(). A run whose model comes from elsewhere (--resume, --init-from,
// --upcycle-from) defaults to `gpt` instead: the source's own 'arch' decides, and a checkpoint
// written before the key existed is a gpt model (docs/training.md, "The default model").
train::TrainConfig DefaultTrainConfig(bool model_from_source) {
  train::TrainConfig c = PlanDefaultModel();  // the model and layout keys
  if (model_from_source) c.arch = train::Arch::kGpt;
  c.steps = 1000;
  c.out = "runs/train";
  return c;
}

// --init-from / --upcycle-from PATH (`flag`): the model keys `keys_json` are PATH's (its
// config.json, or its checkpoint's); a flag or --config value that differs is an error naming
// both.
void TakeSourceModelKeys(const std::string& flag, const std::string& path,
                         const std::string& keys_json, train::ResolvedTrainConfig& resolved) {
  const nlohmann::json keys = nlohmann::json::parse(keys_json);
  const nlohmann::json mine = nlohmann::json::parse(train::TrainConfigToJson(resolved.config));
  std::vector<std::string> conflicts;
  for (const auto& [key, value] : keys.items()) {
    auto source = resolved.explicit_keys.find(key);
    if (source == resolved.explicit_keys.end() || !mine.contains(key)) continue;
    const nlohmann::json& have = mine.at(key);
    const bool same = have.is_number() && value.is_number()
                          ? have.get<double>() == value.get<double>()
                          : have == value;
    if (!same) {
      conflicts.push_back(fmt::format("'{}': {} gives {}, {} has {}", key, source->second,
                                      have.dump(), path, value.dump()));
    }
  }
  SY_REQUIRE(conflicts.empty(), InvalidArgument,
             "{} {}: the model comes from it; {} setting(s) conflict (leave them out): {}", flag,
             path, conflicts.size(), fmt::join(conflicts, "; "));
  resolved.config = train::TrainConfigFromJson(keys.dump(), resolved.config);
  for (const auto& [key, value] : keys.items()) resolved.explicit_keys[key] = flag + " " + path;
}

// Reads what PATH fixes; a missing or unreadable PATH is bad input (exit 2), named with `flag`.
template <typename Fn>
auto ReadSource(const std::string& flag, const std::string& path, Fn&& read) {
  try {
    return read(path);
  } catch (const IoError& e) {
    throw InvalidArgument(fmt::format("{} {}: {}", flag, path, e.what()));
  }
}

int RunTrain(const TrainOptions& o) {
  // Defaults < the resumed checkpoint < --config < flags; the moe_layer_config file's values
  // for what none of them set (train/config.h: ResolveTrainConfig).
  std::map<std::string, std::string> flags = o.values;
  train::UpcycleSource upcycle;
  if (!o.upcycle_from.empty()) {
    SY_REQUIRE(o.resume.empty() && o.init_from.empty(), InvalidArgument,
               "--upcycle-from starts a new MoE run from a dense model: it does not go with "
               "--resume or --init-from");
    upcycle = ReadSource("--upcycle-from", o.upcycle_from, train::ReadUpcycleSource);
    // A Hugging Face source's MoE family is the run's arch, so that its preset sets the router
    // and the other keys the dense model does not fix.
    if (!upcycle.arch.empty()) {
      auto given = flags.find("arch");
      SY_REQUIRE(given == flags.end() || given->second == upcycle.arch, InvalidArgument,
                 "--upcycle-from {}: a {} model upcycles to arch {}; --arch gives {}",
                 o.upcycle_from, upcycle.arch == "mixtral" ? "llama" : "qwen2", upcycle.arch,
                 given == flags.end() ? "" : given->second);
      flags["arch"] = upcycle.arch;
    }
  } else {
    SY_REQUIRE(!o.upcycle_zero_router, InvalidArgument,
               "--upcycle-zero-router needs --upcycle-from");
  }
  train::ResolvedTrainConfig resolved = train::ResolveTrainConfig(
      {.defaults =
           DefaultTrainConfig(!o.resume.empty() || !o.init_from.empty() || !o.upcycle_from.empty()),
       .config_file = o.config_file,
       .flags = flags,
       .resume = o.resume});
  // The model's vocabulary follows a SentencePiece tokenizer (and must match a checkpoint's).
  train::ApplyTokenizerVocabulary(resolved);
  if (!o.layout.empty()) {
    SY_REQUIRE(o.layout == "auto", InvalidArgument,
               "--layout: expected 'auto' (the planner's first choice for this machine), got '{}'",
               o.layout);
    SY_REQUIRE(o.resume.empty() && ResolveTransport(o.transport) != "mpi", InvalidArgument,
               "--layout auto plans a new run of ranks as threads on this machine: it does not go "
               "with --resume or --transport mpi");
    resolved = AutoLayout(
        resolved, {.ranks = 4, .link_latency_us = o.link_latency_us, .link_gbps = o.link_gbps},
        stdout);
  }
  if (!o.init_from.empty()) {
    TakeSourceModelKeys("--init-from", o.init_from,
                        ReadSource("--init-from", o.init_from, train::hf::InitFromModelKeysJson),
                        resolved);
  }
  if (!o.upcycle_from.empty()) {
    TakeSourceModelKeys("--upcycle-from", o.upcycle_from, upcycle.keys_json, resolved);
    train::CheckUpcycleConfig(resolved.config);
  }
  train::TrainConfig config = resolved.config;
  if (!resolved.out_given && !o.resume.empty()) {
    // A resumed run continues in its own run directory.
    config.out = train::RunDirectoryOfCheckpoint(o.resume);
  } else if (!resolved.out_given) {
    // The default run directory is taken by an earlier run: keep it, use the next free name.
    std::error_code ec;
    for (int i = 2; std::filesystem::exists(config.out, ec); ++i) {
      config.out = fmt::format("{}-{}", DefaultTrainConfig(false).out, i);
    }
  }
  const std::string transport = ResolveTransport(o.transport);
  train::DistributedRunOptions run;
  run.run.resume = o.resume;
  run.run.init_from = o.init_from;
  run.run.upcycle_from = o.upcycle_from;
  run.run.upcycle_zero_router = o.upcycle_zero_router;
  run.run.config_file = o.config_file;
  if (o.plain) run.run.interactive = 0;
  // Every key checked (ranges before any narrowing, keys that cannot act in this layout) before
  // the ranks are started and before anything is written; under mpirun again with the world's
  // size below.
  const train::TrainRunContext context{.ranks_are_threads = transport != "mpi",
                                       .resume_flag_empty = o.resume_given && o.resume.empty()};
  auto validate = [&] {
    train::ResolvedTrainConfig checked = resolved;
    checked.config = config;
    for (const std::string& notice : train::ValidateTrainConfig(checked, context)) {
      fmt::print(stderr, "{}\n", notice);
    }
  };
  if (transport != "mpi") validate();
  comm::InProcessOptions inprocess;
  if (o.link_latency_us > 0 || o.link_gbps > 0) {
    SY_REQUIRE(transport != "mpi", InvalidArgument,
               "--link-latency-us / --link-gbps emulate links between in-process ranks; they do "
               "not apply to --transport mpi");
    inprocess.emulation =
        comm::EmulationOptions{{o.link_latency_us, o.link_gbps}, {o.link_latency_us, o.link_gbps}};
    RequireEmulationFitsDeadline(*inprocess.emulation, inprocess.timeout, "", 0, kTrainLinkFlags);
  }
  std::unique_ptr<comm::Launcher> launcher =
      MakeLauncher(transport, static_cast<int>(config.ranks), inprocess, "train");
  if (transport == "mpi") {
    // Under mpirun a chosen number of ranks must equal the world size; otherwise it is taken.
    const int started = launcher->world_size();
    SY_REQUIRE(resolved.explicit_keys.count("ranks") == 0 || config.ranks == started,
               InvalidArgument,
               "ranks: {} requested but mpirun started {} processes (one rank per process); "
               "start {} processes or leave 'ranks' unset to use the {} started",
               config.ranks, started, config.ranks, started);
    config.ranks = started;
    validate();
  }
  // The process-wide settings of a run, at the program's edge: ranks share the process's cores
  // and each runs single-threaded BLAS on its own compute threads.
  KeepFreedMemoryForTraining();
  kernels::SetBlasThreads(1);
  kernels::ActiveGemmBackend();  // a GEMM backend that cannot run here is an error before step 1
  // SIGINT / SIGTERM: the ranks finish their step, save it and stop (train/stop_signal.h).
  train::ScopedStopSignals stop;
  run.run.stop_signal = stop.flag();
  train::RunSummary summary = train::RunDistributedTraining(*launcher, config, run);
  if (summary.stop_signal != 0) return 128 + summary.stop_signal;
  if (summary.run_dir.empty() || !std::isfinite(summary.tokens_per_s) ||
      summary.tokens_per_s <= 0) {
    return 0;
  }
  // The limit, measured in the same run: the FMA peak of one core times the cores the ranks use.
  if (transport != "mpi") {
    PeakFlops peak = MeasurePeakFlops();
    const int cores = std::min<int>(static_cast<int>(config.ranks), UsableCores());
    double limit = peak.gflops * cores;
    double achieved = summary.tokens_per_s * summary.flops_per_token / 1e9;
    if (!(limit > 0) || !std::isfinite(achieved)) return 0;  // no meaningful share
    fmt::print(
        "  FMA peak ({}, measured now) x {} core(s): {:.1f} GFLOP/s -> model FLOPs at "
        "{:.0f}% of it\n",
        peak.isa, cores, limit, 100 * achieved / limit);
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "train", "Train an MoE transformer (default: 4 ranks as threads, experts spread over them)",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<TrainOptions>();
      app.add_option("--config", o->config_file, "JSON file whose keys are the flags below");
      CLI::Option* resume =
          app.add_option("--resume", o->resume,
                         "continue from a checkpoint, checkpoints or run directory (any layout), "
                         "in that run's directory unless --out is given");
      app.add_option("--init-from", o->init_from,
                     "start a new run (step 0, fresh optimizer) from the weights of a Hugging "
                     "Face directory or a checkpoint; its config gives the model keys")
          ->type_name("PATH");
      app.add_option("--upcycle-from", o->upcycle_from,
                     "start a new MoE run from a dense model (a dense switchyard checkpoint or a "
                     "Hugging Face Llama / Qwen2 directory): each expert a copy (or, with "
                     "expert_hidden_dim below hidden_dim, a slice) of the dense MLP")
          ->type_name("PATH");
      app.add_flag("--upcycle-zero-router", o->upcycle_zero_router,
                   "with --upcycle-from: routers start at zero (uniform routing) instead of fresh");
      app.add_option("--transport", o->transport,
                     "inproc (ranks as threads) | mpi (ranks as mpirun's processes) | auto");
      app.add_flag("--plain", o->plain, "print progress as plain lines even on a terminal");
      app.add_option("--link-latency-us", o->link_latency_us,
                     "emulated latency per message between the in-process ranks, microseconds "
                     "(with --link-gbps; for measuring communication overlap)")
          ->check(FiniteIn(0, 1e12));
      app.add_option("--link-gbps", o->link_gbps,
                     "emulated bandwidth between the in-process ranks, GB/s (0 = unlimited)")
          ->check(FiniteIn(0, 1e12));
      app.add_option("--layout", o->layout,
                     "auto: run the layout `switchyard plan --cluster this` ranks first (this "
                     "machine calibrated now, a few seconds); layout keys other than --ranks are "
                     "then the planner's");
      AddTrainConfigFlags(
          app, [o](const std::string& key, const std::string& text) { o->values[key] = text; });
      return [o, resume] {
        o->resume_given = resume->count() > 0;
        return RunTrain(*o);
      };
    }});

}  // namespace
}  // namespace switchyard::cli
