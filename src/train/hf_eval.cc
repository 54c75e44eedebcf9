// `switchyard eval`'s computation: a Hugging Face MoE model through TransformerLm on the ranks of
// any training layout, with the family's load-balancing loss over the concatenated router logits.
#include "switchyard/train/hf_eval.h"

#include <fmt/format.h>

#include <memory>
#include <utility>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/router_load_loss.h"
#include "switchyard/train/memory_estimate.h"
#include "switchyard/train/model.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/pipeline.h"
#include "train/rank_objects.h"

namespace switchyard::train::hf {
namespace {

using kernels::Trans;

// The router sums of the MoE layers: `mine` what this rank's forwards added (its rows, its
// stage's layers), `total` those of the whole concatenation (every layer, every rank's rows),
// which the backward uses.
struct RouterSums {
  moe::RouterLoadSums mine;
  moe::RouterLoadSums total;
};

// An MoE block with Hugging Face's load-balancing loss: the inner FFN computes the block (its own
// balancing loss weighted 0), and this adds scale * d aux / d logits through logits = x Wg^T,
// scale = coef x the data shards dp x cp (the gradient reduction divides by them).
class HfAuxFeedForward : public FeedForward {
 public:
  HfAuxFeedForward(std::unique_ptr<FeedForward> inner, Parameter* gate, int64_t top_k, float scale,
                   std::shared_ptr<RouterSums> sums)
      : inner_(std::move(inner)),
        gate_(gate),
        top_k_(top_k),
        scale_(scale),
        sums_(std::move(sums)) {}

  bool is_moe() const override { return true; }
  int64_t num_experts() const override { return inner_->num_experts(); }

  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override {
    auto state = std::make_shared<State>();
    state->inner = inner_->Forward(x, context);
    const int64_t n = x.size(0), m = x.size(1), e = gate_->value.size(0);
    state->x = x;
    state->logits = Tensor::Zeros({n, e});
    kernels::Gemm(Trans::kNo, Trans::kYes, n, e, m, 1.0f, x.data<float>(), m,
                  gate_->value.data<float>(), m, 0.0f, state->logits.data<float>(), e);
    sums_->mine.Add(moe::ComputeRouterLoadSums(state->logits, top_k_));
    FeedForwardOutput out = state->inner;
    out.state = state;
    return out;
  }

  // The aux term's gradient does not take loss_scale: the evaluation scales only the
  // cross-entropy by each rank's share of the counted tokens.
  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override {
    const auto& state = *static_cast<const State*>(forward.state.get());
    Tensor dx = inner_->Backward(state.inner, dy, loss_scale, threads);
    const int64_t n = state.x.size(0), m = state.x.size(1), e = gate_->value.size(0);
    Tensor dl = Tensor::Zeros({n, e});
    moe::RouterLoadLossBackward(state.logits, sums_->total, scale_, dl);
    // dx += dl Wg; dWg += dl^T x.
    kernels::Gemm(Trans::kNo, Trans::kNo, n, m, e, 1.0f, dl.data<float>(), e,
                  gate_->value.data<float>(), m, 1.0f, dx.data<float>(), m);
    kernels::Gemm(Trans::kYes, Trans::kNo, e, m, n, 1.0f, dl.data<float>(), e,
                  state.x.data<float>(), m, 1.0f, gate_->grad.data<float>(), m);
    return dx;
  }

 private:
  struct State {
    FeedForwardOutput inner;
    Tensor x;       // [n, M] the block's FFN input
    Tensor logits;  // [n, E]
  };
  std::unique_ptr<FeedForward> inner_;
  Parameter* gate_;
  int64_t top_k_;
  float scale_;
  std::shared_ptr<RouterSums> sums_;
};

// targets[b, t] = tokens[b, t + 1]; the last position of each row is ignored (-1).
Tensor ShiftedTargets(const Tensor& tokens) {
  const int64_t b = tokens.size(0), t = tokens.size(1);
  Tensor targets = Tensor::Empty({b, t}, DType::kInt32);
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t i = 0; i < t; ++i) {
      targets.data<int32_t>()[r * t + i] = i + 1 < t ? tokens.data<int32_t>()[r * t + i + 1] : -1;
    }
  }
  return targets;
}

void CheckTokens(const TrainConfig& config, const Tensor& tokens) {
  SY_REQUIRE(tokens.defined() && tokens.dtype() == DType::kInt32 && tokens.dim() == 2 &&
                 tokens.size(1) >= 2 && tokens.size(1) <= config.model.seq_len,
             InvalidArgument, "tokens: expected int32 [batch, T] with 2 <= T <= {}, got {}",
             config.model.seq_len, tokens.defined() ? tokens.ToString() : "none");
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    const int32_t id = tokens.data<int32_t>()[i];
    SY_REQUIRE(id >= 0 && id < config.model.vocab_size, InvalidArgument,
               "tokens: input_ids[{}][{}] = {} is outside the vocabulary [0, {})",
               i / tokens.size(1), i % tokens.size(1), id, config.model.vocab_size);
  }
}

// The evaluation's configuration: the model's keys, the layout's, one micro-batch, no ZeRO.
TrainConfig EvalConfig(const TrainConfig& config, int64_t batch) {
  TrainConfig c = config;
  c.aux_loss_coef = 0;  // the family's loss is the wrapper's
  c.zero_stage = 0;
  c.overlap_grad_reduce = false;
  c.microbatches = 1;
  c.batch_size = batch;
  c.trace_step = 0;
  return c;
}

// One rank's model and what its passes need.
struct EvalRank {
  TrainConfig config;
  std::unique_ptr<internal::RankObjects> objects;
  std::shared_ptr<RouterSums> sums;
  std::unique_ptr<TransformerLm> model;
  parallel::Schedule train_schedule;    // forward + backward, one micro-batch
  parallel::Schedule forward_schedule;  // forward only
  Tensor tokens, targets;               // this data shard's rows
  int64_t row_begin = 0;
};

void BuildModel(EvalRank& r, const EvalOptions& options) {
  const TrainConfig& c = r.config;
  const ParallelContext& ctx = r.objects->context;
  r.sums = std::make_shared<RouterSums>();
  r.sums->mine = moe::RouterLoadSums(c.num_experts, c.top_k);
  r.sums->total = r.sums->mine;
  FeedForwardFactory inner = r.objects->moe_factory;
  if (inner == nullptr) {
    inner = MoeFeedForwardFactory([c](int64_t b) { return MoeBlockLayerConfig(c, b); });
  }
  const parallel::Mesh& mesh = r.objects->groups->mesh();
  const auto scale = static_cast<float>(options.aux_coef * mesh.dp() * mesh.cp());
  FeedForwardFactory factory = [inner, sums = r.sums, scale, top_k = c.top_k](
                                   int64_t block, const std::string& prefix, ParameterSet& params,
                                   uint64_t seed) -> std::unique_ptr<FeedForward> {
    auto ffn = inner(block, prefix, params, seed);
    return std::make_unique<HfAuxFeedForward>(std::move(ffn), &params.Get(prefix + "gate.weight"),
                                              top_k, scale, sums);
  };
  ModelPartition partition;
  parallel::ScheduleConfig train{
      .stages = 1, .microbatches = 1, .virtual_stages = 1, .kind = parallel::ScheduleKind::k1F1B};
  if (ctx.pp_size > 1) {
    partition = PipelinePartition(c, ctx.pp_rank);
    train = PipelineScheduleConfig(c);
  }
  r.train_schedule = parallel::MakeSchedule(train);
  r.forward_schedule = parallel::MakeSchedule(
      parallel::ScheduleConfig{.stages = train.stages,
                               .microbatches = 1,
                               .virtual_stages = train.virtual_stages,
                               .kind = parallel::ScheduleKind::kForwardOnly});
  ContextParallelContext cp = ctx.context_parallel;
  cp.flash = ResolvedAttentionCore(c) == AttentionCore::kFlash;
  r.model = std::make_unique<TransformerLm>(c.model, c.seed, std::move(factory),
                                            ctx.tensor_parallel, std::move(partition), cp);
  r.model->SetBlockObserver(r.objects->buffer.get());
  r.objects->buffer->Prepare(r.model->parameters(), AdamW{});
}

// What one pass gives on this rank: the head chunk's output (loss fields, logits).
struct PassOutput {
  LmOutput head;
  bool has_head = false;
};

// One forward (and with `backward` its backward, gradients reduced) of this rank's rows through
// every stage. The head's cross-entropy gradient is scaled by D * count / N so that the
// reduction's mean over the D data shards gives the mean over all N counted tokens.
PassOutput RunPass(EvalRank& r, bool backward, bool keep_logits, int threads) {
  const ParallelContext& ctx = r.objects->context;
  TransformerLm& model = *r.model;
  ParamGradBuffer& buffer = *r.objects->buffer;
  const int64_t seq = r.tokens.size(1);
  // The data shards the gradient reduction divides by (dp x cp; with sequence parallelism the
  // tp ranks share their shard's loss).
  const double shards = r.objects->groups->mesh().dp() * r.objects->groups->mesh().cp();
  const double counted = static_cast<double>(r.config.batch_size * (seq - 1));
  ForwardOptions fo{.training = true,
                    .save_for_backward = true,
                    .step = 0,
                    .global_token_offset = r.row_begin * seq,
                    .threads = threads,
                    .concat_totals = nullptr};  // the wrapper computes the family's loss
  r.sums->mine = moe::RouterLoadSums(r.config.num_experts, r.config.top_k);
  if (backward) {
    buffer.BeginStep(model.parameters());
    if (ctx.pp_size == 1) buffer.BeginMicrobatch(0, 1);
  }
  PassOutput result;
  std::vector<LmOutput> outs(static_cast<size_t>(model.num_chunks()));
  parallel::PipelineStageCallbacks cb;
  cb.input_shape = [&](int, int) -> Shape {
    return {model.ActivationRows(r.tokens), r.config.model.model_dim};
  };
  cb.forward = [&](int, int chunk, const Tensor& input) {
    LmOutput o = model.ForwardChunk(chunk, r.tokens, r.targets, input, fo, keep_logits);
    Tensor activation = std::move(o.activation);
    o.activation = Tensor();
    if (model.chunk_has_head(chunk)) {
      result.head = o;
      result.has_head = true;
    }
    if (backward) outs[static_cast<size_t>(chunk)] = std::move(o);
    return activation;
  };
  cb.backward = [&](int, int chunk, const Tensor& grad, bool) {
    LmOutput& o = outs[static_cast<size_t>(chunk)];
    const float scale = model.chunk_has_head(chunk)
                            ? static_cast<float>(shards * static_cast<double>(o.count) / counted)
                            : 1.0f;
    Tensor dx = model.BackwardChunk(o, grad, scale, threads);
    o.state.reset();
    return dx;
  };
  cb.backward_weight = [](int, int) {};
  parallel::RunSchedule(*ctx.pipeline, backward ? r.train_schedule : r.forward_schedule, cb);
  if (backward) buffer.ReduceGradients(model.parameters());
  return result;
}

// Sums over the world, each figure counted once per group of ranks sharing it: the
// cross-entropy's [sum, count] (the head's stage, one rank of each tp group) and the router sums
// (one rank of each tp group without sequence parallelism).
struct WorldSums {
  double ce_sum = 0, count = 0;
  moe::RouterLoadSums router;
};
WorldSums SumOverWorld(EvalRank& r, const PassOutput& pass) {
  const ParallelContext& ctx = r.objects->context;
  std::vector<double> v = {0, 0};
  if (pass.has_head && ctx.reports_loss) {
    v[0] = pass.head.ce_loss * static_cast<double>(pass.head.count);
    v[1] = static_cast<double>(pass.head.count);
  }
  std::vector<double> router = r.sums->mine.ToVector();
  if (!ctx.reports_routing) router.assign(router.size(), 0.0);
  v.insert(v.end(), router.begin(), router.end());
  r.objects->buffer->AllReduceSum(v);
  WorldSums s;
  s.ce_sum = v[0];
  s.count = v[1];
  s.router = moe::RouterLoadSums::FromVector(r.config.num_experts, r.config.top_k,
                                             std::span<const double>(v).subspan(2));
  return s;
}

// logits [B, T, V] on every rank: each data shard's rows from the rank of its head stage with tp
// and cp rank 0 (the others add zeros).
Tensor GatherLogits(EvalRank& r, const PassOutput& pass, int64_t batch) {
  const ParallelContext& ctx = r.objects->context;
  const int64_t seq = r.tokens.size(1), vocab = r.config.model.vocab_size;
  Tensor all = Tensor::Zeros({batch * seq * vocab});
  if (pass.has_head && ctx.tp_rank == 0 && ctx.cp_rank == 0) {
    const Tensor& mine = pass.head.logits;
    SY_CHECK(mine.numel() == r.tokens.size(0) * seq * vocab, "logits {} for {} rows",
             mine.ToString(), r.tokens.size(0));
    all.Slice(r.row_begin * seq * vocab, r.row_begin * seq * vocab + mine.numel())
        .CopyFrom(mine.Reshape({mine.numel()}));
  }
  r.objects->groups->world().AllReduce(all).Wait();
  return all.Reshape({batch, seq, vocab});
}

}  // namespace

EvalResult EvaluateOnRank(const TrainConfig& config, comm::Communicator* world,
                          int ranks_in_process, const RankWeightLoader& load, const Tensor& tokens,
                          const EvalOptions& options) {
  CheckTokens(config, tokens);
  const int64_t batch = tokens.size(0), seq = tokens.size(1);
  EvalRank r;
  r.config = EvalConfig(config, batch);
  r.objects = internal::BuildRankObjects(r.config, world, ranks_in_process, ZeroOptions{});
  const ParallelContext& ctx = r.objects->context;
  SY_REQUIRE(batch % ctx.data_size == 0, InvalidArgument,
             "tokens: {} sequences do not split evenly over the {} data-parallel ranks (dp = "
             "ranks / (tp x cp x pp)): give a multiple of {} sequences",
             batch, ctx.data_size, ctx.data_size);
  r.row_begin = batch * ctx.data_rank / ctx.data_size;
  const int64_t row_end = batch * (ctx.data_rank + 1) / ctx.data_size;
  r.tokens = tokens.Slice(r.row_begin, row_end);
  r.targets = ShiftedTargets(tokens).Slice(r.row_begin, row_end);
  BuildModel(r, options);
  load(r.model->parameters(), *r.objects->checkpoint);

  // Without gradients one forward gives everything; with them, a first forward gathers the
  // router sums of the whole concatenation that the backward of every layer needs.
  PassOutput pass = RunPass(r, /*backward=*/false, /*keep_logits=*/!options.grads, options.threads);
  WorldSums sums = SumOverWorld(r, pass);
  if (options.grads) {
    r.sums->total = sums.router;
    pass = RunPass(r, /*backward=*/true, /*keep_logits=*/true, options.threads);
  }
  EvalResult result;
  result.logits = GatherLogits(r, pass, batch);
  result.ce_loss = sums.count > 0 ? sums.ce_sum / sums.count : 0.0;
  result.aux_loss = moe::RouterLoadLoss(sums.router);
  result.loss = result.ce_loss + options.aux_coef * result.aux_loss;
  SY_CHECK(sums.count == static_cast<double>(batch * (seq - 1)), "counted {} tokens of {}",
           sums.count, batch * (seq - 1));
  if (!options.grads) return result;
  ParameterSet& params = r.model->parameters();
  for (const Parameter& p : params.all()) {
    if (p.grad.defined()) result.grads[p.name] = p.grad.Clone();
  }
  r.objects->checkpoint->Gather(params, result.grads, {""});
  return result;
}

RankWeightLoader SliceFullWeights(const TensorMap& weights) {
  return [&weights](ParameterSet& params, const CheckpointLayout& layout) {
    TensorMap mine = weights;
    layout.Slice(params, mine, {""});
    params.LoadValues(mine, /*allow_extra=*/true);
  };
}

EvalResult EvaluateModel(const TrainConfig& config, const TensorMap& weights, const Tensor& tokens,
                         double aux_coef, bool grads, int threads) {
  return EvaluateOnRank(config, nullptr, 1, SliceFullWeights(weights), tokens,
                        EvalOptions{.aux_coef = aux_coef, .grads = grads, .threads = threads});
}

}  // namespace switchyard::train::hf
