#include "switchyard/train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "switchyard/core/clock.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/router_load_loss.h"
#include "switchyard/train/aux_counts.h"
#include "switchyard/train/generate.h"
#include "switchyard/train/memory_estimate.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/pipeline.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/weight_grad.h"
#include "train/rank_objects.h"
#include "train/step_sums.h"

namespace switchyard::train {

using nlohmann::json;

namespace {}  // namespace

uint64_t TrainingMemoryBytes(const TrainConfig& c, int ranks_in_process) {
  // Every rank of the process holds its layout's share (memory_estimate.h).
  return static_cast<uint64_t>(
      CheckedMul(EstimateRankMemory(c).total(), ranks_in_process, "training memory estimate"));
}

void RequireTrainingMemory(const TrainConfig& c, int ranks_in_process) {
  ValidateTrainConfig(c);  // the estimate's inputs
  const uint64_t bytes = TrainingMemoryBytes(c, ranks_in_process);
  RequireMemory(bytes, fmt::format("training (model, gradients, AdamW state and activations of "
                                   "{} rank(s): vocab_size {}, model_dim {}, {} layers)",
                                   ranks_in_process, c.model.vocab_size, c.model.model_dim,
                                   c.model.num_layers));
}

// ---- Trainer ----

Trainer::Trainer(TrainConfig config) : Trainer(std::move(config), nullptr, 1, ZeroOptions{}) {}

Trainer::Trainer(TrainConfig config, comm::Communicator& world, int ranks_in_process,
                 const ZeroOptions& zero)
    : Trainer(std::move(config), &world, ranks_in_process, zero) {}

Trainer::Trainer(TrainConfig config, comm::Communicator* world, int ranks_in_process,
                 const ZeroOptions& zero)
    : config_(std::move(config)),
      rank_(internal::BuildRankObjects(config_, world, ranks_in_process, zero)),
      buffer_(rank_->buffer.get()),
      ctx_(rank_->context) {
  const TrainConfig& c = config_;
  ValidateTrainConfig(c);
  RequireMemoryBudget(c);
  const TensorParallelContext tp = ctx_.tensor_parallel;
  ValidateBatchSplit(c, ctx_.data_size, tp.group != nullptr ? tp.group->size() : 1,
                     tp.options.sequence_parallel);
  threads_ =
      c.threads > 0 ? c.threads : ComputeThreadsPerRank(ctx_.ranks_in_process, UsableCores());
  // The train layer runs its GEMMs split over its own blocking worker pool with single-threaded
  // BLAS calls (src/train/parallel_for.h says why): the program sets one BLAS thread
  // (kernels::SetBlasThreads(1)) before training.

  // Everything the run will need is checked here, before the first step: the sizes and memory,
  // the data and its held-out split, the MoE layer's options, text generation.
  if (ctx_.world_size == 1 && ctx_.ranks_in_process == 1) {
    RequireTrainingMemory(c, 1);  // distributed runs check all ranks of the process up front
  }
  const moe::LayerConfig moe_layer =
      c.model.moe_every > 0 ? MoeLayerConfig(c) : moe::LayerConfig{};  // validates it
  check_finite_ = c.model.moe_every > 0 && moe_layer.check_finite;
  if (NumMoeBlocks(c.model) > 0) moe_layer_json_ = moe::ToJson(moe_layer);

  data_ = std::make_unique<TrainingData>(TrainingDataOptionsOf(c, ctx_.data_size));
  SY_REQUIRE(c.sample_tokens == 0 || c.model.vocab_size == data_->tokenizer().vocab_size(),
             InvalidArgument,
             "config: 'sample_tokens' {} generates text through the tokenizer {} (vocabulary {}), "
             "which needs vocab_size {}, got {}: set 'sample_tokens' to 0 to train without the "
             "final sample",
             c.sample_tokens, data_->tokenizer().name(), data_->tokenizer().vocab_size(),
             data_->tokenizer().vocab_size(), c.model.vocab_size);

  FeedForwardFactory moe_factory = std::move(rank_->moe_factory);
  if (moe_factory == nullptr && c.model.moe_every > 0) {
    moe_factory =
        MoeFeedForwardFactory([c](int64_t block) { return MoeBlockLayerConfig(c, block); });
  }
  // Every step runs its micro-batches through the pipeline executor: with one stage, each one's
  // forward then its backward (1F1B on one rank) on a one-rank group.
  ModelPartition partition;
  if (ctx_.pp_size > 1) {
    partition = PipelinePartition(c, ctx_.pp_rank);
    pipeline_ = parallel::MakeSchedule(PipelineScheduleConfig(c));
  } else {
    pipeline_ = parallel::MakeSchedule(
        parallel::ScheduleConfig{.stages = 1,
                                 .microbatches = static_cast<int>(c.microbatches),
                                 .virtual_stages = 1,
                                 .kind = parallel::ScheduleKind::k1F1B});
  }
  // Evaluation and sampling: one micro-batch through every chunk, forward only.
  forward_only_ = parallel::MakeSchedule(
      parallel::ScheduleConfig{.stages = pipeline_.config.stages,
                               .microbatches = 1,
                               .virtual_stages = pipeline_.config.virtual_stages,
                               .kind = parallel::ScheduleKind::kForwardOnly});
  ContextParallelContext cp = ctx_.context_parallel;
  cp.flash = ResolvedAttentionCore(c) == AttentionCore::kFlash;
  model_ = std::make_unique<TransformerLm>(c.model, c.seed, std::move(moe_factory), tp,
                                           std::move(partition), cp);
  model_->SetBlockObserver(buffer_);
  if (!c.router_trace.empty() || !c.router_replay.empty()) {
    SetRouterTrace(std::make_shared<RouterTrace>(
        RouterTraceOptionsFromConfig(c.router_trace, c.router_trace_steps, c.router_replay),
        ctx_.rank));
  }
  optimizer_ = AdamW(AdamWOptions{.beta1 = static_cast<float>(c.beta1),
                                  .beta2 = static_cast<float>(c.beta2),
                                  .eps = static_cast<float>(c.adam_eps),
                                  .weight_decay = static_cast<float>(c.weight_decay)});
  schedule_ = LrSchedule{.max_lr = static_cast<float>(c.lr),
                         .min_lr = static_cast<float>(c.min_lr),
                         .warmup_steps = c.warmup_steps,
                         .total_steps = c.steps};
  buffer_->Prepare(model_->parameters(), optimizer_);
}

Trainer::~Trainer() = default;

int64_t Trainer::optimizer_step() const { return buffer_->StepCount(optimizer_); }

ParamGradBuffer& Trainer::buffer() { return *buffer_; }

parallel::ProcessGroups& Trainer::groups() { return *rank_->groups; }

// What one step's micro-batches give, summed (this rank's part).
struct Trainer::StepTotals {
  double ce_sum = 0;  // sum over micro-batches of ce_loss x count (the head's chunk)
  double count = 0;
  double ffn = 0;  // sum over micro-batches and MoE blocks of the FFN loss terms
  double aux = 0;  // ... of l_aux
  double z = 0;    // ... of the z-loss
  int64_t nonfinite = 0;
  std::vector<internal::StepSums::Routing> routing;  // per MoE block of the model (ordinal)
  bool has_head = false;

  // aux_loss hf_concat: one micro-batch's loss over its concatenation (the head's chunk), in
  // the FFN terms and, counted once per MoE block as Add counts l_aux, in aux.
  void AddConcatAux(double aux_loss, double coef, int64_t moe_blocks) {
    ffn += coef * aux_loss;
    aux += aux_loss * static_cast<double>(moe_blocks);
  }

  void Add(const ModelConfig& model, const LmOutput& o, bool head) {
    if (head) {
      ce_sum += o.ce_loss * static_cast<double>(o.count);
      count += static_cast<double>(o.count);
      has_head = true;
    }
    ffn += o.loss - o.ce_loss;
    aux += o.aux_loss * static_cast<double>(o.routing.size());
    z += o.z_loss * static_cast<double>(o.routing.size());
    for (size_t i = 0; i < o.routing.size(); ++i) {
      int64_t ordinal = 0;
      for (int64_t b = 0; b < o.routing_blocks[i]; ++b) ordinal += IsMoeBlock(model, b) ? 1 : 0;
      routing[static_cast<size_t>(ordinal)].Add(o.routing[i]);
      nonfinite += o.routing[i].nonfinite_inputs;
    }
  }
};

void Trainer::SetRouterTrace(std::shared_ptr<RouterTrace> trace) {
  router_trace_ = std::move(trace);
  model_->SetRouterTrace(router_trace_.get());
}

void Trainer::RunMicrobatches(const std::vector<Batch>& batches,
                              const std::vector<int64_t>& row_begins, const ForwardOptions& options,
                              StepTotals* totals) {
  const int64_t m = static_cast<int64_t>(batches.size());
  // The objective is the mean over the micro-batches (equal sizes) of each one's loss.
  const float scale = 1.0f / static_cast<float>(m);
  const int64_t seq = config_.model.seq_len;
  const int v = model_->num_chunks();
  std::vector<std::vector<LmOutput>> outs(static_cast<size_t>(m),
                                          std::vector<LmOutput>(static_cast<size_t>(v)));
  // aux_loss hf_concat: each micro-batch's sums over its MoE blocks; with pipeline stages the
  // running sums travel with the activations and the totals back with the gradients, in
  // `payload` extra rows (aux_counts.h).
  const bool concat = UsesConcatAux(config_);
  const int64_t experts = config_.num_experts;
  const int64_t top_k = std::min(config_.top_k, experts);
  const int64_t payload =
      concat && ctx_.pp_size > 1 ? ConcatPayloadRows(experts, config_.model.model_dim) : 0;
  std::vector<std::shared_ptr<ConcatAuxTotals>> concat_totals(static_cast<size_t>(m));
  for (auto& t : concat_totals) {
    if (!concat) continue;
    t = std::make_shared<ConcatAuxTotals>();
    t->sums = moe::RouterLoadSums(experts, top_k);
  }
  parallel::PipelineStageCallbacks cb;
  cb.input_shape = [&](int mb, int) -> Shape {
    return {model_->ActivationRows(batches[static_cast<size_t>(mb)].tokens) + payload,
            config_.model.model_dim};
  };
  cb.forward = [&](int mb, int chunk, const Tensor& input) {
    const Batch& b = batches[static_cast<size_t>(mb)];
    ForwardOptions fo = options;
    fo.global_token_offset = row_begins[static_cast<size_t>(mb)] * seq;
    fo.concat_totals = concat_totals[static_cast<size_t>(mb)];
    moe::RouterLoadSums running(concat ? experts : 0, concat ? top_k : 0);
    Tensor x = input;
    if (payload > 0 && input.defined()) {
      running = ReadConcatSums(input, payload, experts, top_k);
      x = input.Slice(0, input.size(0) - payload);
    }
    if (ctx_.pp_size == 1) buffer_->BeginMicrobatch(mb, m);
    LmOutput o = model_->ForwardChunk(chunk, b.tokens, b.targets, x, fo);
    if (ctx_.pp_size == 1) {  // one micro-batch through the whole model
      saved_activation_bytes_ = std::max(saved_activation_bytes_, model_->SavedActivationBytes(o));
    }
    const bool head = model_->chunk_has_head(chunk);
    totals->Add(config_.model, o, head);
    if (concat) {
      for (const RoutingStats& r : o.routing) running.Add(r.concat_sums);
      if (head) {
        ConcatAuxTotals& t = *concat_totals[static_cast<size_t>(mb)];
        t.sums = running;
        t.ready = true;
        totals->AddConcatAux(moe::RouterLoadLoss(running), config_.aux_loss_coef,
                             NumMoeBlocks(config_.model));
      }
    }
    Tensor activation = std::move(o.activation);
    o.activation = Tensor();
    outs[static_cast<size_t>(mb)][static_cast<size_t>(chunk)] = std::move(o);
    if (payload > 0 && activation.defined()) {
      activation = AppendConcatSums(activation, running, payload);
    }
    return activation;
  };
  // Zero-bubble: B (input_only) queues the dense layers' weight-gradient GEMMs of its
  // (micro-batch, chunk) and the schedule's W runs them (train/weight_grad.h).
  std::vector<std::vector<WeightGradQueue>> deferred(
      static_cast<size_t>(m), std::vector<WeightGradQueue>(static_cast<size_t>(v)));
  cb.backward = [&](int mb, int chunk, const Tensor& grad_in, bool input_only) {
    LmOutput& o = outs[static_cast<size_t>(mb)][static_cast<size_t>(chunk)];
    Tensor grad = grad_in;
    if (payload > 0 && grad_in.defined()) {  // the totals, from the stage after this one
      ConcatAuxTotals& t = *concat_totals[static_cast<size_t>(mb)];
      t.sums = ReadConcatSums(grad_in, payload, experts, top_k);
      t.ready = true;
      grad = grad_in.Slice(0, grad_in.size(0) - payload);
    }
    Tensor dx;
    if (input_only) {
      DeferWeightGrads defer(deferred[static_cast<size_t>(mb)][static_cast<size_t>(chunk)]);
      dx = model_->BackwardChunk(o, grad, scale, threads_);
    } else {
      dx = model_->BackwardChunk(o, grad, scale, threads_);
    }
    o.state.reset();  // the activations of this micro-batch chunk are no longer needed
    if (payload > 0 && dx.defined()) {
      dx = AppendConcatSums(dx, concat_totals[static_cast<size_t>(mb)]->sums, payload);
    }
    return dx;
  };
  cb.backward_weight = [&](int mb, int chunk) {
    deferred[static_cast<size_t>(mb)][static_cast<size_t>(chunk)].Run();
  };
  parallel::RunSchedule(*ctx_.pipeline, pipeline_, cb);
}

internal::StepSums Trainer::SumOverRanks(const StepTotals& totals,
                                         const FeedForwardTimes& moe_times,
                                         const parallel::CommStats& tp_stats, double t0) {
  const TrainConfig& c = config_;
  const bool loss = ctx_.reports_loss && totals.has_head;
  const bool routing = ctx_.reports_routing;
  const double r_on = routing ? 1.0 : 0.0;
  internal::StepSums mine;
  mine.ce_sum = loss ? totals.ce_sum : 0.0;
  mine.tokens = loss ? totals.count : 0.0;
  mine.ffn_loss = r_on * totals.ffn;
  mine.aux_loss = r_on * totals.aux;
  mine.z_loss = r_on * totals.z;
  mine.moe_s = moe_times.seconds;
  mine.moe_comm_s = moe_times.comm_seconds;
  mine.nonfinite = static_cast<double>(totals.nonfinite);
  mine.rank_time_s = NowSeconds() - t0;
  mine.tp_bytes = tp_stats.Bytes(parallel::Traffic::kTensor);
  mine.tp_comm_s = tp_stats.CommSeconds(parallel::Traffic::kTensor);
  mine.cp_bytes = tp_stats.Bytes(parallel::Traffic::kContext);
  mine.cp_comm_s = tp_stats.CommSeconds(parallel::Traffic::kContext);
  std::vector<int64_t> experts;  // per MoE block
  for (int64_t b = 0, block = 0; block < c.model.num_layers; ++block) {
    if (!IsMoeBlock(c.model, block)) continue;
    // A rank that does not report routing (or holds no call of the block) adds zeros.
    internal::StepSums::Routing& sum = mine.routing.emplace_back();
    if (routing) sum = totals.routing[static_cast<size_t>(b)];
    ++b;
    experts.push_back(BlockExperts(c, block));
    sum.expert_loads.resize(static_cast<size_t>(experts.back()), 0.0);
    sum.expert_counts.resize(static_cast<size_t>(experts.back()), 0.0);
  }
  std::vector<double> packed = mine.Pack();
  buffer_->AllReduceSum(packed);
  return internal::StepSums::Unpack(packed, experts);
}

StepMetrics Trainer::Step() {
  const TrainConfig& c = config_;
  double t0 = NowSeconds();
  if (rank_->trace) rank_->trace->Begin(step_ + 1);
  const int64_t world = ctx_.world_size;
  const int64_t shards = ctx_.data_size, shard = ctx_.data_rank;
  // Micro-batch k is rows [k B / m, (k + 1) B / m) of the global batch; this data-parallel rank
  // takes its share of each, so that the micro-batch (over all ranks) is that of one rank.
  const int64_t m = c.microbatches, rows = c.batch_size / m;
  std::vector<Batch> batches;
  std::vector<int64_t> row_begins;
  for (int64_t k = 0; k < m; ++k) {
    const int64_t begin = k * rows + rows * shard / shards;
    const int64_t end = k * rows + rows * (shard + 1) / shards;
    batches.push_back(data_->Sample(step_, c.batch_size, begin, end));
    row_begins.push_back(begin);
  }
  if (batch_observer_) batch_observer_(step_, row_begins, batches);

  ParameterSet& params = model_->parameters();
  model_->TakeMoeTimes();  // drop what evaluation or sampling spent in the MoE layers
  model_->TakeTensorParallelStats();
  buffer_->BeginStep(params);
  ForwardOptions fo;
  fo.training = true;
  fo.save_for_backward = true;
  fo.step = static_cast<uint64_t>(step_);
  fo.threads = threads_;
  const int64_t moe_blocks = NumMoeBlocks(c.model);
  StepTotals totals;
  totals.routing.resize(static_cast<size_t>(moe_blocks));
  RunMicrobatches(batches, row_begins, fo, &totals);
  const FeedForwardTimes moe_times = model_->TakeMoeTimes();
  const parallel::CommStats tp_stats = model_->TakeTensorParallelStats();

  buffer_->ReduceGradients(params);
  double grad_norm = std::sqrt(buffer_->GradSquaredNorm());
  const float lr = schedule_.At(step_);

  // Global metrics (token-weighted losses, summed routing statistics, non-finite MoE inputs)
  // before the update, so that every rank decides alike whether to apply it. Each loss and
  // routing statistic is counted once per group of ranks that share it (tensor parallelism) and
  // by the stage that computes it (pipeline parallelism).
  const internal::StepSums sums = SumOverRanks(totals, moe_times, tp_stats, t0);
  StepMetrics met;
  met.step = step_ + 1;
  const double tokens = std::max(1.0, sums.tokens);
  // Each MoE block's terms are reported by routing_replicas() ranks, once per micro-batch.
  const double replicas = static_cast<double>(ctx_.routing_replicas) * static_cast<double>(m);
  met.ce_loss = sums.ce_sum / tokens;
  met.loss = met.ce_loss + sums.ffn_loss / replicas;
  met.aux_loss =
      moe_blocks > 0 ? sums.aux_loss / (replicas * static_cast<double>(moe_blocks)) : 0.0;
  met.z_loss = moe_blocks > 0 ? sums.z_loss / (replicas * static_cast<double>(moe_blocks)) : 0.0;
  if (moe_blocks > 0) {
    met.moe_time_s = sums.moe_s / static_cast<double>(world);
    met.moe_comm_s = sums.moe_comm_s / static_cast<double>(world);
  }
  if (sums.nonfinite > 0) {
    throw NonFiniteError(fmt::format(
        "step {}: {} non-finite values in the inputs of the MoE layers (check_finite is on in "
        "{}); the update was not applied",
        step_ + 1, sums.nonfinite,
        c.moe_layer_config.empty() ? "the MoE layer config" : c.moe_layer_config));
  }
  const bool finite = std::isfinite(met.loss) && std::isfinite(grad_norm);
  if (!finite && c.nonfinite == NonFinite::kStop) {
    throw NonFiniteError(fmt::format(
        "step {}: the loss is non-finite (loss {}, grad_norm {}); the update was not applied: "
        "lower 'lr', or set 'nonfinite' to 'skip' to skip such steps",
        step_ + 1, met.loss, grad_norm));
  }
  if (finite) {
    const float factor = ClipFactor(grad_norm, static_cast<float>(c.grad_clip));
    buffer_->ScaleGradients(factor);
    buffer_->Step(lr);
  } else {
    met.skipped_steps = 1;
  }
  buffer_->ReleaseParameters();
  ++step_;

  // Each rank's MoE time is part of its own step time (other ranks wait for the writer between
  // steps inside their first MoE collective): shares use the rank mean of both.
  met.rank_time_s = sums.rank_time_s / static_cast<double>(world);
  met.tp_bytes = sums.tp_bytes / static_cast<double>(world);
  met.tp_comm_s = sums.tp_comm_s / static_cast<double>(world);
  met.cp_bytes = sums.cp_bytes / static_cast<double>(world);
  met.cp_comm_s = sums.cp_comm_s / static_cast<double>(world);
  std::vector<std::vector<int64_t>> kept_counts;  // [moe block][expert] pairs kept in the step
  for (const internal::StepSums::Routing& r : sums.routing) {
    met.drop_rate.push_back(r.routed > 0 ? r.dropped / r.routed : 0.0);
    std::vector<int64_t> load, kept;
    for (double l : r.expert_loads) {
      load.push_back(CheckedToInt64(std::round(l), "expert load", 0, INT64_MAX));
    }
    for (double n : r.expert_counts) {
      kept.push_back(CheckedToInt64(std::round(n), "expert count", 0, INT64_MAX));
    }
    met.expert_load.push_back(std::move(load));
    met.router_sums.push_back(r.Sums());
    met.router.push_back(r.Stats());
    kept_counts.push_back(std::move(kept));
  }
  // The aux-loss-free bias follows Megatron-Core: the pairs each expert kept (after drops) in the
  // whole step, every micro-batch and rank; a skipped step changes no state.
  if (!kept_counts.empty() && finite) model_->EndStep(kept_counts);
  met.lr = lr;
  met.grad_norm = grad_norm;
  met.step_time_s = NowSeconds() - t0;
  if (met.step_time_s > 0) {
    met.tokens_per_s = static_cast<double>(c.batch_size * c.model.seq_len) / met.step_time_s;
  }
  if (router_trace_ != nullptr) router_trace_->EndStep(met.step);
  if (rank_->trace) rank_->trace->End(met.step);
  return met;
}

LmOutput Trainer::PipelineForward(const Tensor& tokens, const Tensor& targets,
                                  const ForwardOptions& options, bool keep_logits) {
  // One micro-batch through the forward-only schedule: every chunk of every stage in order, the
  // activations passed on by the executor.
  LmOutput result;
  parallel::PipelineStageCallbacks cb;
  cb.input_shape = [&](int, int) -> Shape {
    return {model_->ActivationRows(tokens), config_.model.model_dim};
  };
  cb.forward = [&](int, int chunk, const Tensor& input) {
    LmOutput o = model_->ForwardChunk(chunk, tokens, targets, input, options, keep_logits);
    if (model_->chunk_has_head(chunk)) {
      result = std::move(o);
      return Tensor();
    }
    return o.activation;
  };
  parallel::RunSchedule(*ctx_.pipeline, forward_only_, cb);
  return result;
}

double Trainer::Evaluate() {
  // Every rank takes its rows of every held-out batch (as in training), so that all ranks make
  // the same sequence of (collective) forwards; the head's stage reports the loss.
  const int64_t world = ctx_.data_size, rank = ctx_.data_rank;
  buffer_->GatherParameters();
  ForwardOptions fo;
  fo.training = false;
  fo.save_for_backward = false;
  fo.step = static_cast<uint64_t>(step_);
  fo.threads = threads_;
  std::vector<double> sums = {0, 0};
  for (const Batch& whole : data_->eval_batches()) {
    const int64_t rows = whole.tokens.size(0);
    const int64_t begin = rows * rank / world, end = rows * (rank + 1) / world;
    Batch b{whole.tokens.Slice(begin, end), whole.targets.Slice(begin, end)};
    fo.global_token_offset = begin * whole.tokens.size(1);
    LmOutput out = PipelineForward(b.tokens, b.targets, fo, false);
    if (out.count == 0 || !ctx_.reports_loss) continue;  // no rows, or not the loss's rank
    sums[0] += out.ce_loss * static_cast<double>(out.count);
    sums[1] += static_cast<double>(out.count);
  }
  buffer_->AllReduceSum(sums);
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

std::string Trainer::Sample(int64_t tokens, const std::string& prompt) {
  SampleOptions o;
  o.prompt = prompt;
  o.max_tokens = tokens;
  o.temperature = static_cast<float>(config_.temperature);
  o.seed = config_.seed;
  o.threads = threads_;
  buffer_->GatherParameters();
  // Pipelined: every step's logits come from the head's stage, broadcast to the others, so that
  // every rank draws the same tokens.
  ForwardOptions fo;
  fo.training = false;
  fo.save_for_backward = false;
  fo.threads = threads_;
  const LogitsFunction logits = [&](const Tensor& window) {
    LmOutput out = PipelineForward(window, Tensor(), fo, true);
    if (ctx_.pp_size == 1) return out.logits;
    comm::Communicator& group = *ctx_.pipeline;
    Tensor l = out.logits.defined() ? out.logits.Clone()
                                    : Tensor::Empty({window.numel(), config_.model.vocab_size});
    group.Broadcast(l, {.root = group.size() - 1}).Wait();
    return l;
  };
  const dataset::Tokenizer& tokenizer = data_->tokenizer();
  if (tokenizer.name() == "bytes") return GenerateText(config_.model, logits, o);
  // Through the tokenizer: the prompt encoded (empty: the end-of-document id, as after a
  // document), the ids generated decoded.
  std::vector<int32_t> ids = tokenizer.Encode(prompt);
  if (ids.empty()) ids.push_back(tokenizer.eod_id().value_or(0));
  return tokenizer.Decode(GenerateTokens(config_.model, logits, o, std::move(ids)));
}

}  // namespace switchyard::train
