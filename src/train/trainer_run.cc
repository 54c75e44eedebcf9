// Trainer::Run: the run directory, the loop over steps with its metrics lines, evaluations,
// progress and checkpoints, the run's end, and what a failure saves (trainer.h).
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <optional>

#include "switchyard/core/clock.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/memory_account.h"
#include "switchyard/train/dataset/metrics.h"
#include "switchyard/train/generate.h"
#include "switchyard/train/hf_names.h"
#include "switchyard/train/memory_estimate.h"
#include "switchyard/train/progress.h"
#include "switchyard/train/run_dir.h"
#include "switchyard/train/svg.h"
#include "switchyard/train/trainer.h"
#include "switchyard/train/upcycle.h"
#include "train/rank_objects.h"

namespace switchyard::train {

namespace {

// `error` rethrown as the same type with `note` appended to its message.
[[noreturn]] void RethrowWithNote(std::exception_ptr error, const std::string& note) {
  try {
    std::rethrow_exception(error);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string(e.what()) + note);
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + note);
  } catch (const NonFiniteError& e) {
    throw NonFiniteError(std::string(e.what()) + note);
  } catch (const TimeoutError& e) {
    throw TimeoutError(std::string(e.what()) + note);
  } catch (const PeerError& e) {
    throw PeerError(std::string(e.what()) + note);
  } catch (const InternalError& e) {
    throw InternalError(std::string(e.what()) + note);
  } catch (const std::exception& e) {
    throw Error(std::string(e.what()) + note);
  }
}

template <typename Fn>
std::exception_ptr Capture(Fn&& fn) {
  try {
    fn();
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

// Adds each MoE layer's routing sums of `from` to `to` (taken as they are when `to` is empty).
void AddRouterSums(const std::vector<moe::RouterSums>& from, std::vector<moe::RouterSums>& to) {
  if (to.empty()) {
    to = from;
    return;
  }
  SY_CHECK(to.size() == from.size(), "router sums of {} MoE layers, then {}", to.size(),
           from.size());
  for (size_t l = 0; l < from.size(); ++l) {
    std::vector<double> sum = to[l].ToVector();
    const std::vector<double> add = from[l].ToVector();
    SY_CHECK(sum.size() == add.size(), "router sums of {} values, then {}", sum.size(), add.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += add[i];
    to[l] = moe::RouterSums::FromVector(sum);
  }
}

}  // namespace

// The steps since the last metrics line, summed (reset at every line). Not in the anonymous
// namespace: Trainer::RunState holds one.
struct RunInterval {
  StepMetrics acc;
  std::vector<moe::RouterStats> last_router;  // the last step's (its expert bias)
  int64_t steps = 0, good = 0;                // steps, and those not skipped as non-finite
  double time = 0, moe = 0, moe_comm = 0;

  void Add(const StepMetrics& m) {
    if (steps == 0) {
      acc = StepMetrics{};
      acc.loss = acc.ce_loss = 0;
    }
    ++steps;
    time += m.step_time_s;
    if (std::isfinite(m.moe_time_s)) {
      moe += m.moe_time_s;
      moe_comm += m.moe_comm_s;
    }
    acc.skipped_steps += m.skipped_steps;
    if (m.skipped_steps == 0) {
      ++good;
      acc.loss += m.loss;
      acc.ce_loss += m.ce_loss;
      acc.aux_loss += m.aux_loss;
      acc.z_loss += m.z_loss;
    }
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
    AddRouterSums(m.router_sums, acc.router_sums);
    if (!m.router.empty()) last_router = m.router;
  }
  // The mean cross-entropy of the good steps (NaN: none).
  double MeanCe() const { return good > 0 ? acc.ce_loss / static_cast<double>(good) : NAN; }
  // The metrics line of the interval ending at `step` (`m` its last step's metrics), with `val`.
  StepMetrics Line(int64_t step, const StepMetrics& m, double val, bool moe_model,
                   int64_t tokens_per_step) const {
    const double n = static_cast<double>(steps), g = static_cast<double>(good);
    StepMetrics line = acc;
    line.step = step;
    line.loss = good > 0 ? acc.loss / g : NAN;
    line.ce_loss = good > 0 ? acc.ce_loss / g : NAN;
    line.aux_loss = good > 0 ? acc.aux_loss / g : NAN;
    line.z_loss = good > 0 ? acc.z_loss / g : NAN;
    for (auto& d : line.drop_rate) d /= n;
    line.router.clear();
    for (size_t l = 0; l < acc.router_sums.size(); ++l) {
      moe::RouterStats& st = line.router.emplace_back(acc.router_sums[l].Stats());
      if (l < last_router.size()) {  // the bias the interval ends with
        st.bias_min = last_router[l].bias_min;
        st.bias_max = last_router[l].bias_max;
      }
    }
    line.lr = m.lr;
    line.grad_norm = m.skipped_steps == 0 ? m.grad_norm : NAN;
    line.step_time_s = time / n;
    if (moe_model) {
      line.moe_time_s = moe / n;
      line.moe_comm_s = moe_comm / n;
    }
    line.tokens_per_s = time > 0 ? static_cast<double>(tokens_per_step) * n / time : NAN;
    line.val_loss = val;
    return line;
  }
  void Reset() {
    steps = good = 0;
    time = moe = moe_comm = 0;
  }
};

// Everything one Run keeps between its phases.
struct Trainer::RunState {
  const RunOptions& options;
  std::FILE* out = nullptr;
  std::string run_dir, checkpoints_dir;
  bool writer = false;
  RunDirectoryLock lock;
  bool resumed = false;
  bool resumes_own_run = false;  // the checkpoint is in run_dir/checkpoints
  int64_t resumed_step = -1;
  std::unique_ptr<MetricsWriter> metrics;
  std::vector<StepMetrics> history;
  bool moe = false;
  std::string title;  // of the figures
  std::optional<ProgressBar> bar;
  RunSummary summary;
  double last_val = NAN;
  double run_start = 0;
  int64_t first_step = 0;
  int64_t saved_step = -1;  // newest checkpoint in run_dir
  // This rank's memory account's peaks: before each checkpoint snapshot (the build and the
  // steps), and of the whole run until the account's peak was last reset (after a snapshot).
  int64_t train_peak = 0, run_peak = 0;
  std::string saved_dir;  // its directory (the writer's)
  int keep = 0;
  RunInterval interval;
  // Over the run's steps: MoE, tensor- and context-parallel times and bytes, the rates logged.
  double run_moe = 0, run_moe_comm = 0, run_rank_time = 0;
  double run_tp_bytes = 0, run_tp_comm = 0, run_tp_time = 0, run_cp_bytes = 0, run_cp_comm = 0;
  int64_t run_steps = 0;
  std::vector<double> rates;
  // Set when every rank is at the same point of a failure (the state after step_ steps is
  // whole on every rank), so that the ranks can still save it together.
  bool all_ranks_failed = false;

  explicit RunState(const RunOptions& o) : options(o) {}
};

bool Trainer::AnyFailed(const std::exception_ptr& error) {
  if (ctx_.world_size == 1) return error != nullptr;
  double failed[1] = {error ? 1.0 : 0.0};
  buffer_->AllReduceSum(failed);
  return failed[0] > 0;
}

void Trainer::StopIfAnyFailed(RunState& r, const std::exception_ptr& error) {
  if (!AnyFailed(error)) return;
  r.all_ranks_failed = true;
  if (error) std::rethrow_exception(error);
  throw Error(fmt::format("rank {}: stopped: the writer (rank 0) failed", ctx_.rank));
}

int Trainer::AgreedStop(const RunOptions& options) {
  // The signal some rank was asked to stop by (0: none), the same on every rank (collective
  // when a stop flag is given): each process of an MPI job sees its own signal, and ranks as
  // threads read the shared flag at different moments, so they agree after every step.
  if (options.stop_signal == nullptr) return 0;
  const int mine = options.stop_signal->load();
  if (ctx_.world_size == 1) return mine;
  double stop[2] = {mine != 0 ? 1.0 : 0.0, static_cast<double>(mine)};
  buffer_->AllReduceSum(stop);
  return stop[0] > 0 ? static_cast<int>(std::lround(stop[1] / stop[0])) : 0;
}

void Trainer::WriteFigures(const RunState& r) const {
  if (!r.writer) return;
  WriteLossSvg(r.run_dir + "/loss.svg", r.history, data_->unigram_entropy(), r.title);
  if (r.moe) {
    WriteExpertLoadSvg(r.run_dir + "/expert_load.svg", r.history,
                       fmt::format("tokens routed to each expert per {} steps", config_.log_every));
  }
}

void Trainer::OpenRunDirectory(RunState& r) {
  namespace fs = std::filesystem;
  const TrainConfig& c = config_;
  if (r.writer) RequireRunInputsOutsideRunDirectory(c, r.options.config_file, r.options.resume);
  // The writer owns the run directory for the whole run (run_dir.h), before reading anything
  // of it.
  if (r.writer) r.lock = RunDirectoryLock(r.run_dir);
  if (!r.options.resume.empty()) {
    const std::string dir = ResolveCheckpoint(r.options.resume);
    Restore(LoadCheckpoint(dir), "checkpoint " + dir);
    r.resumed = true;
    r.resumed_step = step_;
    std::error_code ec_from, ec_own;
    const fs::path from = fs::weakly_canonical(fs::path(dir), ec_from).parent_path();
    const fs::path own = fs::weakly_canonical(fs::path(r.checkpoints_dir), ec_own);
    r.resumes_own_run = !ec_from && !ec_own && from == own;
    if (r.writer) fmt::print(r.out, "resumed from {} at step {}\n", EscapeForTerminal(dir), step_);
  }
  if (!r.options.init_from.empty()) {
    SY_REQUIRE(r.options.resume.empty(), InvalidArgument,
               "--init-from starts a new run: it does not go with 'resume' ({})", r.options.resume);
    if (hf::IsHfDirectory(r.options.init_from)) {
      // Each rank reads only the parts of the tensors it holds (hf_names.h: LoadRankWeights).
      const hf::ModelConfig source = hf::ReadModelConfig(r.options.init_from);
      hf::LoadRankWeights(hf::CheckpointReader(r.options.init_from), &source, model_->parameters(),
                          *rank_->checkpoint);
    } else {
      CheckpointData init;
      init.config_json = TrainConfigToJson(c);
      init.model = hf::ReadInitFromWeights(r.options.init_from);
      Restore(init, "--init-from " + r.options.init_from);
    }
    if (r.writer) {
      fmt::print(r.out, "initialized from {}\n", EscapeForTerminal(r.options.init_from));
    }
  }
  if (!r.options.upcycle_from.empty()) {
    SY_REQUIRE(r.options.resume.empty() && r.options.init_from.empty(), InvalidArgument,
               "--upcycle-from starts a new run: it does not go with 'resume' or --init-from");
    CheckpointData init;
    init.config_json = TrainConfigToJson(c);
    // The new model as initialized (every rank gathers the full tensors: its fresh routers and
    // the shapes), then the dense weights put in.
    init.model = UpcycleWeights(ReadUpcycleWeights(r.options.upcycle_from), Snapshot().model, c,
                                {.zero_router = r.options.upcycle_zero_router});
    Restore(init, "--upcycle-from " + r.options.upcycle_from);
    if (r.writer) {
      fmt::print(r.out, "upcycled from {}\n", EscapeForTerminal(r.options.upcycle_from));
    }
  }
  if (!r.writer) return;
  std::error_code ec;
  // Only a run's own checkpoints continue it in place: anything else would truncate its
  // metrics and replace its checkpoints.
  if (fs::exists(r.checkpoints_dir + "/latest", ec)) {
    SY_REQUIRE(r.resumed, InvalidArgument,
               "run directory '{}' already holds a run with checkpoints: set 'resume' to {} to "
               "continue it, or choose another 'out'",
               r.run_dir, r.run_dir);
    SY_REQUIRE(r.resumes_own_run, InvalidArgument,
               "run directory '{}' holds another run with checkpoints, which resuming '{}' there "
               "would overwrite: leave 'out' unset to continue that checkpoint's own run, or "
               "choose a new 'out'",
               r.run_dir, r.options.resume);
  }
  if (r.resumes_own_run) {
    // Checkpoints after the resumed step belong to the continuation being abandoned: kept
    // aside, out of `latest` and of pruning.
    const std::string aside = SetAsideCheckpointsAfter(r.checkpoints_dir, step_);
    if (!aside.empty()) {
      fmt::print(r.out, "checkpoints after step {} (an abandoned continuation) moved to {}\n",
                 step_, aside);
    }
  }
  WriteTextFileAtomic(r.run_dir + "/config.json", TrainConfigToJson(c) + "\n");
  if (r.resumed) {
    for (auto& m : ReadMetrics(r.run_dir + "/metrics.jsonl")) {
      if (m.step <= step_) r.history.push_back(std::move(m));
    }
  }
  r.metrics = std::make_unique<MetricsWriter>(r.run_dir + "/metrics.jsonl", r.resumed ? step_ : -1);
}

void Trainer::BeginRun(RunState& r) {
  const TrainConfig& c = config_;
  r.out = r.options.out;
  run_out_ = r.out;
  r.run_dir = c.out;
  r.checkpoints_dir = r.run_dir + "/checkpoints";
  r.writer = ctx_.writes_run_directory();
  OpenRunDirectory(r);
  r.moe = model_->num_moe_blocks() > 0;
  const int64_t params = buffer_->ModelParameterCount();
  if (r.writer) {
    fmt::print(r.out,
               "model: {} parameters, {} layer(s), model_dim {}, {} heads, seq_len {}{}\n"
               "data: {}{}\n"
               "run: {} steps x {} sequences ({} tokens/step), {} compute thread(s), out {}\n",
               params, c.model.num_layers, c.model.model_dim, c.model.num_heads, c.model.seq_len,
               r.moe ? fmt::format(", MoE every {} blocks", c.model.moe_every) : "",
               EscapeForTerminal(data_->Description()),
               std::isfinite(data_->unigram_entropy())
                   ? fmt::format(", unigram entropy {:.3f} nats/byte", data_->unigram_entropy())
                   : "",
               c.steps, c.batch_size, c.batch_size * c.model.seq_len, threads_,
               EscapeForTerminal(r.run_dir));
    if (!data_->note().empty()) fmt::print(r.out, "{}\n", data_->note());
    if (!ctx_.description.empty()) fmt::print(r.out, "layout: {}\n", ctx_.description);
  }
  const bool interactive =
      r.options.interactive < 0 ? ProgressBar::IsTerminal(r.out) : r.options.interactive > 0;
  r.bar.emplace(r.out, interactive && r.writer, c.log_every);
  r.title = fmt::format("switchyard train: {} layers{}, d={}, {}", c.model.num_layers,
                        r.moe ? fmt::format(" (MoE every {}, {} experts, top-{})",
                                            c.model.moe_every, c.num_experts, c.top_k)
                              : "",
                        c.model.model_dim,
                        c.data.empty() ? std::string("fortunes") : EscapeForTerminal(c.data));
  RunSummary& summary = r.summary;
  summary.run_dir = r.run_dir;
  summary.unigram_entropy = data_->unigram_entropy();
  summary.bytes_per_token = data_->bytes_per_token();
  summary.parameters = params;
  summary.flops_per_token =
      TrainingFlopsPerToken(c.model, r.moe ? c.num_experts : 0, c.top_k, c.expert_hidden_dim);
  for (const StepMetrics& m : r.history) {
    summary.skipped_steps += m.skipped_steps;
    if (std::isfinite(m.ce_loss)) summary.final_train_ce_loss = m.ce_loss;
    if (std::isfinite(m.val_loss)) summary.final_val_ce_loss = m.val_loss;
  }
  r.last_val = summary.final_val_ce_loss;
  r.run_start = NowSeconds();
  r.first_step = step_;
  r.saved_step = r.resumes_own_run ? r.resumed_step : -1;
  r.keep = static_cast<int>(std::min<int64_t>(c.keep_checkpoints, INT32_MAX));
}

bool Trainer::RecordStep(RunState& r, const StepMetrics& m) {
  const TrainConfig& c = config_;
  // A stop asked for by a signal: this step is complete; it gets its metrics line and a
  // checkpoint, then the run returns.
  const int stop = AgreedStop(r.options);
  RunInterval& in = r.interval;
  in.Add(m);
  if (std::isfinite(m.moe_time_s)) {
    r.run_moe += m.moe_time_s;
    r.run_moe_comm += m.moe_comm_s;
    r.run_rank_time += m.rank_time_s;
  }
  r.summary.skipped_steps += m.skipped_steps;
  ++r.run_steps;
  r.run_tp_bytes += m.tp_bytes;
  r.run_tp_comm += m.tp_comm_s;
  r.run_tp_time += m.rank_time_s;
  r.run_cp_bytes += m.cp_bytes;
  r.run_cp_comm += m.cp_comm_s;
  double val = NAN;
  const bool last = step_ == c.steps;
  const bool evaluate =
      !data_->eval_batches().empty() && ((c.eval_every > 0 && step_ % c.eval_every == 0) || last);
  if (evaluate) {
    val = Evaluate();
    r.last_val = val;
  }
  const int64_t tokens_per_step = c.batch_size * c.model.seq_len;
  const double n = static_cast<double>(in.steps);
  const bool log_line = step_ % c.log_every == 0 || last || evaluate || stop != 0;
  // The writer's files: a failure here is the writer's alone until StopIfAnyFailed.
  StopIfAnyFailed(r, Capture([&] {
                    if (r.writer) WriteStepRecords(r, m, val, log_line, evaluate);
                  }));
  if (log_line) {
    if (in.time > 0) r.rates.push_back(static_cast<double>(tokens_per_step) * n / in.time);
    if (in.good > 0) r.summary.final_train_ce_loss = in.MeanCe();
  }
  if (r.writer) {
    // The progress bar cannot fail the run (it prints to the output stream).
    const double per_step =
        (NowSeconds() - r.run_start) / static_cast<double>(step_ - r.first_step);
    double drop = NAN;
    if (!m.drop_rate.empty()) {
      drop = 0;
      for (double d : m.drop_rate) drop += d / static_cast<double>(m.drop_rate.size());
    }
    r.bar->Update(ProgressInfo{
        .step = step_,
        .total = c.steps,
        .ce_loss = !log_line && in.good > 0 ? in.MeanCe() : r.summary.final_train_ce_loss,
        .val_loss = r.last_val,
        .skipped_steps = r.summary.skipped_steps,
        .tokens_per_s = r.rates.empty() ? m.tokens_per_s : r.rates.back(),
        .drop_rate = drop,
        .eta_s = per_step * static_cast<double>(c.steps - step_)});
  }
  if (log_line) in.Reset();
  if ((c.checkpoint_every > 0 && step_ % c.checkpoint_every == 0) || last || stop != 0) {
    // The peak of the build and the steps so far, before the snapshot gathers the whole model
    // and its optimizer state on this rank; the snapshot's own peak goes to the run's.
    const std::shared_ptr<MemoryAccount>& account = CurrentMemoryAccount();
    if (account) r.train_peak = std::max(r.train_peak, account->peak_bytes());
    {
      CheckpointData snap = Snapshot();
      StopIfAnyFailed(r, Capture([&] {
                        if (r.writer) {
                          r.saved_dir =
                              SaveCheckpoint(r.checkpoints_dir, snap, r.keep, r.resumed_step);
                        }
                      }));
    }
    if (account) {
      r.run_peak = std::max(r.run_peak, account->peak_bytes());
      account->ResetPeak();
    }
    r.saved_step = step_;
  }
  if (stop != 0) r.summary.stop_signal = stop;
  return stop == 0;
}

void Trainer::WriteStepRecords(RunState& r, const StepMetrics& m, double val, bool log_line,
                               bool evaluate) {
  const RunInterval& in = r.interval;
  if (std::isfinite(val)) {
    const double h = data_->unigram_entropy(), bpt = data_->bytes_per_token();
    r.bar->Print(fmt::format("step {}: val_ce_loss {:.4f}{}, {}", step_, val,
                             in.good > 0 ? fmt::format(" (train ce_loss {:.4f})", in.MeanCe()) : "",
                             std::isfinite(h) ? fmt::format("unigram entropy {:.3f}", h)
                             : std::isfinite(bpt)
                                 ? fmt::format("{:.4f} bits/byte", dataset::BitsPerByte(val, bpt))
                                 : std::string("bits/byte unknown")));
  }
  if (!log_line) return;
  StepMetrics line = in.Line(step_, m, val, r.moe, config_.batch_size * config_.model.seq_len);
  SetPerByteFigures(line, data_->bytes_per_token());
  r.metrics->Append(line);
  r.history.push_back(line);
  if (evaluate) WriteFigures(r);
}

void Trainer::FinishRun(RunState& r) {
  const TrainConfig& c = config_;
  RunSummary& summary = r.summary;
  summary.steps = step_;
  summary.seconds = NowSeconds() - r.run_start;
  summary.saved_activation_bytes = saved_activation_bytes_;
  summary.final_val_ce_loss = r.last_val;
  for (const StepMetrics& m : r.history) {
    for (size_t l = 0; l < m.router.size(); ++l) {
      if (summary.router_worst_step < 0 ||
          m.router[l].max_over_mean > summary.router_worst.max_over_mean) {
        summary.router_worst_step = m.step;
        summary.router_worst_layer = static_cast<int64_t>(l);
        summary.router_worst = m.router[l];
      }
    }
  }
  if (model_->tp_size() > 1 && r.run_steps > 0 && r.run_tp_time > 0) {
    summary.tp_bytes_per_step = r.run_tp_bytes / static_cast<double>(r.run_steps);
    summary.tp_comm_share = r.run_tp_comm / r.run_tp_time;
  }
  if (model_->cp_size() > 1 && r.run_steps > 0 && r.run_tp_time > 0) {
    summary.cp_bytes_per_step = r.run_cp_bytes / static_cast<double>(r.run_steps);
    summary.cp_comm_share = r.run_cp_comm / r.run_tp_time;
  }
  summary.memory_estimate_bytes = EstimateRankMemory(c).total();
  if (const std::shared_ptr<MemoryAccount>& account = CurrentMemoryAccount()) {
    // Every rank's peak so far (the model's build, the training steps, evaluations and
    // checkpoints), in rank order; then without the checkpoint snapshots.
    const size_t w = static_cast<size_t>(ctx_.world_size), me = static_cast<size_t>(ctx_.rank);
    std::vector<double> peaks(2 * w, 0.0);
    peaks[me] = static_cast<double>(std::max(r.run_peak, account->peak_bytes()));
    peaks[w + me] = static_cast<double>(std::max(r.train_peak, account->peak_bytes()));
    buffer_->AllReduceSum(peaks);
    const auto all = peaks.begin() + static_cast<std::ptrdiff_t>(w);
    summary.memory_peak_bytes = *std::max_element(peaks.begin(), all);
    summary.memory_peak_min_bytes = *std::min_element(peaks.begin(), all);
    summary.memory_train_peak_bytes = *std::max_element(all, peaks.end());
  }
  if (r.moe && r.run_rank_time > 0) {
    summary.moe_time_share = r.run_moe / r.run_rank_time;
    summary.moe_comm_share = r.run_moe_comm / r.run_rank_time;
  }
  if (!r.rates.empty()) {
    std::vector<double> sorted = r.rates;
    std::sort(sorted.begin(), sorted.end());
    summary.tokens_per_s = sorted[sorted.size() / 2];
  }
  if (c.sample_tokens > 0) summary.sample = Sample(c.sample_tokens);
  buffer_->FillSummary(&summary);
  if (rusage u{}; getrusage(RUSAGE_SELF, &u) == 0) summary.peak_rss_bytes = u.ru_maxrss * 1024;
  StopIfAnyFailed(r, Capture([&] {
                    if (r.writer) {
                      WriteFigures(r);
                      WriteRunEnd(summary, r.moe);
                    }
                  }));
}

std::string Trainer::SaveAfterFailure(RunState& r, const std::exception_ptr& error) {
  // A failure after training steps never throws them away: the last completed step is saved
  // (the update of a failed step is never half applied: NonFiniteError is thrown before it,
  // other failures after it), when every rank can take part.
  std::string note;
  if ((ctx_.world_size == 1 || r.all_ranks_failed) && step_ > r.first_step &&
      step_ > r.saved_step) {
    std::exception_ptr save_error = Capture([&] {
      CheckpointData snap = Snapshot();
      if (r.writer) {
        note = fmt::format(" (the last completed step {} was saved to {}: continue with 'resume')",
                           step_, SaveCheckpoint(r.checkpoints_dir, snap, r.keep, r.resumed_step));
      }
    });
    if (save_error) {
      try {
        std::rethrow_exception(save_error);
      } catch (const std::exception& e) {
        std::string first;
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& original) {
          first = original.what();
        } catch (...) {
        }
        // The same failure twice (a checkpoint that cannot be written) is said once.
        note = first == e.what()
                   ? fmt::format(" (saving the last completed step {} again failed the same way)",
                                 step_)
                   : fmt::format(" (saving the last completed step {} failed too: {})", step_,
                                 e.what());
      }
    }
  } else if (r.saved_step >= 0 && r.writer) {
    note =
        fmt::format(" (the newest checkpoint is step {} in {})", r.saved_step, r.checkpoints_dir);
  }
  if (!r.writer && r.all_ranks_failed) {
    // The writer reports the failure; wait for it to end the run (a collective it never
    // joins fails when it has thrown), so that its message is the one the user reads.
    Capture([&] {
      double wait[1] = {0};
      buffer_->AllReduceSum(wait);
    });
  }
  return note;
}

RunSummary Trainer::Run(const RunOptions& options) {
  RunState r(options);
  BeginRun(r);
  std::exception_ptr error;
  try {
    while (step_ < config_.steps) {
      StepMetrics m;
      try {
        m = Step();
      } catch (const NonFiniteError&) {
        r.all_ranks_failed = true;  // every rank detects it alike, before the update
        throw;
      }
      if (!RecordStep(r, m)) break;
    }
    r.bar->Finish();
    if (r.summary.stop_signal != 0) {
      r.summary.steps = step_;
      r.summary.seconds = NowSeconds() - r.run_start;
      if (r.writer) {
        fmt::print(r.out,
                   "stopped by signal {} after step {}: the last completed step was saved to {}: "
                   "continue with 'resume' {}\n",
                   r.summary.stop_signal, step_,
                   EscapeForTerminal(r.saved_dir.empty() ? r.checkpoints_dir : r.saved_dir),
                   EscapeForTerminal(r.run_dir));
      }
      return r.summary;
    }
    FinishRun(r);
  } catch (...) {
    error = std::current_exception();
  }
  if (!error) return r.summary;
  r.bar->Finish();
  RethrowWithNote(error, SaveAfterFailure(r, error));
}

}  // namespace switchyard::train
