#include "switchyard/train/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "switchyard/core/file_util.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/memory_account.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/cpu_features.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/train/generate.h"
#include "switchyard/train/memory_estimate.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/pipeline.h"
#include "switchyard/train/progress.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/run_dir.h"
#include "switchyard/train/weight_grad.h"

namespace switchyard::train {

using nlohmann::json;

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string DataIdentityJson(const Corpus& corpus) {
  std::vector<std::string> files;
  for (const std::string& f : corpus.files) {
    std::error_code ec;
    const std::filesystem::path p = std::filesystem::absolute(f, ec);
    files.push_back(ec ? f : p.lexically_normal().string());
  }
  // The hash of train then held-out bytes, without copying the corpus.
  const uint64_t hash = Fnv1a64(std::as_bytes(std::span(corpus.val)),
                                Fnv1a64(std::as_bytes(std::span(corpus.train))));
  json names = json::array();
  for (const std::string& f : files) names.push_back(json::parse(StringToJsonValue(f)));
  json j = {{"files", names},
            {"bytes", corpus.train.size() + corpus.val.size()},
            {"fnv1a64", fmt::format("{:016x}", hash)}};
  return j.dump();
}

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

Trainer::Trainer(TrainConfig config, FeedForwardFactory moe_factory, TrainHooks* hooks)
    : config_(std::move(config)), hooks_(hooks ? hooks : &default_hooks_) {
  const TrainConfig& c = config_;
  ValidateTrainConfig(c);
  RequireMemoryBudget(c);
  SY_REQUIRE(c.batch_size >= hooks_->data_size(), InvalidArgument,
             "config: batch_size {} must be >= the number of data-parallel ranks {}", c.batch_size,
             hooks_->data_size());
  threads_ =
      c.threads > 0 ? c.threads : ComputeThreadsPerRank(hooks_->ranks_in_process(), UsableCores());
  // The train layer runs its GEMMs split over its own blocking worker pool with single-threaded
  // BLAS calls (src/train/parallel_for.h says why): the program sets one BLAS thread
  // (kernels::SetBlasThreads(1)) before training.

  // Everything the run will need is checked here, before the first step: the sizes and memory,
  // the data and its held-out split, the MoE layer's options, text generation.
  SY_REQUIRE(c.model.vocab_size >= 256, InvalidArgument,
             "config: byte-level data needs vocab_size >= 256, got {}", c.model.vocab_size);
  SY_REQUIRE(c.sample_tokens == 0 || c.model.vocab_size == 256, InvalidArgument,
             "config: 'sample_tokens' {} generates bytes, which needs vocab_size 256, got {}: "
             "set 'sample_tokens' to 0 to train without the final sample",
             c.sample_tokens, c.model.vocab_size);
  SY_REQUIRE(c.eval_tokens == 0 || c.eval_tokens >= c.model.seq_len, InvalidArgument,
             "config: 'eval_tokens' {} is less than one evaluation window of seq_len {} tokens "
             "(0: all held-out tokens)",
             c.eval_tokens, c.model.seq_len);
  if (hooks_->world_size() == 1 && hooks_->ranks_in_process() == 1) {
    RequireTrainingMemory(c, 1);  // distributed runs check all ranks of the process up front
  }
  const moe::LayerConfig moe_layer =
      c.model.moe_every > 0 ? MoeLayerConfig(c) : moe::LayerConfig{};  // validates it
  check_finite_ = c.model.moe_every > 0 && moe_layer.check_finite;
  if (NumMoeBlocks(c.model) > 0) moe_layer_json_ = moe::ToJson(moe_layer);

  corpus_ = LoadRunCorpus(c.data, c.val_data, c.val_fraction, &corpus_note_);
  data_json_ = DataIdentityJson(corpus_);
  unigram_entropy_ = UnigramEntropy(corpus_.train);
  sampler_ = std::make_unique<BatchSampler>(corpus_.train, c.model.seq_len, c.seed);
  eval_batches_ = EvaluationBatches(corpus_.val, c.model.seq_len, c.batch_size, c.eval_tokens,
                                    hooks_->data_size());
  SY_REQUIRE((c.val_data.empty() && c.val_fraction == 0) || !eval_batches_.empty(), InvalidArgument,
             "data: the held-out text ({} bytes, {}) is shorter than one evaluation window of "
             "seq_len + 1 = {} tokens: use a longer text, a larger val_fraction or a smaller "
             "seq_len, or val_fraction 0 to train without a validation loss",
             corpus_.val.size(),
             c.val_data.empty() ? fmt::format("val_fraction {}", c.val_fraction)
                                : fmt::format("val_data {}", c.val_data),
             c.model.seq_len + 1);

  if (moe_factory == nullptr && c.model.moe_every > 0) {
    moe_factory =
        MoeFeedForwardFactory([c](int64_t block) { return MoeBlockLayerConfig(c, block); });
  }
  const TensorParallelContext tp = hooks_->tensor_parallel();
  // Every data-parallel rank's part of every micro-batch: at least one row, and with sequence
  // parallelism tokens that split evenly over the tensor-parallel ranks.
  {
    const int64_t shards = hooks_->data_size(), rows = c.batch_size / c.microbatches;
    SY_REQUIRE(rows >= shards, InvalidArgument,
               "config: a micro-batch of batch_size {} / microbatches {} = {} rows cannot be split "
               "over {} data-parallel ranks",
               c.batch_size, c.microbatches, rows, shards);
    const int64_t p = tp.group != nullptr ? tp.group->size() : 1;
    // With context parallelism a rank holds seq_len / cp positions of each sequence.
    const int64_t positions = c.model.seq_len / std::max<int64_t>(1, c.cp);
    for (int64_t d = 0; tp.options.sequence_parallel && d < shards; ++d) {
      const int64_t mine = rows * (d + 1) / shards - rows * d / shards;
      SY_REQUIRE(mine * positions % p == 0, InvalidArgument,
                 "config: sequence parallelism splits each data-parallel rank's tokens over 'tp' "
                 "{} ranks, but data-parallel rank {} has {} rows x seq_len {}{} = {} tokens per "
                 "micro-batch: choose batch_size (split over {} micro-batches and {} "
                 "data-parallel ranks) and seq_len so that they divide",
                 p, d, mine, c.model.seq_len,
                 c.cp > 1 ? fmt::format(" / cp {}", c.cp) : std::string(), mine * positions,
                 c.microbatches, shards);
    }
  }
  ModelPartition partition;
  if (hooks_->pipeline_stages() > 1) {
    SY_REQUIRE(hooks_->pipeline_group() != nullptr, InvalidArgument,
               "pipeline parallelism needs the hooks' pipeline group");
    partition = PipelinePartition(c, hooks_->pipeline_rank());
    pipeline_ = parallel::MakeSchedule(PipelineScheduleConfig(c));
  }
  ContextParallelContext cp = hooks_->context_parallel();
  cp.flash = ResolvedAttentionCore(c) == "flash";
  model_ = std::make_unique<TransformerLm>(c.model, c.seed, std::move(moe_factory), tp,
                                           std::move(partition), cp);
  model_->SetBlockObserver(hooks_->block_observer());
  if (!c.router_trace.empty() || !c.router_replay.empty()) {
    SetRouterTrace(std::make_shared<RouterTrace>(
        RouterTraceOptionsFromConfig(c.router_trace, c.router_trace_steps, c.router_replay),
        hooks_->rank()));
  }
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

// What one step's micro-batches give, summed (this rank's part).
struct Trainer::StepTotals {
  double ce_sum = 0;  // sum over micro-batches of ce_loss x count (the head's chunk)
  double count = 0;
  double ffn = 0;  // sum over micro-batches and MoE blocks of the FFN loss terms
  double aux = 0;  // ... of l_aux
  double z = 0;    // ... of the z-loss
  int64_t nonfinite = 0;
  std::vector<RoutingStats> routing;  // per MoE block of the model (ordinal), summed
  bool has_head = false;

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
      RoutingStats& acc = routing[static_cast<size_t>(ordinal)];
      const RoutingStats& r = o.routing[i];
      if (acc.expert_loads.empty()) acc.expert_loads.assign(r.expert_loads.size(), 0);
      for (size_t e = 0; e < r.expert_loads.size(); ++e) acc.expert_loads[e] += r.expert_loads[e];
      if (acc.expert_counts.empty()) acc.expert_counts.assign(r.expert_counts.size(), 0);
      for (size_t e = 0; e < r.expert_counts.size(); ++e) {
        acc.expert_counts[e] += r.expert_counts[e];
      }
      acc.routed += r.routed;
      acc.dropped += r.dropped;
      nonfinite += r.nonfinite_inputs;
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
  if (hooks_->pipeline_stages() == 1) {
    for (int64_t k = 0; k < m; ++k) {
      hooks_->BeginMicrobatch(k, m);
      ForwardOptions fo = options;
      fo.global_token_offset = row_begins[static_cast<size_t>(k)] * seq;
      LmOutput out = model_->Forward(batches[static_cast<size_t>(k)].tokens,
                                     batches[static_cast<size_t>(k)].targets, fo);
      saved_activation_bytes_ =
          std::max(saved_activation_bytes_, model_->SavedActivationBytes(out));
      model_->Backward(out, scale, threads_);
      totals->Add(config_.model, out, true);
    }
    return;
  }
  const int v = model_->num_chunks();
  std::vector<std::vector<LmOutput>> outs(static_cast<size_t>(m),
                                          std::vector<LmOutput>(static_cast<size_t>(v)));
  parallel::PipelineStageCallbacks cb;
  cb.input_shape = [&](int mb, int) -> Shape {
    return {model_->ActivationRows(batches[static_cast<size_t>(mb)].tokens),
            config_.model.model_dim};
  };
  cb.forward = [&](int mb, int chunk, const Tensor& input) {
    const Batch& b = batches[static_cast<size_t>(mb)];
    ForwardOptions fo = options;
    fo.global_token_offset = row_begins[static_cast<size_t>(mb)] * seq;
    LmOutput o = model_->ForwardChunk(chunk, b.tokens, b.targets, input, fo);
    totals->Add(config_.model, o, model_->chunk_has_head(chunk));
    Tensor activation = std::move(o.activation);
    o.activation = Tensor();
    outs[static_cast<size_t>(mb)][static_cast<size_t>(chunk)] = std::move(o);
    return activation;
  };
  // Zero-bubble: B (input_only) queues the dense layers' weight-gradient GEMMs of its
  // (micro-batch, chunk) and the schedule's W runs them (train/weight_grad.h).
  std::vector<std::vector<WeightGradQueue>> deferred(
      static_cast<size_t>(m), std::vector<WeightGradQueue>(static_cast<size_t>(v)));
  cb.backward = [&](int mb, int chunk, const Tensor& grad, bool input_only) {
    LmOutput& o = outs[static_cast<size_t>(mb)][static_cast<size_t>(chunk)];
    Tensor dx;
    if (input_only) {
      DeferWeightGrads defer(deferred[static_cast<size_t>(mb)][static_cast<size_t>(chunk)]);
      dx = model_->BackwardChunk(o, grad, scale, threads_);
    } else {
      dx = model_->BackwardChunk(o, grad, scale, threads_);
    }
    o.state.reset();  // the activations of this micro-batch chunk are no longer needed
    return dx;
  };
  cb.backward_weight = [&](int mb, int chunk) {
    deferred[static_cast<size_t>(mb)][static_cast<size_t>(chunk)].Run();
  };
  parallel::RunSchedule(*hooks_->pipeline_group(), pipeline_, cb);
}

StepMetrics Trainer::Step() {
  const TrainConfig& c = config_;
  double t0 = Now();
  hooks_->StepBegins(step_ + 1);
  const int64_t world = hooks_->world_size();
  const int64_t shards = hooks_->data_size(), shard = hooks_->data_rank();
  // Micro-batch k is rows [k B / m, (k + 1) B / m) of the global batch; this data-parallel rank
  // takes its share of each, so that the micro-batch (over all ranks) is that of one rank.
  const int64_t m = c.microbatches, rows = c.batch_size / m;
  std::vector<Batch> batches;
  std::vector<int64_t> row_begins;
  for (int64_t k = 0; k < m; ++k) {
    const int64_t begin = k * rows + rows * shard / shards;
    const int64_t end = k * rows + rows * (shard + 1) / shards;
    batches.push_back(sampler_->Sample(step_, c.batch_size, begin, end));
    row_begins.push_back(begin);
  }

  ParameterSet& params = model_->parameters();
  model_->TakeMoeTimes();  // drop what evaluation or sampling spent in the MoE layers
  model_->TakeTensorParallelStats();
  hooks_->BeginStep(params);
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

  hooks_->ReduceGradients(params);
  double grad_norm = std::sqrt(hooks_->GradSquaredNorm(params));
  const float lr = schedule_.At(step_);

  // Global metrics (token-weighted losses, summed routing statistics, non-finite MoE inputs)
  // before the update, so that every rank decides alike whether to apply it. Each loss and
  // routing statistic is counted once per group of ranks that share it (tensor parallelism) and
  // by the stage that computes it (pipeline parallelism).
  const bool loss = hooks_->reports_loss() && totals.has_head;
  const bool routing = hooks_->reports_routing();
  const double r_on = routing ? 1.0 : 0.0;
  std::vector<double> sums = {loss ? totals.ce_sum : 0.0,
                              loss ? totals.count : 0.0,
                              r_on * totals.ffn,
                              r_on * totals.aux,
                              r_on * totals.z,
                              moe_times.seconds,
                              moe_times.comm_seconds,
                              static_cast<double>(totals.nonfinite),
                              Now() - t0,
                              tp_stats.Bytes(parallel::Traffic::kTensor),
                              tp_stats.CommSeconds(parallel::Traffic::kTensor),
                              tp_stats.Bytes(parallel::Traffic::kContext),
                              tp_stats.CommSeconds(parallel::Traffic::kContext)};
  for (int64_t b = 0, block = 0; block < c.model.num_layers; ++block) {
    if (!IsMoeBlock(c.model, block)) continue;
    const RoutingStats& r = totals.routing[static_cast<size_t>(b++)];
    sums.push_back(r_on * static_cast<double>(r.routed));
    sums.push_back(r_on * static_cast<double>(r.dropped));
    const int64_t experts = BlockExperts(c, block);
    for (const std::vector<int64_t>* v : {&r.expert_loads, &r.expert_counts}) {
      for (int64_t e = 0; e < experts; ++e) {
        sums.push_back(static_cast<size_t>(e) < v->size()
                           ? r_on * static_cast<double>((*v)[static_cast<size_t>(e)])
                           : 0.0);
      }
    }
  }
  hooks_->AllReduceSum(sums);
  StepMetrics met;
  met.step = step_ + 1;
  const double tokens = std::max(1.0, sums[1]);
  // Each MoE block's terms are reported by routing_replicas() ranks, once per micro-batch.
  const double replicas = static_cast<double>(hooks_->routing_replicas()) * static_cast<double>(m);
  met.ce_loss = sums[0] / tokens;
  met.loss = met.ce_loss + sums[2] / replicas;
  met.aux_loss = moe_blocks > 0 ? sums[3] / (replicas * static_cast<double>(moe_blocks)) : 0.0;
  met.z_loss = moe_blocks > 0 ? sums[4] / (replicas * static_cast<double>(moe_blocks)) : 0.0;
  if (moe_blocks > 0) {
    met.moe_time_s = sums[5] / static_cast<double>(world);
    met.moe_comm_s = sums[6] / static_cast<double>(world);
  }
  if (sums[7] > 0) {
    throw NonFiniteError(fmt::format(
        "step {}: {} non-finite values in the inputs of the MoE layers (check_finite is on in "
        "{}); the update was not applied",
        step_ + 1, sums[7],
        c.moe_layer_config.empty() ? "the MoE layer config" : c.moe_layer_config));
  }
  const bool finite = std::isfinite(met.loss) && std::isfinite(grad_norm);
  if (!finite && c.nonfinite == "stop") {
    throw NonFiniteError(fmt::format(
        "step {}: the loss is non-finite (loss {}, grad_norm {}); the update was not applied: "
        "lower 'lr', or set 'nonfinite' to 'skip' to skip such steps",
        step_ + 1, met.loss, grad_norm));
  }
  if (finite) {
    const float factor = ClipFactor(grad_norm, static_cast<float>(c.grad_clip));
    hooks_->ScaleGradients(params, factor);
    hooks_->OptimizerStep(optimizer_, params, lr);
  } else {
    met.skipped_steps = 1;
  }
  hooks_->ReleaseParameters(params);
  ++step_;

  // Each rank's MoE time is part of its own step time (other ranks wait for the writer between
  // steps inside their first MoE collective): shares use the rank mean of both.
  met.rank_time_s = sums[8] / static_cast<double>(world);
  met.tp_bytes = sums[9] / static_cast<double>(world);
  met.tp_comm_s = sums[10] / static_cast<double>(world);
  met.cp_bytes = sums[11] / static_cast<double>(world);
  met.cp_comm_s = sums[12] / static_cast<double>(world);
  size_t k = 13;
  std::vector<std::vector<int64_t>> kept_counts;  // [moe block][expert] pairs kept in the step
  for (int64_t block = 0; block < c.model.num_layers; ++block) {
    if (!IsMoeBlock(c.model, block)) continue;
    double routed = sums[k], dropped = sums[k + 1];
    k += 2;
    met.drop_rate.push_back(routed > 0 ? dropped / routed : 0.0);
    std::vector<int64_t> load, kept;
    for (int64_t e = 0; e < BlockExperts(c, block); ++e) {
      load.push_back(CheckedToInt64(std::round(sums[k++]), "expert load", 0, INT64_MAX));
    }
    for (int64_t e = 0; e < BlockExperts(c, block); ++e) {
      kept.push_back(CheckedToInt64(std::round(sums[k++]), "expert count", 0, INT64_MAX));
    }
    met.expert_load.push_back(std::move(load));
    kept_counts.push_back(std::move(kept));
  }
  // The aux-loss-free bias follows Megatron-Core: the pairs each expert kept (after drops) in the
  // whole step, every micro-batch and rank; a skipped step changes no state.
  if (!kept_counts.empty() && finite) model_->EndStep(kept_counts);
  met.lr = lr;
  met.grad_norm = grad_norm;
  met.step_time_s = Now() - t0;
  if (met.step_time_s > 0) {
    met.tokens_per_s = static_cast<double>(c.batch_size * c.model.seq_len) / met.step_time_s;
  }
  if (router_trace_ != nullptr) router_trace_->EndStep(met.step);
  hooks_->StepEnds(met.step);
  return met;
}

LmOutput Trainer::PipelineForward(const Tensor& tokens, const Tensor& targets,
                                  const ForwardOptions& options, bool keep_logits) {
  if (hooks_->pipeline_stages() == 1) return model_->Forward(tokens, targets, options, keep_logits);
  // Forward only: chunk c of pipeline rank r is virtual stage s = c p + r; it takes its input
  // from the rank of stage s - 1 and passes its output to the rank of stage s + 1 (sends are
  // asynchronous, receives block: every rank runs its chunks in order, which cannot deadlock).
  comm::Communicator& group = *hooks_->pipeline_group();
  const int p = group.size(), r = group.rank();
  const int64_t last_stage = static_cast<int64_t>(p) * model_->num_chunks() - 1;
  const Shape shape = {model_->ActivationRows(tokens), config_.model.model_dim};
  constexpr uint32_t kTag = 0x5f0000;  // forward-only passes (no backward follows)
  std::vector<comm::Work> sends;
  std::vector<Tensor> keep;
  LmOutput result;
  for (int chunk = 0; chunk < model_->num_chunks(); ++chunk) {
    const int64_t stage = static_cast<int64_t>(chunk) * p + r;
    Tensor x;
    if (stage > 0) {
      x = Tensor::Empty(shape);
      group
          .Recv(x.raw(), static_cast<size_t>(x.numel()), DType::kFloat32, (r + p - 1) % p,
                {.tag = kTag})
          .Wait();
    }
    LmOutput o = model_->ForwardChunk(chunk, tokens, targets, x, options, keep_logits);
    if (stage == last_stage) {
      result = std::move(o);
    } else {
      keep.push_back(o.activation);
      sends.push_back(group.Send(o.activation.raw(), static_cast<size_t>(o.activation.numel()),
                                 DType::kFloat32, (r + 1) % p, {.tag = kTag}));
    }
  }
  for (const comm::Work& w : sends) w.Wait();
  return result;
}

double Trainer::Evaluate() {
  // Every rank takes its rows of every held-out batch (as in training), so that all ranks make
  // the same sequence of (collective) forwards; the head's stage reports the loss.
  const int64_t world = hooks_->data_size(), rank = hooks_->data_rank();
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
    LmOutput out = PipelineForward(b.tokens, b.targets, fo, false);
    if (out.count == 0 || !hooks_->reports_loss()) continue;  // no rows, or not the loss's rank
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
  d.data_json = data_json_;
  d.moe_layer_json = moe_layer_json_;
  d.model = hooks_->ModelValuesForCheckpoint(params);
  d.optimizer = hooks_->OptimizerStateForCheckpoint(optimizer_, params);
  return d;
}

namespace {

// The MoE layer options that decide which parameters an MoE block has.
constexpr const char* kMoeParameterKeys[] = {"gated", "fc_bias", "residual_moe",
                                             "shared_expert_hidden", "expert_bias"};

// Refuses (naming each key, both values, `source` and this run's layer file) a checkpoint whose
// MoE layer options (moe::ToJson) shape other parameters than this run's.
void RequireSameMoeParameters(const std::string& checkpoint_json, const std::string& run_json,
                              const std::string& source, const std::string& layer_file) {
  const json theirs = json::parse(checkpoint_json), ours = json::parse(run_json);
  std::vector<std::string> changed;
  for (const char* key : kMoeParameterKeys) {
    const json a = theirs.contains(key) ? theirs.at(key) : json();
    const json b = ours.contains(key) ? ours.at(key) : json();
    if (a != b) {
      changed.push_back(
          fmt::format("'{}': {} has {}, this run {}", key, source, a.dump(), b.dump()));
    }
  }
  SY_REQUIRE(changed.empty(), InvalidArgument,
             "resume: MoE layer options that shape the parameters differ from {}'s (this run's "
             "'moe_layer_config': {}): {}; give the options it was trained with",
             source, layer_file.empty() ? std::string("none, the defaults") : layer_file,
             fmt::join(changed, "; "));
}

}  // namespace

void Trainer::Restore(const CheckpointData& data, const std::string& source) {
  TrainConfig saved = TrainConfigFromJson(data.config_json.empty() ? "{}" : data.config_json);
  // What must match for the model to load and the run to continue identically: every
  // difference in one message.
  json mine = json::parse(TrainConfigToJson(config_));
  json theirs = json::parse(TrainConfigToJson(saved));
  std::vector<std::string> differences;
  for (const std::string& key : ResumeMustMatchKeys()) {
    if (mine[key] != theirs[key]) {
      differences.push_back(fmt::format("'{}': the checkpoint has {}, this run {}", key,
                                        theirs[key].dump(), mine[key].dump()));
    }
  }
  SY_REQUIRE(differences.empty(), InvalidArgument,
             "resume: {} settings differ from the checkpoint's (pass the checkpoint's values, or "
             "leave them out on the command line): {}",
             differences.size(), fmt::join(differences, "; "));
  if (!data.data_json.empty()) {
    const json a = json::parse(data.data_json), b = json::parse(data_json_);
    SY_REQUIRE(a.at("bytes") == b.at("bytes") && a.at("fnv1a64") == b.at("fnv1a64"),
               InvalidArgument,
               "resume: the checkpoint was trained on {} ({} bytes, fnv1a64 {}), this run's data "
               "is {} ({} bytes, fnv1a64 {}): set 'data' to the checkpoint's text",
               a.at("files").dump(), a.at("bytes").dump(), a.at("fnv1a64").dump(),
               b.at("files").dump(), b.at("bytes").dump(), b.at("fnv1a64").dump());
  }
  if (!data.moe_layer_json.empty() && !moe_layer_json_.empty()) {
    RequireSameMoeParameters(data.moe_layer_json, moe_layer_json_, source,
                             config_.moe_layer_config);
  }
  try {
    hooks_->LoadModelValues(model_->parameters(), data.model);
  } catch (const Error& e) {
    if (!data.moe_layer_json.empty() || moe_layer_json_.empty()) throw;
    // A checkpoint from before the MoE layer options were recorded.
    throw InvalidArgument(fmt::format(
        "resume: {} does not fit this run's model ({}); it does not record its MoE layer "
        "options: check that 'moe_layer_config' ({}) has the ones it was trained with",
        source, e.what(), config_.moe_layer_config.empty() ? "none" : config_.moe_layer_config));
  }
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
  if (hooks_->pipeline_stages() == 1) return GenerateText(*model_, o);
  // Pipelined: every step's logits come from the head's stage, broadcast to the others, so that
  // every rank draws the same tokens.
  ForwardOptions fo;
  fo.training = false;
  fo.save_for_backward = false;
  fo.threads = threads_;
  comm::Communicator& group = *hooks_->pipeline_group();
  return GenerateText(
      config_.model,
      [&](const Tensor& window) {
        LmOutput out = PipelineForward(window, Tensor(), fo, true);
        Tensor logits = out.logits.defined()
                            ? out.logits.Clone()
                            : Tensor::Empty({window.numel(), config_.model.vocab_size});
        group.Broadcast(logits, {.root = group.size() - 1}).Wait();
        return logits;
      },
      o);
}

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

}  // namespace

RunSummary Trainer::Run(const RunOptions& options) {
  namespace fs = std::filesystem;
  const TrainConfig& c = config_;
  std::FILE* out = options.out;
  run_out_ = out;
  const std::string run_dir = c.out;
  const std::string checkpoints_dir = run_dir + "/checkpoints";
  const bool writer = hooks_->writes_run_directory();
  if (writer) RequireRunInputsOutsideRunDirectory(c, options.config_file, options.resume);
  // The writer owns the run directory for the whole run (run_dir.h), before reading anything
  // of it.
  RunDirectoryLock lock;
  if (writer) lock = RunDirectoryLock(run_dir);
  bool resumed = false;
  bool resumes_own_run = false;  // the checkpoint is in run_dir/checkpoints
  int64_t resumed_step = -1;
  if (!options.resume.empty()) {
    const std::string dir = ResolveCheckpoint(options.resume);
    Restore(LoadCheckpoint(dir), "checkpoint " + dir);
    resumed = true;
    resumed_step = step_;
    std::error_code ec_from, ec_own;
    const fs::path from = fs::weakly_canonical(fs::path(dir), ec_from).parent_path();
    const fs::path own = fs::weakly_canonical(fs::path(checkpoints_dir), ec_own);
    resumes_own_run = !ec_from && !ec_own && from == own;
    if (writer) fmt::print(out, "resumed from {} at step {}\n", EscapeForTerminal(dir), step_);
  }
  std::unique_ptr<MetricsWriter> metrics;
  std::vector<StepMetrics> history;
  if (writer) {
    std::error_code ec;
    // Only a run's own checkpoints continue it in place: anything else would truncate its
    // metrics and replace its checkpoints.
    if (fs::exists(checkpoints_dir + "/latest", ec)) {
      SY_REQUIRE(resumed, InvalidArgument,
                 "run directory '{}' already holds a run with checkpoints: set 'resume' to {} to "
                 "continue it, or choose another 'out'",
                 run_dir, run_dir);
      SY_REQUIRE(resumes_own_run, InvalidArgument,
                 "run directory '{}' holds another run with checkpoints, which resuming '{}' there "
                 "would overwrite: leave 'out' unset to continue that checkpoint's own run, or "
                 "choose a new 'out'",
                 run_dir, options.resume);
    }
    if (resumes_own_run) {
      // Checkpoints after the resumed step belong to the continuation being abandoned: kept
      // aside, out of `latest` and of pruning.
      const std::string aside = SetAsideCheckpointsAfter(checkpoints_dir, step_);
      if (!aside.empty()) {
        fmt::print(out, "checkpoints after step {} (an abandoned continuation) moved to {}\n",
                   step_, aside);
      }
    }
    WriteTextFileAtomic(run_dir + "/config.json", TrainConfigToJson(c) + "\n");
    if (resumed) {
      for (auto& m : ReadMetrics(run_dir + "/metrics.jsonl")) {
        if (m.step <= step_) history.push_back(std::move(m));
      }
    }
    metrics = std::make_unique<MetricsWriter>(run_dir + "/metrics.jsonl", resumed ? step_ : -1);
  }
  const bool moe = model_->num_moe_blocks() > 0;
  const int64_t params = hooks_->ModelParameterCount(model_->parameters());
  if (writer) {
    fmt::print(out,
               "model: {} parameters, {} layer(s), model_dim {}, {} heads, seq_len {}{}\n"
               "data: {} ({} train / {} held-out bytes), unigram entropy {:.3f} nats/byte\n"
               "run: {} steps x {} sequences ({} tokens/step), {} compute thread(s), out {}\n",
               params, c.model.num_layers, c.model.model_dim, c.model.num_heads, c.model.seq_len,
               moe ? fmt::format(", MoE every {} blocks", c.model.moe_every) : "",
               c.data.empty() ? std::string("fortunes corpus") : EscapeForTerminal(c.data),
               corpus_.train.size(), corpus_.val.size(), unigram_entropy_, c.steps, c.batch_size,
               c.batch_size * c.model.seq_len, threads_, EscapeForTerminal(run_dir));
    if (!corpus_note_.empty()) fmt::print(out, "{}\n", corpus_note_);
    const std::string layout = hooks_->LayoutDescription();
    if (!layout.empty()) fmt::print(out, "layout: {}\n", layout);
  }
  bool interactive =
      options.interactive < 0 ? ProgressBar::IsTerminal(out) : options.interactive > 0;
  ProgressBar bar(out, interactive && writer, c.log_every);
  std::string title = fmt::format(
      "switchyard train: {} layers{}, d={}, {}", c.model.num_layers,
      moe ? fmt::format(" (MoE every {}, {} experts, top-{})", c.model.moe_every, c.num_experts,
                        c.top_k)
          : "",
      c.model.model_dim, c.data.empty() ? std::string("fortunes") : EscapeForTerminal(c.data));
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
  for (const StepMetrics& m : history) {
    summary.skipped_steps += m.skipped_steps;
    if (std::isfinite(m.ce_loss)) summary.final_train_ce_loss = m.ce_loss;
    if (std::isfinite(m.val_loss)) summary.final_val_ce_loss = m.val_loss;
  }
  double last_val = summary.final_val_ce_loss;
  const double run_start = Now();
  const int64_t first_step = step_;
  int64_t saved_step = resumes_own_run ? resumed_step : -1;  // newest checkpoint in run_dir
  std::string saved_dir;                                     // its directory (the writer's)
  const int keep = static_cast<int>(std::min<int64_t>(c.keep_checkpoints, INT32_MAX));
  // Whether any rank failed (collective). Only the writer's own work can fail on one rank
  // without the others noticing; this makes every rank stop at the same point.
  const int world = hooks_->world_size();
  auto any_failed = [&](const std::exception_ptr& error) {
    if (world == 1) return error != nullptr;
    double failed[1] = {error ? 1.0 : 0.0};
    hooks_->AllReduceSum(failed);
    return failed[0] > 0;
  };
  // The signal some rank was asked to stop by (0: none), the same on every rank (collective
  // when a stop flag is given): each process of an MPI job sees its own signal, and ranks as
  // threads read the shared flag at different moments, so they agree after every step.
  auto agreed_stop = [&]() -> int {
    if (options.stop_signal == nullptr) return 0;
    const int mine = options.stop_signal->load();
    if (world == 1) return mine;
    double stop[2] = {mine != 0 ? 1.0 : 0.0, static_cast<double>(mine)};
    hooks_->AllReduceSum(stop);
    return stop[0] > 0 ? static_cast<int>(std::lround(stop[1] / stop[0])) : 0;
  };
  // Interval accumulators (reset at every metrics line).
  StepMetrics acc;
  int64_t acc_steps = 0, acc_good = 0;
  double acc_time = 0, acc_moe = 0, acc_moe_comm = 0;
  double run_moe = 0, run_moe_comm = 0, run_rank_time = 0;
  double run_tp_bytes = 0, run_tp_comm = 0, run_tp_time = 0, run_cp_bytes = 0, run_cp_comm = 0;
  int64_t run_steps = 0;
  std::vector<double> rates;
  // Set when every rank is at the same point of a failure (the state after step_ steps is
  // whole on every rank), so that the ranks can still save it together.
  bool all_ranks_failed = false;
  std::exception_ptr error;
  try {
    while (step_ < c.steps) {
      StepMetrics m;
      try {
        m = Step();
      } catch (const NonFiniteError&) {
        all_ranks_failed = true;  // every rank detects it alike, before the update
        throw;
      }
      // A stop asked for by a signal: this step is complete; it gets its metrics line and a
      // checkpoint, then the run returns.
      const int stop = agreed_stop();
      if (acc_steps == 0) {
        acc = StepMetrics{};
        acc.loss = acc.ce_loss = 0;
      }
      ++acc_steps;
      acc_time += m.step_time_s;
      if (std::isfinite(m.moe_time_s)) {
        acc_moe += m.moe_time_s;
        acc_moe_comm += m.moe_comm_s;
        run_moe += m.moe_time_s;
        run_moe_comm += m.moe_comm_s;
        run_rank_time += m.rank_time_s;
      }
      acc.skipped_steps += m.skipped_steps;
      summary.skipped_steps += m.skipped_steps;
      ++run_steps;
      run_tp_bytes += m.tp_bytes;
      run_tp_comm += m.tp_comm_s;
      run_tp_time += m.rank_time_s;
      run_cp_bytes += m.cp_bytes;
      run_cp_comm += m.cp_comm_s;
      if (m.skipped_steps == 0) {
        ++acc_good;
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
      double val = NAN;
      const bool last = step_ == c.steps;
      const bool evaluate =
          !eval_batches_.empty() && ((c.eval_every > 0 && step_ % c.eval_every == 0) || last);
      if (evaluate) {
        val = Evaluate();
        last_val = val;
      }
      const double n = static_cast<double>(acc_steps), good = static_cast<double>(acc_good);
      const bool log_line = step_ % c.log_every == 0 || last || evaluate || stop != 0;
      // The writer's files: a failure here is the writer's alone until any_failed.
      std::exception_ptr writer_error = Capture([&] {
        if (!writer) return;
        if (std::isfinite(val)) {
          bar.Print(fmt::format(
              "step {}: val_ce_loss {:.4f}{}, unigram entropy {:.3f}", step_, val,
              acc_good > 0 ? fmt::format(" (train ce_loss {:.4f})", acc.ce_loss / good) : "",
              unigram_entropy_));
        }
        if (log_line) {
          StepMetrics line = acc;
          line.step = step_;
          line.loss = acc_good > 0 ? acc.loss / good : NAN;
          line.ce_loss = acc_good > 0 ? acc.ce_loss / good : NAN;
          line.aux_loss = acc_good > 0 ? acc.aux_loss / good : NAN;
          line.z_loss = acc_good > 0 ? acc.z_loss / good : NAN;
          for (auto& d : line.drop_rate) d /= n;
          line.lr = m.lr;
          line.grad_norm = m.skipped_steps == 0 ? m.grad_norm : NAN;
          line.step_time_s = acc_time / n;
          if (moe) {
            line.moe_time_s = acc_moe / n;
            line.moe_comm_s = acc_moe_comm / n;
          }
          line.tokens_per_s =
              acc_time > 0 ? static_cast<double>(c.batch_size * c.model.seq_len) * n / acc_time
                           : NAN;
          line.val_loss = val;
          metrics->Append(line);
          history.push_back(line);
          if (evaluate) write_figures();
        }
      });
      if (log_line) {
        if (acc_time > 0) {
          rates.push_back(static_cast<double>(c.batch_size * c.model.seq_len) * n / acc_time);
        }
        if (acc_good > 0) summary.final_train_ce_loss = acc.ce_loss / good;
      }
      if (writer && !writer_error) {
        const double elapsed = Now() - run_start;
        const double per_step = elapsed / static_cast<double>(step_ - first_step);
        double drop = NAN;
        if (!m.drop_rate.empty()) {
          drop = 0;
          for (double d : m.drop_rate) drop += d / static_cast<double>(m.drop_rate.size());
        }
        bar.Update(ProgressInfo{
            .step = step_,
            .total = c.steps,
            .ce_loss = !log_line && acc_good > 0 ? acc.ce_loss / good : summary.final_train_ce_loss,
            .val_loss = last_val,
            .skipped_steps = summary.skipped_steps,
            .tokens_per_s = rates.empty() ? m.tokens_per_s : rates.back(),
            .drop_rate = drop,
            .eta_s = per_step * static_cast<double>(c.steps - step_)});
      }
      if (log_line) {
        acc_steps = acc_good = 0;
        acc_time = acc_moe = acc_moe_comm = 0;
      }
      if (any_failed(writer_error)) {
        all_ranks_failed = true;
        if (writer_error) std::rethrow_exception(writer_error);
        throw Error(fmt::format("rank {}: stopped: the writer (rank 0) failed", hooks_->rank()));
      }
      if ((c.checkpoint_every > 0 && step_ % c.checkpoint_every == 0) || last || stop != 0) {
        CheckpointData snap = Snapshot();
        std::exception_ptr save_error = Capture([&] {
          if (writer) saved_dir = SaveCheckpoint(checkpoints_dir, snap, keep, resumed_step);
        });
        if (any_failed(save_error)) {
          all_ranks_failed = true;
          if (save_error) std::rethrow_exception(save_error);
          throw Error(fmt::format("rank {}: stopped: the writer (rank 0) failed", hooks_->rank()));
        }
        saved_step = step_;
      }
      if (stop != 0) {
        summary.stop_signal = stop;
        break;
      }
    }
    bar.Finish();
    if (summary.stop_signal != 0) {
      summary.steps = step_;
      summary.seconds = Now() - run_start;
      if (writer) {
        fmt::print(out,
                   "stopped by signal {} after step {}: the last completed step was saved to {}: "
                   "continue with 'resume' {}\n",
                   summary.stop_signal, step_,
                   EscapeForTerminal(saved_dir.empty() ? checkpoints_dir : saved_dir),
                   EscapeForTerminal(run_dir));
      }
      return summary;
    }
    summary.steps = step_;
    summary.seconds = Now() - run_start;
    summary.saved_activation_bytes = saved_activation_bytes_;
    summary.final_val_ce_loss = last_val;
    if (model_->tp_size() > 1 && run_steps > 0 && run_tp_time > 0) {
      summary.tp_bytes_per_step = run_tp_bytes / static_cast<double>(run_steps);
      summary.tp_comm_share = run_tp_comm / run_tp_time;
    }
    if (model_->cp_size() > 1 && run_steps > 0 && run_tp_time > 0) {
      summary.cp_bytes_per_step = run_cp_bytes / static_cast<double>(run_steps);
      summary.cp_comm_share = run_cp_comm / run_tp_time;
    }
    summary.memory_estimate_bytes = EstimateRankMemory(c).total();
    if (const std::shared_ptr<MemoryAccount>& account = CurrentMemoryAccount()) {
      // Every rank's peak so far (the training steps and evaluations), in rank order.
      std::vector<double> peaks(static_cast<size_t>(world), 0.0);
      peaks[static_cast<size_t>(hooks_->rank())] = static_cast<double>(account->peak_bytes());
      hooks_->AllReduceSum(peaks);
      summary.memory_peak_bytes = *std::max_element(peaks.begin(), peaks.end());
      summary.memory_peak_min_bytes = *std::min_element(peaks.begin(), peaks.end());
    }
    if (moe && run_rank_time > 0) {
      summary.moe_time_share = run_moe / run_rank_time;
      summary.moe_comm_share = run_moe_comm / run_rank_time;
    }
    if (!rates.empty()) {
      std::vector<double> sorted = rates;
      std::sort(sorted.begin(), sorted.end());
      summary.tokens_per_s = sorted[sorted.size() / 2];
    }
    if (c.sample_tokens > 0) summary.sample = Sample(c.sample_tokens);
    hooks_->FillSummary(&summary);
    if (rusage u{}; getrusage(RUSAGE_SELF, &u) == 0) summary.peak_rss_bytes = u.ru_maxrss * 1024;
    std::exception_ptr writer_error = Capture([&] {
      if (writer) {
        write_figures();
        WriteRunEnd(summary, moe);
      }
    });
    if (any_failed(writer_error)) {
      all_ranks_failed = true;
      if (writer_error) std::rethrow_exception(writer_error);
      throw Error(fmt::format("rank {}: stopped: the writer (rank 0) failed", hooks_->rank()));
    }
  } catch (...) {
    error = std::current_exception();
  }
  if (!error) return summary;
  bar.Finish();
  // A failure after training steps never throws them away: the last completed step is saved
  // (the update of a failed step is never half applied: NonFiniteError is thrown before it,
  // other failures after it), when every rank can take part.
  std::string note;
  if ((world == 1 || all_ranks_failed) && step_ > first_step && step_ > saved_step) {
    std::exception_ptr save_error = Capture([&] {
      CheckpointData snap = Snapshot();
      if (writer) {
        note = fmt::format(" (the last completed step {} was saved to {}: continue with 'resume')",
                           step_, SaveCheckpoint(checkpoints_dir, snap, keep, resumed_step));
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
  } else if (saved_step >= 0 && writer) {
    note = fmt::format(" (the newest checkpoint is step {} in {})", saved_step, checkpoints_dir);
  }
  if (!writer && all_ranks_failed) {
    // The writer reports the failure; wait for it to end the run (a collective it never
    // joins fails when it has thrown), so that its message is the one the user reads.
    Capture([&] {
      double wait[1] = {0};
      hooks_->AllReduceSum(wait);
    });
  }
  RethrowWithNote(error, note);
}

void Trainer::WriteRunEnd(const RunSummary& summary, bool moe) const {
  const TrainConfig& c = config_;
  const std::string& run_dir = summary.run_dir;
  std::FILE* out = run_out_;
  auto finite = [](double v) { return std::isfinite(v) ? json(v) : json(); };
  json s = {{"steps", summary.steps},
            {"seconds", summary.seconds},
            {"parameters", summary.parameters},
            {"unigram_entropy", finite(summary.unigram_entropy)},
            {"flops_per_token", summary.flops_per_token},
            {"tokens_per_s_median", finite(summary.tokens_per_s)},
            {"final_train_ce_loss", finite(summary.final_train_ce_loss)},
            {"final_val_ce_loss", finite(summary.final_val_ce_loss)},
            {"moe_time_share", finite(summary.moe_time_share)},
            {"moe_comm_share", finite(summary.moe_comm_share)},
            {"tp_bytes_per_step", finite(summary.tp_bytes_per_step)},
            {"tp_comm_share", finite(summary.tp_comm_share)},
            {"cp_bytes_per_step", finite(summary.cp_bytes_per_step)},
            {"cp_comm_share", finite(summary.cp_comm_share)},
            {"memory_estimate_bytes_per_rank", summary.memory_estimate_bytes},
            {"memory_peak_bytes_per_rank_max", finite(summary.memory_peak_bytes)},
            {"memory_peak_bytes_per_rank_min", finite(summary.memory_peak_min_bytes)},
            {"skipped_steps", summary.skipped_steps},
            {"grad_reduce_s", finite(summary.grad_reduce_s)},
            {"grad_reduce_blocked_s", finite(summary.grad_reduce_blocked_s)},
            {"peak_rss_bytes", summary.peak_rss_bytes},
            {"saved_activation_bytes", summary.saved_activation_bytes}};
  if (summary.zero_peak_bytes > 0) {
    s["zero_memory"] = {{"peak_bytes", summary.zero_peak_bytes},
                        {"parameters", summary.zero_peak_values},
                        {"gradients", summary.zero_peak_gradients},
                        {"optimizer_state", summary.zero_peak_state},
                        {"reduction_buffers", summary.zero_peak_scratch},
                        {"formula_bytes", summary.zero_formula_bytes}};
  }
  // Only what is known: a value that is not (no step ran, a dense model) is left out.
  for (auto it = s.begin(); it != s.end();) it = it->is_null() ? s.erase(it) : std::next(it);
  if (c.sample_tokens > 0) WriteTextFileAtomic(run_dir + "/sample.txt", summary.sample);
  WriteTextFileAtomic(run_dir + "/summary.json", s.dump(2) + "\n");
  std::string done =
      fmt::format("done: {} steps in {}", summary.steps, FormatDuration(summary.seconds));
  if (std::isfinite(summary.tokens_per_s) && summary.tokens_per_s > 0) {
    done += fmt::format(", {} tok/s (median), {:.1f} GFLOP/s of model FLOPs",
                        FormatRate(summary.tokens_per_s),
                        summary.tokens_per_s * summary.flops_per_token / 1e9);
  }
  if (summary.skipped_steps > 0) {
    done += fmt::format(", {} non-finite step(s) skipped", summary.skipped_steps);
  }
  fmt::print(out, "{}\n", done);
  fmt::print(out, "  GEMM backend: {}\n", kernels::GemmBackendName());
  if (std::string warning = kernels::GemmBackendWarning(); !warning.empty()) {
    fmt::print(out, "  {}\n", warning);
  }
  std::string losses;
  if (std::isfinite(summary.final_train_ce_loss)) {
    losses += fmt::format("train ce_loss {:.4f}", summary.final_train_ce_loss);
  }
  if (std::isfinite(summary.final_val_ce_loss)) {
    losses +=
        fmt::format("{}val_ce_loss {:.4f}", losses.empty() ? "" : ", ", summary.final_val_ce_loss);
  }
  if (!losses.empty()) {
    fmt::print(out, "  {} nats/byte; unigram entropy {:.3f}", losses, summary.unigram_entropy);
    if (std::isfinite(summary.final_val_ce_loss) && summary.unigram_entropy > 0) {
      fmt::print(out, " (val at {:.0f}% of it)",
                 100 * summary.final_val_ce_loss / summary.unigram_entropy);
    }
    fmt::print(out, "\n");
  }
  if (std::isfinite(summary.moe_time_share)) {
    fmt::print(out,
               "  MoE layers: {:.0f}% of step time (blocked in their collectives {:.0f}%, "
               "gate + dispatch + experts + combine {:.0f}%)\n",
               100 * summary.moe_time_share, 100 * summary.moe_comm_share,
               100 * (summary.moe_time_share - summary.moe_comm_share));
  }
  if (std::isfinite(summary.tp_bytes_per_step)) {
    fmt::print(out,
               "  tensor parallel: {:.2f} MB per step and rank on the wire, blocked in those "
               "collectives {:.0f}% of step time\n",
               summary.tp_bytes_per_step / 1e6, 100 * summary.tp_comm_share);
  }
  if (summary.zero_peak_bytes > 0) {
    const double mib = 1024.0 * 1024.0;
    fmt::print(out,
               "  ZeRO-{} memory per rank (peak of the largest rank, measured): {:.2f} MiB = "
               "parameters {:.2f} + gradients {:.2f} + optimizer state {:.2f} + reduction buffers "
               "{:.2f}; formula {:.2f} MiB; process peak RSS {:.1f} MiB\n",
               c.zero_stage, summary.zero_peak_bytes / mib, summary.zero_peak_values / mib,
               summary.zero_peak_gradients / mib, summary.zero_peak_state / mib,
               summary.zero_peak_scratch / mib, summary.zero_formula_bytes / mib,
               summary.peak_rss_bytes / mib);
  }
  if (std::isfinite(summary.grad_reduce_s) && summary.grad_reduce_s > 0) {
    // The collectives' run time counts from this rank's launch, waiting for later peers
    // included; the blocked time is what the step paid.
    fmt::print(out,
               "  gradient reduction: blocked {:.2f} ms per step and rank waiting for it "
               "(its collectives ran {:.2f} ms from launch to finish; overlap_grad_reduce {})\n",
               1e3 * summary.grad_reduce_blocked_s, 1e3 * summary.grad_reduce_s,
               !c.overlap_grad_reduce ? "off"
               : c.pp > 1             ? "on, but after the backward with pipeline stages"
                                      : "on");
  }
  if (summary.saved_activation_bytes > 0) {
    fmt::print(out,
               "  activations kept for backward: {:.2f} MiB per micro-batch (recompute {}, "
               "precision {}{})\n",
               static_cast<double>(summary.saved_activation_bytes) / (1 << 20),
               RecomputeName(c.model.recompute), PrecisionName(c.model.precision),
               moe ? "; MoE FFN state not counted" : "");
  }
  if (c.model.precision == Precision::kBFloat16) {
    const kernels::CpuFeatures& f = kernels::HostCpuFeatures();
    fmt::print(out,
               "  precision bf16: {}; the GEMMs convert bf16 operands to fp32 and run the fp32 "
               "kernel, so bf16 saves memory here, not time\n",
               f.avx512_bf16 || f.amx_bf16
                   ? "this CPU has bf16 arithmetic (AVX512-BF16/AMX), not used by this version"
                   : "this CPU has no bf16 arithmetic (no AVX512-BF16, no AMX)");
  }
  if (std::isfinite(summary.cp_bytes_per_step)) {
    fmt::print(out,
               "  context parallel (cp {}, {}): {:.2f} MB per step and rank on the wire, blocked "
               "in those collectives {:.0f}% of step time\n",
               c.cp, c.cp_algo, summary.cp_bytes_per_step / 1e6, 100 * summary.cp_comm_share);
  }
  std::string memory = fmt::format(
      "  memory per rank: estimate {} (attention_core {})",
      FormatBytes(static_cast<uint64_t>(summary.memory_estimate_bytes)), ResolvedAttentionCore(c));
  if (c.memory_budget_mib > 0) memory += fmt::format(", budget {} MiB", c.memory_budget_mib);
  if (std::isfinite(summary.memory_peak_bytes)) {
    memory += fmt::format("; measured peak of the tensors held {} (max over ranks; min {})",
                          FormatBytes(static_cast<uint64_t>(summary.memory_peak_bytes)),
                          FormatBytes(static_cast<uint64_t>(summary.memory_peak_min_bytes)));
  }
  fmt::print(out, "{}\n", memory);
  fmt::print(out, "  run directory: {} (metrics.jsonl, loss.svg{}, checkpoints/{}{})\n",
             EscapeForTerminal(run_dir), moe ? ", expert_load.svg" : "",
             c.sample_tokens > 0 ? ", sample.txt" : "",
             std::filesystem::exists(run_dir + "/trace.json") ? ", trace.json" : "");
  if (c.sample_tokens > 0) {
    fmt::print(out, "sample (temperature {}):\n{}\n", c.temperature,
               EscapeForTerminal(summary.sample));
  }
}

}  // namespace switchyard::train
