// The training loop of one rank, the same code for every layout:
//   data (rows [rank * B / W, (rank + 1) * B / W) of step s's global batch)
//   -> the micro-batches' forward/backward through the pipeline executor (one stage: F then B per
//   micro-batch) -> buffer.ReduceGradients -> global-norm clip (norm reduced by the buffer)
//   -> buffer.Step (the sharded AdamW; ZeRO shards it) -> metrics (StepSums, one reduction).
// The trainer owns the objects of its rank's place in the run, built once from the config and
// the world: the process groups, the ParallelContext (parallel_context.h), the ParamGradBuffer
// (param_grad_buffer.h), the CheckpointLayout (checkpoint_layout.h) and the step trace. A
// trainer alone holds the same objects over a one-rank world (comm/self.h), every degree 1.
//
// Trainer::Run adds the run directory: config.json, metrics.jsonl, loss.svg, expert_load.svg
// (MoE models), checkpoints/, sample.txt, summary.json, and the progress bar.
//
// Determinism: every random draw is keyed by (seed, step, global index), so the same config and
// layout give the same losses, and a run resumed from the checkpoint of step k repeats the
// uninterrupted run's losses bit for bit (same thread count).
//
// Thread-safety: a Trainer belongs to one thread (its rank).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/parallel/pipeline.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/config.h"
#include "switchyard/train/data.h"
#include "switchyard/train/feed_forward.h"
#include "switchyard/train/metrics.h"
#include "switchyard/train/model.h"
#include "switchyard/train/optimizer.h"
#include "switchyard/train/parallel_context.h"
#include "switchyard/train/param_grad_buffer.h"
#include "switchyard/train/zero.h"

namespace switchyard::train {

struct RunSummary;
namespace internal {
struct StepSums;     // src/train/step_sums.h
struct RankObjects;  // src/train/rank_objects.h
}  // namespace internal

// An estimate of what training `config` allocates for `ranks_in_process` ranks of this
// process: each rank's EstimateRankMemory (memory_estimate.h: its shard of the parameters,
// gradients and AdamW state, its share of the activations). RequireTrainingMemory refuses
// (InvalidArgument, via core/limits.h RequireMemory) what does not fit in the memory available,
// before anything is allocated; sizes that overflow int64 are refused too.
uint64_t TrainingMemoryBytes(const TrainConfig& config, int ranks_in_process);
void RequireTrainingMemory(const TrainConfig& config, int ranks_in_process);

struct RunOptions {
  std::string resume;  // "" : fresh run; else a checkpoint, checkpoints or run directory
  // A fresh run that starts from these weights (step 0, fresh optimizer): a Hugging Face
  // directory or a switchyard checkpoint (hf_names.h, ReadInitFromWeights); each rank takes its
  // part (tp shards, its experts by global id, its stage's blocks). "": initialized as usual.
  // The model keys must already be the source's (InitFromModelKeysJson). Not with `resume`.
  std::string init_from;
  // A fresh MoE run upcycled from the dense model at this path (upcycle.h): a dense switchyard
  // checkpoint or a Hugging Face Llama / Qwen2 directory. The model keys must already hold the
  // source's (ReadUpcycleSource). Not with `resume` or `init_from`.
  std::string upcycle_from;
  bool upcycle_zero_router = false;  // the routers start at zero (uniform routing), not fresh
  // The --config file the run's keys came from ("": none): an input, like the data, that the
  // run's writes must never replace.
  std::string config_file;
  std::FILE* out = stdout;
  int interactive = -1;  // progress bar redraws in place: 1 yes, 0 no, -1 when `out` is a TTY
  // Set (to the signal's number) by a signal handler to stop the run (train/stop_signal.h): the
  // step under way finishes, the ranks agree on the step to stop after, the last completed step
  // is saved and Run returns with RunSummary::stop_signal set. Null: never stops early.
  const std::atomic<int>* stop_signal = nullptr;
};

// A step whose loss or gradient norm is not finite under nonfinite = "stop" (every rank throws
// it at the same point; the update was not applied).
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

struct RunSummary {
  int64_t steps = 0;
  double seconds = 0;
  // Cross-entropy (nats/token): the last log interval's mean with a finite value; the final
  // evaluation's.
  double final_train_ce_loss = NAN;
  double final_val_ce_loss = NAN;
  int64_t skipped_steps = 0;  // non-finite steps skipped (nonfinite = "skip"), over the run's life
  // The signal that stopped the run after `steps` steps (RunOptions::stop_signal); 0: it ran to
  // its end.
  int stop_signal = 0;
  double unigram_entropy = NAN;
  // UTF-8 bytes per token of the evaluated text (TrainingData::bytes_per_token): the losses in
  // bits per byte are final_*_ce_loss / (ln 2 * bytes_per_token).
  double bytes_per_token = NAN;
  double tokens_per_s = NAN;   // median over logged intervals
  double flops_per_token = 0;  // TrainingFlopsPerToken of the model
  int64_t parameters = 0;
  // Of the training steps' wall time (rank mean): in the MoE layers, and blocked in their
  // collectives (NaN for a dense model).
  double moe_time_share = NAN;
  double moe_comm_share = NAN;
  // Tensor parallelism: the layers' bytes on the wire per step and rank (bus convention), and
  // the share of step time blocked in their collectives (NaN without tensor parallelism).
  double tp_bytes_per_step = NAN;
  double tp_comm_share = NAN;
  // ZeRO buffers (distributed runs, zero.h): the largest over ranks of the peak bytes held by
  // the optimizer's arrays (parameters, gradients, state, reduction buffers; measured), that
  // rank's parts, and the formula figure for it (parameters + gradients + state per rank).
  int64_t zero_peak_bytes = 0;
  int64_t zero_peak_values = 0;
  int64_t zero_peak_gradients = 0;
  int64_t zero_peak_state = 0;
  int64_t zero_peak_scratch = 0;
  int64_t zero_formula_bytes = 0;
  // Gradient reduction per step (rank mean): time the bucket collectives ran (from the launch on
  // the rank to their end, waiting for later peers included), and the time the rank spent
  // blocked waiting for them. Hidden share: 1 - blocked / blocked without overlap.
  double grad_reduce_s = NAN;
  double grad_reduce_blocked_s = NAN;
  int64_t peak_rss_bytes = 0;  // this process (every rank thread in it)
  // Bytes of activations one micro-batch's forward kept for backward on this rank
  // (TransformerLm::SavedActivationBytes: what `recompute` and `precision` change).
  int64_t saved_activation_bytes = 0;
  // Context parallelism: the attention core's bytes per step and rank (Traffic::kContext) and
  // the share of step time blocked in them (NaN without context parallelism).
  double cp_bytes_per_step = NAN;
  double cp_comm_share = NAN;
  // MoE models: the metrics line and MoE layer (0-based ordinal) of the run's most imbalanced
  // routing (the largest RouterStats::max_over_mean over the logged lines) and its statistics
  // (-1: no line has router statistics).
  int64_t router_worst_step = -1;
  int64_t router_worst_layer = -1;
  moe::RouterStats router_worst;
  // Per rank: EstimateRankMemory's total, and the most tensor memory a rank held at once
  // (core/memory_account.h; max and min over ranks; NaN when no account was set, as in a
  // Trainer used without RunDistributedTraining).
  int64_t memory_estimate_bytes = 0;
  double memory_peak_bytes = NAN;
  double memory_peak_min_bytes = NAN;
  // The same peak (max over ranks) without the checkpoint snapshots: the model's build and the
  // training steps, what EstimateRankMemory estimates. (A snapshot gathers the whole model and
  // its AdamW state on every rank: docs/planner.md, "Accuracy on this machine".)
  double memory_train_peak_bytes = NAN;
  std::string sample;
  std::string run_dir;
};

class Trainer {
 public:
  // A trainer alone: one rank over a one-rank world of its own, every parallel degree 1 (the
  // config's layout keys do not act); its MoE blocks are the single-rank MoeFeedForward layers
  // of MoeLayerConfig(config). Loads the corpus and builds the model and optimizer. The program
  // runs BLAS single-threaded (kernels::SetBlasThreads(1)); the trainer splits its work over
  // `threads()` compute threads itself.
  explicit Trainer(TrainConfig config);
  // One rank of a distributed run over `world` (collective over it: builds the run's process
  // groups; the MoE blocks are parallel::ParallelMoeLayer over them). `ranks_in_process`: the
  // ranks sharing this process's cores; `zero`: ShardedAdamW's checking options (the buckets
  // come from the config). `world` must outlive the trainer.
  Trainer(TrainConfig config, comm::Communicator& world, int ranks_in_process,
          const ZeroOptions& zero = {});
  ~Trainer();

  const TrainConfig& config() const { return config_; }
  const ParallelContext& context() const { return ctx_; }
  TransformerLm& model() { return *model_; }
  // AdamW steps taken (the bias-correction count; restored from a checkpoint).
  int64_t optimizer_step() const;
  // The rank's parameters and gradients between backward and forward (reduction, ZeRO, the
  // sharded optimizers) and the run's process groups.
  ParamGradBuffer& buffer();
  parallel::ProcessGroups& groups();
  // The run's data: the batches it draws, the held-out set, the tokenizer.
  const TrainingData& data() const { return *data_; }
  // {"files": [...], "bytes": N, "fnv1a64": "..."}: the training and held-out data (recorded in
  // checkpoints; a resumed run must train on the same data).
  const std::string& data_identity() const { return data_->identity_json(); }
  double unigram_entropy() const { return data_->unigram_entropy(); }
  int threads() const { return threads_; }
  // Steps completed.
  int64_t step() const { return step_; }

  // One training step on this rank's rows of the global batch. Returns its metrics
  // (tokens_per_s and step_time_s of this step; no val_loss). A non-finite global loss or
  // gradient norm (or, with the MoE layer's check_finite, a non-finite MoE input) is detected
  // before the update on every rank alike: nonfinite = "stop" (and check_finite always) throws
  // NonFiniteError naming the step; "skip" returns skipped_steps = 1 without applying the update.
  StepMetrics Step();
  // Called by Step() with what this rank draws before it trains on it: the step (0-based), the
  // global row of each micro-batch's first row and the batches (tests of the determinism rule,
  // docs/data.md). None by default.
  using BatchObserver = std::function<void(int64_t step, const std::vector<int64_t>& row_begins,
                                           const std::vector<Batch>& batches)>;
  void set_batch_observer(BatchObserver observer) { batch_observer_ = std::move(observer); }
  // Mean cross-entropy over the held-out windows (NaN when the held-out text is too short).
  double Evaluate();

  // State for a checkpoint / restore from one. Snapshot's tensors share storage with the live
  // parameters and optimizer state: save them before the next Step. Restore checks that the
  // checkpoint's model, seed, batch size (ResumeMustMatchKeys) and data (DataIdentityJson:
  // size and checksum) match this trainer's (InvalidArgument listing every difference).
  // Restore also checks the MoE layer options that shape the parameters (gated, fc_bias,
  // residual_moe, shared_expert_hidden, expert_bias, recorded by checkpoints since they carry
  // moe_layer_json), naming each one that differs and `source` (the checkpoint, for messages).
  CheckpointData Snapshot();
  void Restore(const CheckpointData& data, const std::string& source = "the checkpoint");

  // `tokens` bytes generated by the current model at config.temperature, seeded by config.seed.
  std::string Sample(int64_t tokens, const std::string& prompt = "");

  // The whole run: trains from the current step (or from options.resume) to config.steps,
  // writing the run directory, and prints the progress and a final summary to options.out.
  // The writer owns the run directory for the run (run_dir.h: marker and lock; a directory that
  // is not a run's, or is owned by a live run, is refused). A fresh run refuses a run directory
  // that already has checkpoints (InvalidArgument). A run resumed from its own checkpoint sets
  // the checkpoints of later steps aside (SetAsideCheckpointsAfter) and never prunes the
  // resumed one. Failures after step >= 1: the last completed step is saved as a checkpoint
  // before the error is rethrown (its message then names the checkpoint) when the state is
  // known on every rank (one rank; a non-finite step; a failure of the writer's files); an error
  // inside a collective on some ranks only ends the run with the last periodic checkpoint.
  RunSummary Run(const RunOptions& options = {});

  // Records or replays the MoE layers' routes (router_trace.h) from the next step on; each step
  // ends with trace->EndStep. Null: neither.
  void SetRouterTrace(std::shared_ptr<RouterTrace> trace);

 private:
  // This step's micro-batches through the model (pipelined with pp > 1), gradients accumulated.
  struct StepTotals;
  void RunMicrobatches(const std::vector<Batch>& batches, const std::vector<int64_t>& row_begins,
                       const ForwardOptions& options, StepTotals* totals);
  // This step's figures summed over the ranks (collective): each loss and routing statistic
  // counted once per group of ranks that share it and by the stage that computes it.
  internal::StepSums SumOverRanks(const StepTotals& totals, const FeedForwardTimes& moe_times,
                                  const parallel::CommStats& tp_stats, double t0);
  Trainer(TrainConfig config, comm::Communicator* world, int ranks_in_process,
          const ZeroOptions& zero);
  // A forward of `tokens` through every stage (the forward-only schedule: the executor passes
  // the activations on); the head's stage returns its output (others an empty one). Collective
  // over the pipeline group.
  LmOutput PipelineForward(const Tensor& tokens, const Tensor& targets,
                           const ForwardOptions& options, bool keep_logits);
  // The phases of Run (trainer_run.cc), over the state they share.
  struct RunState;
  // Takes the run directory (resuming from options.resume) and prints the run's header.
  void BeginRun(RunState& r);
  void OpenRunDirectory(RunState& r);
  // After step `m`: its metrics line, evaluation, progress and checkpoint. False: a signal
  // asked the run to stop (the step was saved).
  bool RecordStep(RunState& r, const StepMetrics& m);
  // The writer's records of a step (the evaluation line, metrics.jsonl, the figures).
  void WriteStepRecords(RunState& r, const StepMetrics& m, double val, bool log_line,
                        bool evaluate);
  // The summary's figures and the run-end files, at the last step.
  void FinishRun(RunState& r);
  // After a failure: saves the last completed step when every rank can take part; returns the
  // note for the error's message.
  std::string SaveAfterFailure(RunState& r, const std::exception_ptr& error);
  // Whether any rank failed (collective): only the writer's own work can fail on one rank
  // without the others noticing; this makes every rank stop at the same point.
  bool AnyFailed(const std::exception_ptr& error);
  // Throws (`error`, or on the other ranks that the writer failed) when AnyFailed.
  void StopIfAnyFailed(RunState& r, const std::exception_ptr& error);
  // The stop signal some rank received (0: none), the same on every rank (collective).
  int AgreedStop(const RunOptions& options);
  void WriteFigures(const RunState& r) const;
  // The end of a run on the writer: sample.txt, summary.json and the final lines
  // (trainer_run_end.cc).
  void WriteRunEnd(const RunSummary& summary, bool moe) const;

  TrainConfig config_;
  // This rank's groups, buffer, checkpoint layout and trace (before the model: its blocks use
  // them).
  std::unique_ptr<internal::RankObjects> rank_;
  ParamGradBuffer* buffer_ = nullptr;  // rank_'s
  ParallelContext ctx_;
  std::FILE* run_out_ = stdout;  // Run's output stream
  int threads_ = 1;
  int64_t saved_activation_bytes_ = 0;  // the largest of the run's micro-batches
  std::unique_ptr<TrainingData> data_;
  BatchObserver batch_observer_;
  std::string moe_layer_json_;  // moe::ToJson of the MoE blocks' options ("" for a dense model)
  std::shared_ptr<RouterTrace> router_trace_;
  bool check_finite_ = false;  // the MoE layers' check_finite
  std::unique_ptr<TransformerLm> model_;
  AdamW optimizer_;  // the options of the buffer's sharded optimizers
  LrSchedule schedule_;
  // The schedule every step runs on the context's pipeline group (one stage: F then B per
  // micro-batch).
  parallel::Schedule pipeline_;
  parallel::Schedule forward_only_;  // evaluation and sampling: one micro-batch, forward only
  int64_t step_ = 0;
};

}  // namespace switchyard::train
