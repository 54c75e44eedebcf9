#include "switchyard/train/trainer.h"

#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "switchyard/core/file_util.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/train/generate.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/progress.h"

namespace switchyard::train {

using nlohmann::json;

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

bool KeepFreedMemoryForTraining() {
  bool ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  ok = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1 && ok;
  return ok;
}

// ---- Trainer ----

Trainer::Trainer(TrainConfig config, FeedForwardFactory moe_factory, TrainHooks* hooks)
    : config_(std::move(config)), hooks_(hooks ? hooks : &default_hooks_) {
  const TrainConfig& c = config_;
  ValidateTrainConfig(c);
  SY_REQUIRE(c.batch_size >= hooks_->world_size(), InvalidArgument,
             "config: batch_size {} must be >= the number of ranks {}", c.batch_size,
             hooks_->world_size());
  threads_ =
      c.threads > 0 ? c.threads : ComputeThreadsPerRank(hooks_->ranks_in_process(), UsableCores());
  // The train layer runs its GEMMs split over its own blocking worker pool with single-threaded
  // BLAS calls (src/train/parallel_for.h says why); with ranks as threads the runtime has set
  // one BLAS thread already.
  if (hooks_->ranks_in_process() == 1) kernels::SetBlasThreads(1);

  corpus_ = c.data.empty() ? LoadCorpus(DefaultCorpusFiles(), c.val_fraction)
                           : LoadCorpus({c.data}, c.val_fraction);
  unigram_entropy_ = UnigramEntropy(corpus_.train);
  SY_REQUIRE(c.model.vocab_size >= 256, InvalidArgument,
             "config: byte-level data needs vocab_size >= 256, got {}", c.model.vocab_size);
  sampler_ = std::make_unique<BatchSampler>(corpus_.train, c.model.seq_len, c.seed);
  eval_batches_ = EvaluationBatches(corpus_.val, c.model.seq_len, c.batch_size, c.eval_tokens);

  if (moe_factory == nullptr && c.model.moe_every > 0) {
    moe_factory = MoeFeedForwardFactory(MoeLayerConfig(c));
  }
  model_ = std::make_unique<TransformerLm>(c.model, c.seed, std::move(moe_factory));
  optimizer_ = AdamW(AdamWOptions{.beta1 = static_cast<float>(c.beta1),
                                  .beta2 = static_cast<float>(c.beta2),
                                  .eps = static_cast<float>(c.adam_eps),
                                  .weight_decay = static_cast<float>(c.weight_decay)});
  schedule_ = LrSchedule{.max_lr = static_cast<float>(c.lr),
                         .min_lr = static_cast<float>(c.min_lr),
                         .warmup_steps = c.warmup_steps,
                         .total_steps = c.steps};
}

Trainer::~Trainer() = default;

StepMetrics Trainer::Step() {
  const TrainConfig& c = config_;
  double t0 = Now();
  const int64_t world = hooks_->world_size(), rank = hooks_->rank();
  const int64_t row_begin = c.batch_size * rank / world;
  const int64_t row_end = c.batch_size * (rank + 1) / world;
  Batch batch = sampler_->Sample(step_, c.batch_size, row_begin, row_end);

  ParameterSet& params = model_->parameters();
  hooks_->GatherParameters(params);
  model_->TakeMoeTimes();  // drop what evaluation or sampling spent in the MoE layers
  params.ZeroGrad();
  ForwardOptions fo;
  fo.training = true;
  fo.save_for_backward = true;
  fo.step = static_cast<uint64_t>(step_);
  fo.global_token_offset = row_begin * c.model.seq_len;
  fo.threads = threads_;
  LmOutput out = model_->Forward(batch.tokens, batch.targets, fo);
  model_->Backward(out, 1.0f, threads_);
  const FeedForwardTimes moe_times = model_->TakeMoeTimes();

  hooks_->ReduceGradients(params);
  double grad_norm = std::sqrt(hooks_->GradSquaredNorm(params));
  float factor = ClipFactor(grad_norm, static_cast<float>(c.grad_clip));
  hooks_->ScaleGradients(params, factor);
  float lr = schedule_.At(step_);
  hooks_->OptimizerStep(optimizer_, params, lr);
  hooks_->ReleaseParameters(params);
  ++step_;

  // Global metrics: token-weighted losses and summed routing statistics.
  std::vector<double> sums = {out.loss * out.count,           out.ce_loss * out.count,
                              out.aux_loss * out.count,       out.z_loss * out.count,
                              static_cast<double>(out.count), moe_times.seconds,
                              moe_times.comm_seconds};
  for (const auto& r : out.routing) {
    sums.push_back(static_cast<double>(r.routed));
    sums.push_back(static_cast<double>(r.dropped));
    for (int64_t l : r.expert_loads) sums.push_back(static_cast<double>(l));
  }
  hooks_->AllReduceSum(sums);
  StepMetrics m;
  m.step = step_;
  double count = std::max(1.0, sums[4]);
  m.loss = sums[0] / count;
  m.ce_loss = sums[1] / count;
  m.aux_loss = sums[2] / count;
  m.z_loss = sums[3] / count;
  if (!out.routing.empty()) {
    m.moe_time_s = sums[5] / static_cast<double>(world);
    m.moe_comm_s = sums[6] / static_cast<double>(world);
  }
  size_t k = 7;
  for (const auto& r : out.routing) {
    double routed = sums[k], dropped = sums[k + 1];
    k += 2;
    m.drop_rate.push_back(routed > 0 ? dropped / routed : 0.0);
    std::vector<int64_t> load;
    for (size_t e = 0; e < r.expert_loads.size(); ++e) {
      load.push_back(static_cast<int64_t>(std::llround(sums[k++])));
    }
    m.expert_load.push_back(std::move(load));
  }
  if (!m.expert_load.empty()) model_->EndStep(m.expert_load);
  m.lr = lr;
  m.grad_norm = grad_norm;
  m.step_time_s = Now() - t0;
  m.tokens_per_s = static_cast<double>(c.batch_size * c.model.seq_len) / m.step_time_s;
  return m;
}

double Trainer::Evaluate() {
  // Every rank takes its rows of every held-out batch (as in training), so that all ranks make
  // the same sequence of (collective) MoE forwards.
  const int64_t world = hooks_->world_size(), rank = hooks_->rank();
  hooks_->GatherParameters(model_->parameters());
  ForwardOptions fo;
  fo.training = false;
  fo.save_for_backward = false;
  fo.step = static_cast<uint64_t>(step_);
  fo.threads = threads_;
  std::vector<double> sums = {0, 0};
  for (const Batch& whole : eval_batches_) {
    const int64_t rows = whole.tokens.size(0);
    const int64_t begin = rows * rank / world, end = rows * (rank + 1) / world;
    Batch b{whole.tokens.Slice(begin, end), whole.targets.Slice(begin, end)};
    fo.global_token_offset = begin * whole.tokens.size(1);
    LmOutput out = model_->Forward(b.tokens, b.targets, fo);
    if (out.count == 0) continue;  // a rank with no rows of a short last batch
    sums[0] += out.ce_loss * static_cast<double>(out.count);
    sums[1] += static_cast<double>(out.count);
  }
  hooks_->AllReduceSum(sums);
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

CheckpointData Trainer::Snapshot() {
  CheckpointData d;
  ParameterSet& params = model_->parameters();
  hooks_->GatherParameters(params);
  d.step = step_;
  d.optimizer_step = hooks_->OptimizerStepCount(optimizer_);
  d.seed = config_.seed;
  d.global_batch = config_.batch_size;
  d.config_json = TrainConfigToJson(config_);
  d.model = hooks_->ModelValuesForCheckpoint(params);
  d.optimizer = hooks_->OptimizerStateForCheckpoint(optimizer_, params);
  return d;
}

void Trainer::Restore(const CheckpointData& data) {
  TrainConfig saved = TrainConfigFromJson(data.config_json.empty() ? "{}" : data.config_json);
  // What must match for the model to load and the run to continue identically.
  json mine = json::parse(TrainConfigToJson(config_));
  json theirs = json::parse(TrainConfigToJson(saved));
  for (const char* key : {"vocab_size", "seq_len", "model_dim", "num_layers", "num_heads",
                          "hidden_dim", "norm", "activation", "tied_head", "moe_every",
                          "num_experts", "top_k", "expert_hidden_dim", "seed", "batch_size"}) {
    SY_REQUIRE(mine[key] == theirs[key], InvalidArgument,
               "resume: the checkpoint was trained with {} = {}, this run has {} (pass the "
               "checkpoint's value to resume it)",
               key, theirs[key].dump(), mine[key].dump());
  }
  hooks_->LoadModelValues(model_->parameters(), data.model);
  hooks_->LoadOptimizerState(optimizer_, data.optimizer, data.optimizer_step, model_->parameters());
  step_ = data.step;
}

std::string Trainer::Sample(int64_t tokens, const std::string& prompt) {
  SampleOptions o;
  o.prompt = prompt;
  o.max_tokens = tokens;
  o.temperature = static_cast<float>(config_.temperature);
  o.seed = config_.seed;
  o.threads = threads_;
  hooks_->GatherParameters(model_->parameters());
  return GenerateText(*model_, o);
}

RunSummary Trainer::Run(const RunOptions& options) {
  namespace fs = std::filesystem;
  const TrainConfig& c = config_;
  std::FILE* out = options.out;
  const std::string run_dir = c.out;
  bool resumed = false;
  bool resumes_own_run = false;  // the checkpoint is in run_dir/checkpoints
  if (!options.resume.empty()) {
    std::string dir = ResolveCheckpoint(options.resume);
    Restore(LoadCheckpoint(dir));
    resumed = true;
    std::error_code ec_from, ec_own;
    const fs::path from = fs::weakly_canonical(fs::path(dir), ec_from).parent_path();
    const fs::path own = fs::weakly_canonical(fs::path(run_dir) / "checkpoints", ec_own);
    resumes_own_run = !ec_from && !ec_own && from == own;
    if (hooks_->writes_run_directory()) fmt::print(out, "resumed from {} at step {}\n", dir, step_);
  }
  const bool writer = hooks_->writes_run_directory();
  std::unique_ptr<MetricsWriter> metrics;
  std::vector<StepMetrics> history;
  if (writer) {
    std::error_code ec;
    // Only a run's own checkpoints continue it in place: anything else would truncate its
    // metrics and replace its checkpoints.
    if (fs::exists(run_dir + "/checkpoints/latest", ec)) {
      SY_REQUIRE(resumed, InvalidArgument,
                 "run directory '{}' already holds a run with checkpoints: pass --resume {} to "
                 "continue it, or another --out",
                 run_dir, run_dir);
      SY_REQUIRE(resumes_own_run, InvalidArgument,
                 "run directory '{}' holds another run with checkpoints, which resuming '{}' there "
                 "would overwrite: give no --out to continue that checkpoint's own run, or a new "
                 "--out",
                 run_dir, options.resume);
    }
    fs::create_directories(run_dir, ec);
    SY_REQUIRE(!ec, IoError, "{}: cannot create run directory: {}", run_dir, ec.message());
    WriteTextFileAtomic(run_dir + "/config.json", TrainConfigToJson(c) + "\n");
    if (resumed) {
      for (auto& m : ReadMetrics(run_dir + "/metrics.jsonl")) {
        if (m.step <= step_) history.push_back(std::move(m));
      }
    }
    metrics = std::make_unique<MetricsWriter>(run_dir + "/metrics.jsonl", resumed ? step_ : -1);
  }
  const bool moe = model_->num_moe_blocks() > 0;
  const int64_t params = model_->parameters().NumTrainableElements();
  if (writer) {
    fmt::print(out,
               "model: {} parameters, {} layer(s), model_dim {}, {} heads, seq_len {}{}\n"
               "data: {} ({} train / {} held-out bytes), unigram entropy {:.3f} nats/byte\n"
               "run: {} steps x {} sequences ({} tokens/step), {} compute thread(s), out {}\n",
               params, c.model.num_layers, c.model.model_dim, c.model.num_heads, c.model.seq_len,
               moe ? fmt::format(", MoE every {} blocks", c.model.moe_every) : "",
               c.data.empty() ? std::string("fortunes corpus") : c.data, corpus_.train.size(),
               corpus_.val.size(), unigram_entropy_, c.steps, c.batch_size,
               c.batch_size * c.model.seq_len, threads_, run_dir);
  }
  bool interactive =
      options.interactive < 0 ? ProgressBar::IsTerminal(out) : options.interactive > 0;
  ProgressBar bar(out, interactive && writer, c.log_every);
  std::string title =
      fmt::format("switchyard train: {} layers{}, d={}, {}", c.model.num_layers,
                  moe ? fmt::format(" (MoE every {}, {} experts, top-{})", c.model.moe_every,
                                    c.num_experts, c.top_k)
                      : "",
                  c.model.model_dim, c.data.empty() ? std::string("fortunes") : c.data);
  auto write_figures = [&] {
    if (!writer) return;
    WriteLossSvg(run_dir + "/loss.svg", history, unigram_entropy_, title);
    if (moe) {
      WriteExpertLoadSvg(run_dir + "/expert_load.svg", history,
                         fmt::format("tokens routed to each expert per {} steps", c.log_every));
    }
  };

  RunSummary summary;
  summary.run_dir = run_dir;
  summary.unigram_entropy = unigram_entropy_;
  summary.parameters = params;
  summary.flops_per_token =
      TrainingFlopsPerToken(c.model, moe ? c.num_experts : 0, c.top_k, c.expert_hidden_dim);
  const double run_start = Now();
  const int64_t first_step = step_;
  // Interval accumulators (reset at every metrics line).
  StepMetrics acc;
  int64_t acc_steps = 0;
  double acc_time = 0, acc_moe = 0, acc_moe_comm = 0;
  double run_step_time = 0, run_moe = 0, run_moe_comm = 0;
  double last_val = NAN;
  std::vector<double> rates;
  while (step_ < c.steps) {
    StepMetrics m = Step();
    if (acc_steps == 0) acc = StepMetrics{};
    ++acc_steps;
    acc_time += m.step_time_s;
    run_step_time += m.step_time_s;
    if (std::isfinite(m.moe_time_s)) {
      acc_moe += m.moe_time_s;
      acc_moe_comm += m.moe_comm_s;
      run_moe += m.moe_time_s;
      run_moe_comm += m.moe_comm_s;
    }
    acc.loss = (acc_steps == 1 ? 0 : acc.loss) + m.loss;
    acc.ce_loss = (acc_steps == 1 ? 0 : acc.ce_loss) + m.ce_loss;
    acc.aux_loss += m.aux_loss;
    acc.z_loss += m.z_loss;
    if (acc.expert_load.empty()) {
      acc.expert_load = m.expert_load;
      acc.drop_rate = m.drop_rate;
    } else {
      for (size_t l = 0; l < m.expert_load.size(); ++l) {
        for (size_t e = 0; e < m.expert_load[l].size(); ++e) {
          acc.expert_load[l][e] += m.expert_load[l][e];
        }
        acc.drop_rate[l] += m.drop_rate[l];
      }
    }
    double val = NAN;
    bool last = step_ == c.steps;
    if ((c.eval_every > 0 && step_ % c.eval_every == 0) || last) {
      val = Evaluate();
      last_val = val;
      if (writer && std::isfinite(val)) {
        bar.Print(fmt::format("step {}: val loss {:.4f} (train {:.4f}, unigram entropy {:.3f})",
                              step_, val, acc.ce_loss / acc_steps, unigram_entropy_));
      }
    }
    double n = static_cast<double>(acc_steps);
    if (step_ % c.log_every == 0 || last || std::isfinite(val)) {
      StepMetrics line = acc;
      line.step = step_;
      line.loss /= n;
      line.ce_loss /= n;
      line.aux_loss /= n;
      line.z_loss /= n;
      for (auto& d : line.drop_rate) d /= n;
      line.lr = m.lr;
      line.grad_norm = m.grad_norm;
      line.step_time_s = acc_time / n;
      if (moe) {
        line.moe_time_s = acc_moe / n;
        line.moe_comm_s = acc_moe_comm / n;
      }
      line.tokens_per_s =
          static_cast<double>(c.batch_size * c.model.seq_len) * n / std::max(acc_time, 1e-12);
      line.val_loss = val;
      rates.push_back(line.tokens_per_s);
      summary.final_train_loss = line.ce_loss;
      if (writer) {
        metrics->Append(line);
        history.push_back(line);
      }
      acc_steps = 0;
      acc_time = acc_moe = acc_moe_comm = 0;
      if (std::isfinite(val)) write_figures();
    }
    if (writer) {
      double elapsed = Now() - run_start;
      double per_step = elapsed / static_cast<double>(step_ - first_step);
      double drop = NAN;
      if (!m.drop_rate.empty()) {
        drop = 0;
        for (double d : m.drop_rate) drop += d / static_cast<double>(m.drop_rate.size());
      }
      bar.Update(ProgressInfo{.step = step_,
                              .total = c.steps,
                              .loss = acc_steps > 0 ? acc.ce_loss / n : summary.final_train_loss,
                              .val_loss = last_val,
                              .tokens_per_s = rates.empty() ? m.tokens_per_s : rates.back(),
                              .drop_rate = drop,
                              .eta_s = per_step * static_cast<double>(c.steps - step_)});
    }
    if ((c.checkpoint_every > 0 && step_ % c.checkpoint_every == 0) || last) {
      CheckpointData snap = Snapshot();
      if (writer) {
        SaveCheckpoint(run_dir + "/checkpoints", snap, static_cast<int>(c.keep_checkpoints));
      }
    }
  }
  bar.Finish();
  summary.steps = step_;
  summary.seconds = Now() - run_start;
  summary.final_val_loss = last_val;
  if (moe && run_step_time > 0) {
    summary.moe_time_share = run_moe / run_step_time;
    summary.moe_comm_share = run_moe_comm / run_step_time;
  }
  if (!rates.empty()) {
    std::vector<double> sorted = rates;
    std::sort(sorted.begin(), sorted.end());
    summary.tokens_per_s = sorted[sorted.size() / 2];
  }
  write_figures();
  if (c.sample_tokens > 0) summary.sample = Sample(c.sample_tokens);
  if (writer) {
    if (c.sample_tokens > 0) WriteTextFileAtomic(run_dir + "/sample.txt", summary.sample);
    json s = {{"steps", summary.steps},
              {"seconds", summary.seconds},
              {"parameters", summary.parameters},
              {"unigram_entropy", summary.unigram_entropy},
              {"flops_per_token", summary.flops_per_token},
              {"tokens_per_s_median",
               std::isfinite(summary.tokens_per_s) ? json(summary.tokens_per_s) : json()},
              {"final_train_loss",
               std::isfinite(summary.final_train_loss) ? json(summary.final_train_loss) : json()},
              {"final_val_loss",
               std::isfinite(summary.final_val_loss) ? json(summary.final_val_loss) : json()},
              {"moe_time_share",
               std::isfinite(summary.moe_time_share) ? json(summary.moe_time_share) : json()},
              {"moe_comm_share",
               std::isfinite(summary.moe_comm_share) ? json(summary.moe_comm_share) : json()}};
    WriteTextFileAtomic(run_dir + "/summary.json", s.dump(2) + "\n");
    fmt::print(out,
               "done: {} steps in {}, {} tok/s (median), {:.1f} GFLOP/s of model FLOPs\n"
               "  GEMM backend: {}{}\n"
               "  train loss {:.4f}, val loss {:.4f} nats/byte; unigram entropy {:.3f} "
               "({:.0f}% of it)\n",
               summary.steps, FormatDuration(summary.seconds), FormatRate(summary.tokens_per_s),
               summary.tokens_per_s * summary.flops_per_token / 1e9, kernels::GemmBackendName(),
               kernels::GemmBackendWarning().empty() ? "" : "\n  " + kernels::GemmBackendWarning(),
               summary.final_train_loss, summary.final_val_loss, summary.unigram_entropy,
               100 * summary.final_val_loss / summary.unigram_entropy);
    if (std::isfinite(summary.moe_time_share)) {
      fmt::print(out,
                 "  MoE layers: {:.0f}% of step time (blocked in their collectives {:.0f}%, "
                 "gate + dispatch + experts + combine {:.0f}%)\n",
                 100 * summary.moe_time_share, 100 * summary.moe_comm_share,
                 100 * (summary.moe_time_share - summary.moe_comm_share));
    }
    fmt::print(out, "  run directory: {} (metrics.jsonl, loss.svg{}, checkpoints/, sample.txt)\n",
               run_dir, moe ? ", expert_load.svg" : "");
    if (c.sample_tokens > 0) {
      // Control bytes (an untrained model emits any byte) would drive the terminal: escape them.
      std::string shown;
      for (unsigned char ch : summary.sample) {
        bool control = (ch < 0x20 && ch != '\n' && ch != '\t') || ch == 0x7f;
        shown += control ? fmt::format("\\x{:02x}", ch) : std::string(1, static_cast<char>(ch));
      }
      fmt::print(out, "sample (temperature {}):\n{}\n", c.temperature, shown);
    }
  }
  return summary;
}

}  // namespace switchyard::train
