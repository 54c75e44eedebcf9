#include "switchyard/train/distributed.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <utility>

#include "switchyard/comm/agree.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/memory_account.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/gate.h"
#include "switchyard/parallel/expert_shard.h"
#include "switchyard/train/data.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/run_dir.h"
#include "switchyard/train/zero.h"
#include "train/step_trace.h"

namespace switchyard::train {
namespace {

// The expert tensors of an MoE block by their name after "experts." and their ExpertWeights slot.
struct ExpertField {
  const char* name;
  Tensor moe::ExpertWeights::*member;
};
constexpr ExpertField kExpertFields[] = {
    {"fc1.weight", &moe::ExpertWeights::fc1_weight}, {"fc1.bias", &moe::ExpertWeights::fc1_bias},
    {"fc2.weight", &moe::ExpertWeights::fc2_weight}, {"fc2.bias", &moe::ExpertWeights::fc2_bias},
    {"fc3.weight", &moe::ExpertWeights::fc3_weight},
};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Shape FullShape(const moe::LayerConfig& config, const std::string& name) {
  for (const auto& [n, shape] : moe::ParamShapes(config)) {
    if (n == name) return shape;
  }
  SY_CHECK(false, "no parameter '{}' in the MoE layer", name);
  return {};
}

void Scale(const Tensor& t, float factor) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] *= factor;
}

struct ParallelMoeState {
  parallel::ParallelOutput out;
};

// What every rank of an MPI run must agree on (comm/agree.h): every key of the config but those
// that may differ per rank ('out': only rank 0 writes the run directory; 'threads': this rank's
// compute threads), the content of the training text and of the MoE layer file, the resume point.
comm::ConfigEntries AgreementEntries(const TrainConfig& config, const RunOptions& run) {
  comm::ConfigEntries entries;
  const nlohmann::json j = nlohmann::json::parse(TrainConfigToJson(config));
  for (const auto& [key, value] : j.items()) {
    if (key == "out" || key == "threads") continue;
    entries.emplace_back(key, value.dump());
  }
  auto digest = [](const std::vector<std::string>& files) {
    std::string all;
    for (const std::string& f : files) {
      const std::vector<std::byte> bytes = ReadFileBytes(f);
      if (!all.empty()) all += ' ';
      all += comm::ContentDigest(bytes.data(), bytes.size());
    }
    return all;
  };
  entries.emplace_back("data (content)", digest(RunCorpusFiles(config.data, config.val_data)));
  if (!config.moe_layer_config.empty()) {
    entries.emplace_back("moe_layer_config (content)", digest({config.moe_layer_config}));
  }
  entries.emplace_back("resume", run.resume);
  return entries;
}

}  // namespace

parallel::Arrangement TrainArrangement(const TrainConfig& config) {
  if (config.arrangement == "megatron") return parallel::Arrangement::kMegatron;
  if (config.arrangement == "deepspeed") return parallel::Arrangement::kDeepSpeed;
  return config.sequence_parallel ? parallel::Arrangement::kMegatron
                                  : parallel::Arrangement::kDeepSpeed;
}

int TrainExpertParallelSize(const TrainConfig& config, int world_size) {
  if (config.ep > 0) return static_cast<int>(config.ep);
  const int tp = static_cast<int>(std::max<int64_t>(1, config.tp));
  const int etp = static_cast<int>(std::max<int64_t>(1, config.etp));
  // As large as the arrangement allows: DeepSpeed's EP groups sit inside the data-parallel ranks
  // of each tp rank, Megatron's fold over all ranks of the etp groups.
  const int pp = static_cast<int>(std::max<int64_t>(1, config.pp));
  if (TrainArrangement(config) == parallel::Arrangement::kMegatron) {
    return std::max(1, world_size / (etp * pp));
  }
  return std::max(1, world_size / (tp * pp));
}

parallel::ParallelOptions TrainParallelOptions(const TrainConfig& config, int world_size) {
  SY_REQUIRE(world_size >= 1, InvalidArgument, "ranks: expected >= 1, got {}", world_size);
  SY_REQUIRE(config.tp >= 1 && config.pp >= 1 && config.cp >= 1 &&
                 world_size % (config.tp * config.pp * config.cp) == 0,
             InvalidArgument,
             "config: 'tp' {} x 'pp' {} x 'cp' {} must divide the number of ranks {}", config.tp,
             config.pp, config.cp, world_size);
  const parallel::Arrangement arrangement = TrainArrangement(config);
  const int ep = TrainExpertParallelSize(config, world_size);
  SY_REQUIRE(world_size % ep == 0, InvalidArgument,
             "config: 'ep' {} must divide the number of ranks {}", ep, world_size);
  const int64_t e = config.num_experts;
  SY_REQUIRE(e % ep == 0 || ep % e == 0, InvalidArgument,
             "config: 'num_experts' {} and 'ep' {}: one must divide the other (E / ep experts per "
             "rank, or each expert split over ep / E ranks)",
             e, ep);
  // Every MoE block shares the run's process groups: each block's experts must split over the
  // ep ranks the same way (as many H-shards per expert: 1 when E >= ep, else ep / E).
  auto shards = [ep](int64_t experts) { return experts >= ep ? int64_t{1} : ep / experts; };
  for (int64_t block : config.experts_per_block) {
    SY_REQUIRE((block % ep == 0 || ep % block == 0) &&
                   shards(block) == shards(config.experts_per_block.front()),
               InvalidArgument,
               "config: 'experts_per_block' {} with 'ep' {}: every MoE block must split its "
               "experts over the ep ranks the same way (every count a multiple of ep, or every "
               "count the same divisor of ep)",
               fmt::format("[{}]", fmt::join(config.experts_per_block, ", ")), ep);
  }
  parallel::ParallelOptions o;
  o.mesh.world_size = world_size;
  o.mesh.tp = static_cast<int>(config.tp);
  o.mesh.pp = static_cast<int>(config.pp);
  o.mesh.cp = static_cast<int>(config.cp);
  o.mesh.ep = ep;
  o.mesh.etp = static_cast<int>(config.etp);
  o.mesh.arrangement = arrangement;
  if (config.tp > 1) o.mesh.sequence_parallel = config.sequence_parallel;
  o.dispatch = parallel::DispatchKindFromName(config.dispatch);
  o.batch_scope = parallel::BatchScopeFromName(config.routing_scope);
  o.overlap_degree = static_cast<int>(config.overlap_degree);
  if (config.a2a_algo == "2dh") {
    SY_REQUIRE(o.dispatch == parallel::DispatchKind::kAllToAll, InvalidArgument,
               "config: 'a2a_algo' 2dh is the fixed-capacity all-to-all's: it needs 'dispatch' "
               "alltoall, got \"{}\"",
               config.dispatch);
    // 0: the machine's ranks per node (RankTrainer takes them from the world's topology).
    o.hierarchical_ranks_per_node =
        config.a2a_ranks_per_node > 0 ? static_cast<int>(config.a2a_ranks_per_node) : world_size;
  }
  o.smart_group = parallel::SmartGroupFromString(config.smart_schedule);
  o.shadow = parallel::ShadowFromString(config.shadow_experts);
  return o;
}

// ---- ParallelMoeFeedForward ----

ParallelMoeFeedForward::ParallelMoeFeedForward(ParameterSet& params, const std::string& prefix,
                                               moe::LayerConfig config,
                                               const parallel::ParallelOptions& options,
                                               std::shared_ptr<parallel::ProcessGroups> groups,
                                               uint64_t seed)
    : layer_(config, options, std::move(groups)),
      prefix_(prefix),
      params_(&params),
      data_shards_(layer_.mesh().dp() * layer_.mesh().cp()) {
  // The single-rank MoeFeedForward's initial values (same seed derivation), then this rank's part.
  moe::LayerParams full = moe::InitParams(config, seed ^ (InitStream(prefix) - kStreamInit));
  shard_ = layer_.ShardParams(full);
  for (const auto& [name, tensor] : moe::ParamsToMap(config, shard_)) {
    ParamOptions o;
    o.group = name.starts_with("experts.") ? ParamGroup::kExpert : ParamGroup::kDense;
    o.weight_decay = tensor.dim() >= 2 && name.ends_with(".weight");
    o.trainable = name != "gate.expert_bias";
    params.Add(prefix + name, tensor, o);
  }
}

FeedForwardOutput ParallelMoeFeedForward::Forward(const Tensor& x,
                                                  const FeedForwardContext& context) {
  const double t0 = Now();
  parallel::ParallelForwardOptions o;
  o.global_token_offset = context.global_token_offset;
  if (context.token_index) o.token_index = *context.token_index;
  o.step = context.step;
  o.threads = context.threads;
  o.save_for_backward = context.save_for_backward;
  o.training = context.training;
  o.adaptive_r = AdaptiveRAtStep(adaptive_r_, static_cast<int64_t>(context.step));
  parallel::ParallelMoeLayer& layer = layer_;
  int64_t nonfinite = 0;
  if (layer.config().check_finite && x.dtype() == DType::kFloat32) {
    const float* p = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) nonfinite += std::isfinite(p[i]) ? 0 : 1;
  }
  const bool global_aux = layer.config().aux_loss == moe::AuxLoss::kGlobal && context.training;
  const int64_t key = MicroBatchKey(context.global_token_offset, context.token_index.get());
  if (global_aux) o.aux_counts_so_far = aux_counts_.Before(context.step, key);
  TracedForward traced(router_trace_, prefix_, context.step, context.training, x.size(0),
                       context.global_token_offset, context.token_index.get(),
                       moe::EffectiveTopK(layer.config()));
  o.forced_experts = traced.forced;
  auto state = std::make_shared<ParallelMoeState>();
  RebindLayerParams(*params_, prefix_, &shard_);
  state->out = layer.Forward(shard_, x, o);
  traced.Record(state->out.layer, context.save_for_backward);
  if (global_aux) aux_counts_.Add(context.step, key, state->out.layer.aux_counts);
  const moe::LayerOutput& out = state->out.layer;
  const moe::LayerConfig& c = layer.config();
  FeedForwardOutput r;
  r.y = out.y;
  r.aux_loss = out.l_aux;
  r.z_loss = out.z_loss;
  r.loss = static_cast<double>(c.aux_loss_coef) * out.l_aux +
           static_cast<double>(c.z_loss_coef) * out.z_loss;
  r.routing.expert_loads = out.expert_loads;
  r.routing.expert_counts = out.expert_counts;
  for (int64_t l : out.expert_loads) r.routing.routed += l;
  r.routing.dropped = out.dropped;
  r.routing.nonfinite_inputs = nonfinite;
  if (context.save_for_backward) r.state = state;
  times_.seconds += Now() - t0;
  times_.comm_seconds += state->out.stats.comm_seconds;
  return r;
}

Tensor ParallelMoeFeedForward::Backward(const FeedForwardOutput& forward, const Tensor& dy,
                                        float loss_scale, int threads) {
  SY_CHECK(forward.state != nullptr, "ParallelMoeFeedForward::Backward needs save_for_backward");
  SY_REQUIRE(loss_scale != 0.0f, InvalidArgument,
             "ParallelMoeFeedForward: loss_scale must not be 0");
  const double t0 = Now();
  const auto& s = *static_cast<const ParallelMoeState*>(forward.state.get());
  parallel::ParallelMoeLayer& layer = layer_;
  // The layer differentiates sum(y * d) + (this rank's share of) the loss terms. This rank must
  // contribute sum(y * dy) + D * loss_scale * share (distributed.h: gradients are summed over the
  // ranks and divided by D), so pass d = dy / (D * loss_scale) and scale the results back. In the
  // per-rank scope the layer differentiates this rank's own loss terms, whose mean over the D
  // shards is the objective's: the share is loss / D, so the factor is loss_scale alone. With
  // context parallelism the per-rank scope routes each cp group as one shard (cp ranks share its
  // loss terms, as the D ranks share the global ones): the factor is cp.
  const bool per_rank = layer.options().batch_scope == parallel::BatchScope::kPerRank;
  const float scale = static_cast<float>(per_rank ? layer.mesh().cp() : data_shards_) * loss_scale;
  Tensor d = dy;
  if (scale != 1.0f) {
    d = dy.Clone();
    Scale(d, 1.0f / scale);
  }
  RebindLayerParams(*params_, prefix_, &shard_);
  parallel::ParallelGradients g = layer.Backward(shard_, s.out, d, threads);
  for (const auto& [name, grad] : moe::ParamsToMap(layer.config(), g.params)) {
    Parameter& p = params_->Get(prefix_ + name);
    if (!p.options.trainable) continue;
    ExpectShape(p.name, grad, p.value.shape());
    float* dst = p.grad.data<float>();
    const float* src = grad.data<float>();
    for (int64_t i = 0; i < grad.numel(); ++i) dst[i] += scale * src[i];
  }
  Tensor dx = g.x;
  if (scale != 1.0f) Scale(dx, scale);
  times_.seconds += Now() - t0;
  times_.comm_seconds += g.stats.comm_seconds;
  return dx;
}

FeedForwardTimes ParallelMoeFeedForward::TakeTimes() {
  return std::exchange(times_, FeedForwardTimes{});
}

void ParallelMoeFeedForward::EndStep(std::span<const int64_t> global_expert_counts) {
  const moe::LayerConfig& c = layer_.config();
  if (!c.expert_bias) return;
  RebindLayerParams(*params_, prefix_, &shard_);
  moe::UpdateExpertBias(global_expert_counts, c.expert_bias_update_rate, shard_.expert_bias);
}

// ---- DistributedHooks ----

DistributedHooks::DistributedHooks(std::shared_ptr<parallel::ProcessGroups> groups, int zero_stage,
                                   int ranks_in_process, const ZeroOptions& zero,
                                   parallel::GroupKind expert_sync, TensorParallelOptions tp)
    : groups_(std::move(groups)),
      world_(groups_->world()),
      mesh_(groups_->mesh()),
      zero_stage_(zero_stage),
      ranks_in_process_(ranks_in_process),
      zero_options_(zero),
      tp_group_(groups_->Get(parallel::GroupKind::kTensor)),
      // The replicas of a tensor-parallel shard: the same tp rank over dp and cp (each cp rank
      // holds other tokens; with cp 1 the data-parallel group).
      data_(groups_->Get(parallel::GroupKind::kDataContext)),
      tokens_(groups_->Get(parallel::GroupKind::kTokens)),
      expert_data_(groups_->Get(expert_sync)),
      tp_options_(tp),
      coords_(mesh_.Coords(world_.rank())) {
  SY_REQUIRE(zero_stage >= 0 && zero_stage <= 3, InvalidArgument,
             "config: 'zero_stage' must be 0, 1, 2 or 3, got {}", zero_stage);
  SY_REQUIRE(expert_sync == parallel::GroupKind::kExpertData ||
                 expert_sync == parallel::GroupKind::kExpertHolders,
             InvalidArgument,
             "DistributedHooks: experts synchronize over ep_dp or "
             "expert_holders");
  SY_REQUIRE(tp.sequence_parallel == mesh_.sequence_parallel() || mesh_.tp() == 1, InvalidArgument,
             "DistributedHooks: the model's sequence parallelism ({}) is not the mesh's ({})",
             tp.sequence_parallel, mesh_.sequence_parallel());
}

DistributedHooks::~DistributedHooks() = default;

void DistributedHooks::SetPipeline(std::unique_ptr<comm::Communicator> stage, bool tied_embedding) {
  stage_owned_ = std::move(stage);
  stage_ = stage_owned_.get();
  tied_embedding_ = tied_embedding && mesh_.pp() > 1;
}

void DistributedHooks::AddMoeBlock(const std::string& prefix, const moe::LayerConfig& config) {
  moe_blocks_.push_back({prefix, config});
}

int DistributedHooks::rank() const { return world_.rank(); }

void DistributedHooks::SetStepTrace(int64_t step, const std::string& path) {
  trace_ = step > 0 ? std::make_unique<internal::StepTrace>(world_, step, path) : nullptr;
}

void DistributedHooks::AddTracedLayer(parallel::ParallelMoeLayer* layer) {
  if (trace_) trace_->AddLayer(layer);
}

void DistributedHooks::StepBegins(int64_t step) {
  if (trace_) trace_->Begin(step);
}

void DistributedHooks::StepEnds(int64_t step) {
  if (trace_) trace_->End(step);
}

int DistributedHooks::world_size() const { return world_.size(); }
int DistributedHooks::data_rank() const { return coords_.dp_rank; }
int DistributedHooks::data_size() const { return mesh_.dp(); }
bool DistributedHooks::reports_loss() const { return coords_.tp_rank == 0; }
bool DistributedHooks::reports_routing() const {
  return coords_.tp_rank == 0 || mesh_.sequence_parallel();
}

ContextParallelContext DistributedHooks::context_parallel() {
  if (mesh_.cp() == 1) return {};
  return ContextParallelContext{&groups_->Get(parallel::GroupKind::kContext), cp_options_};
}

comm::Communicator* DistributedHooks::pipeline_group() {
  return mesh_.pp() > 1 ? &groups_->Get(parallel::GroupKind::kPipeline) : nullptr;
}

TensorParallelContext DistributedHooks::tensor_parallel() {
  if (mesh_.tp() == 1) return {};
  return TensorParallelContext{&tp_group_, tp_options_};
}

int64_t DistributedHooks::optimizer_state_elements() const {
  int64_t n = 0;
  for (const auto* o : {split_opt_.get(), dense_opt_.get(), expert_opt_.get()}) {
    n += o != nullptr ? o->state_elements() : 0;
  }
  return n;
}

void DistributedHooks::Prepare(ParameterSet& params, const AdamW& optimizer) {
  if (dense_opt_) return;
  std::vector<Parameter*> split, dense, experts, copies;
  for (Parameter& p : params.all()) {
    if (!p.options.trainable) continue;
    if (p.tied_copy) {
      copies.push_back(&p);
    } else if (p.options.group == ParamGroup::kExpert) {
      experts.push_back(&p);
    } else {
      (p.tp_shard.split() ? split : dense).push_back(&p);
    }
  }
  auto count = [](const std::vector<Parameter*>& ps) {
    int64_t n = 0;
    for (const Parameter* p : ps) n += p->value.numel();
    return n;
  };
  for (const auto* list : {&split, &dense, &experts, &copies}) {
    for (Parameter* p : *list) owned_by_optimizer_.insert(p);
  }
  split_elements_ = count(split);
  dense_elements_ = count(dense);
  expert_elements_ = count(experts);
  ZeroOptions zero = zero_options_;
  zero.bucket_per_block = true;
  zero.meter = &meter_;
  // A tied copy is reduced like the parameter it copies (a tensor-parallel shard or not).
  SY_CHECK(copies.size() <= 1, "more than one tied copy");
  copy_opt_ = std::make_unique<ShardedAdamW>(
      copies, !copies.empty() && copies[0]->tp_shard.split() ? data_ : tokens_, zero_stage_,
      optimizer.options(), zero);
  split_opt_ = std::make_unique<ShardedAdamW>(split, data_, zero_stage_, optimizer.options(), zero);
  dense_opt_ =
      std::make_unique<ShardedAdamW>(dense, tokens_, zero_stage_, optimizer.options(), zero);
  expert_opt_ =
      std::make_unique<ShardedAdamW>(experts, expert_data_, zero_stage_, optimizer.options(), zero);
}

std::vector<ShardedAdamW*> DistributedHooks::Optimizers() const {
  if (!dense_opt_) return {};
  return {copy_opt_.get(), split_opt_.get(), dense_opt_.get(), expert_opt_.get()};
}

void DistributedHooks::BeginStep(ParameterSet& params) {
  SY_CHECK(dense_opt_ != nullptr, "DistributedHooks: Prepare() was not called");
  in_step_ = true;
  last_microbatch_ = true;
  ++steps_;
  if (zero_stage_ == 3) {
    // The blocks are gathered one at a time by BeforeBlock; the rest for the whole step.
    for (ShardedAdamW* o : Optimizers()) o->ReleaseParameters();
    const internal::StepTrace::Span span(trace_.get(), "parameter all-gather", "sync",
                                         parallel::TraceStream::kComm);
    for (ShardedAdamW* o : Optimizers()) o->PrefetchUnit(-1);
    for (ShardedAdamW* o : Optimizers()) o->GatherUnit(-1);
    gathered_ = false;
  }
  for (ShardedAdamW* o : Optimizers()) o->ZeroGradients();
  if (steps_ == 1) {
    // The peak is that of the training steps: the model was built with every value on every
    // rank and the gradients committed; from here on each stage holds what it keeps.
    meter_.Reset();
    meter_.Sample();
  }
  // Trainable parameters outside the optimizers (none today) still start from zero.
  for (Parameter& p : params.all()) {
    if (p.options.trainable && p.grad.defined() && p.grad.numel() > 0 &&
        !owned_by_optimizer_.contains(&p)) {
      p.grad.SetZero();
    }
  }
}

void DistributedHooks::BeforeBlock(int64_t block, bool backward) {
  if (!in_step_ || zero_stage_ != 3) return;
  {
    const internal::StepTrace::Span span(trace_.get(), "block parameter all-gather", "sync",
                                         parallel::TraceStream::kComm);
    for (ShardedAdamW* o : Optimizers()) o->PrefetchUnit(block);
    for (ShardedAdamW* o : Optimizers()) o->GatherUnit(block);
  }
  // The block that runs next on this rank (one pipeline stage: every block is this rank's).
  const int64_t next = backward ? block - 1 : block + 1;
  if (mesh_.pp() == 1) {
    for (ShardedAdamW* o : Optimizers()) {
      if (o->HasUnit(next)) o->PrefetchUnit(next);
    }
  }
}

void DistributedHooks::AfterBlock(int64_t block, bool backward) {
  if (!in_step_) return;
  if (zero_stage_ == 3) {
    for (ShardedAdamW* o : Optimizers()) o->ReleaseUnit(block);
  }
  if (backward && overlap_ && last_microbatch_ && mesh_.pp() == 1) {
    for (ShardedAdamW* o : Optimizers()) o->LaunchUnitReduction(block);
    const float inv = 1.0f / static_cast<float>(mesh_.dp() * mesh_.cp());
    for (ShardedAdamW* o : Optimizers()) o->FinishUnitReduction(block + 1, inv);
  }
}

ReductionTimes DistributedHooks::TakeReductionTimes() {
  ReductionTimes sum;
  for (ShardedAdamW* o : Optimizers()) {
    ReductionTimes t = o->TakeReductionTimes();
    sum.reduce_seconds += t.reduce_seconds;
    sum.blocked_seconds += t.blocked_seconds;
    sum.buckets += t.buckets;
    sum.overlapped += t.overlapped;
  }
  return sum;
}

int64_t DistributedHooks::FormulaBytes() const {
  int64_t bytes = 0;
  for (ShardedAdamW* o : Optimizers()) {
    const int64_t n = o->num_elements(), own = o->owned_elements();
    bytes += 4 * (zero_stage_ >= 3 ? own : n);  // parameters
    bytes += 4 * (zero_stage_ >= 2 ? own : n);  // gradients
    bytes += 8 * (zero_stage_ >= 1 ? own : n);  // exp_avg, exp_avg_sq
  }
  return bytes;
}

void DistributedHooks::FillSummary(RunSummary* summary) {
  const ReductionTimes t = TakeReductionTimes();
  run_times_.reduce_seconds += t.reduce_seconds;
  run_times_.blocked_seconds += t.blocked_seconds;
  run_times_.buckets += t.buckets;
  run_times_.overlapped += t.overlapped;
  // Per rank: the peak and its parts, the formula, the reduction times (one-hot rows, summed).
  const ZeroMemory& peak = meter_.peak();
  constexpr size_t kRow = 8;
  const size_t w = static_cast<size_t>(world_.size());
  std::vector<double> rows(kRow * w, 0.0);
  double* mine = rows.data() + kRow * static_cast<size_t>(world_.rank());
  mine[0] = static_cast<double>(peak.total());
  mine[1] = static_cast<double>(peak.values);
  mine[2] = static_cast<double>(peak.gradients);
  mine[3] = static_cast<double>(peak.state);
  mine[4] = static_cast<double>(peak.scratch);
  mine[5] = static_cast<double>(FormulaBytes());
  mine[6] = run_times_.reduce_seconds;
  mine[7] = run_times_.blocked_seconds;
  AllReduceSum(rows);
  size_t top = 0;
  double reduce = 0, blocked = 0;
  for (size_t q = 0; q < w; ++q) {
    if (rows[kRow * q] > rows[kRow * top]) top = q;
    reduce += rows[kRow * q + 6];
    blocked += rows[kRow * q + 7];
  }
  const double* r = rows.data() + kRow * top;
  summary->zero_peak_bytes = static_cast<int64_t>(r[0]);
  summary->zero_peak_values = static_cast<int64_t>(r[1]);
  summary->zero_peak_gradients = static_cast<int64_t>(r[2]);
  summary->zero_peak_state = static_cast<int64_t>(r[3]);
  summary->zero_peak_scratch = static_cast<int64_t>(r[4]);
  summary->zero_formula_bytes = static_cast<int64_t>(r[5]);
  if (steps_ > 0) {
    const double per = static_cast<double>(w) * static_cast<double>(steps_);
    summary->grad_reduce_s = reduce / per;
    summary->grad_reduce_blocked_s = blocked / per;
  }
}

void DistributedHooks::ReduceGradients(ParameterSet& params) {
  SY_CHECK(dense_opt_ != nullptr, "DistributedHooks: Prepare() was not called");
  if (trace_) {
    trace_->Add("forward + backward", "step", parallel::TraceStream::kCompute,
                trace_->step_begin_s(), internal::StepTrace::Now());
  }
  const internal::StepTrace::Span span(trace_.get(), "gradient reduce", "sync",
                                       parallel::TraceStream::kComm);
  // Every rank's gradients are those of its data shard's mean loss (the MoE blocks scale theirs
  // alike): summed over the holders of the same values, divided by the number of data shards.
  const float inv = 1.0f / static_cast<float>(mesh_.dp() * mesh_.cp());
  if (tied_embedding_ && groups_->Has(parallel::GroupKind::kEmbedding)) {
    // The first stage's embedding and the last stage's copy: each gets the sum of both.
    Parameter* tied = nullptr;
    for (Parameter& p : params.all()) tied = p.name == "embed.weight" ? &p : tied;
    SY_CHECK(tied != nullptr, "a stage of the embedding group holds no embed.weight");
    AllReduceTensor(groups_->Get(parallel::GroupKind::kEmbedding), tied->grad);
  }
  copy_opt_->ReduceGradients(inv);
  split_opt_->ReduceGradients(inv);
  dense_opt_->ReduceGradients(inv);
  expert_opt_->ReduceGradients(inv);
}

// A group kind with G groups whose members share out D distinct sets of values holds G / D copies
// of each element (within a group, each rank owns its range of the set).
// Pipeline stages hold distinct values (the tied copy is left out of counts and norms).
double DistributedHooks::CopiesSplit() const {
  return static_cast<double>(world_.size()) / data_.size() / mesh_.tp() / mesh_.pp();
}
double DistributedHooks::CopiesDense() const {
  return static_cast<double>(world_.size()) / tokens_.size() / mesh_.pp();
}
double DistributedHooks::CopiesExperts() const {
  return static_cast<double>(world_.size()) / expert_data_.size() / mesh_.expert_group_size() /
         mesh_.pp();
}

double DistributedHooks::GradSquaredNorm(const ParameterSet& params) {
  const internal::StepTrace::Span span(trace_.get(), "gradient norm", "sync",
                                       parallel::TraceStream::kComm);
  // Each rank's own ranges, weighted so that every distinct element counts once over the world.
  double own[1] = {split_opt_->OwnGradSquaredNorm() / CopiesSplit() +
                   dense_opt_->OwnGradSquaredNorm() / CopiesDense() +
                   expert_opt_->OwnGradSquaredNorm() / CopiesExperts()};
  AllReduceSum(own);
  return own[0];
}

std::string DistributedHooks::LayoutDescription() const {
  std::string tp = fmt::format("tp {}", mesh_.tp());
  if (mesh_.tp() > 1 && tp_options_.sequence_parallel) {
    tp += tp_options_.comm_overlap ? " (sequence parallel, comm-GEMM overlap)"
                                   : " (sequence parallel)";
  }
  std::string experts;
  if (!moe_blocks_.empty()) {
    experts = fmt::format(
        "; experts: ep {}{} ({} arrangement), ZeRO stage {}", mesh_.ep(),
        mesh_.shards() > 1 ? fmt::format(" x {} H-shards", mesh_.shards()) : std::string(),
        mesh_.arrangement() == parallel::Arrangement::kMegatron ? "megatron" : "deepspeed",
        zero_stage_);
  } else {
    experts = fmt::format("; ZeRO stage {}", zero_stage_);
  }
  std::string pp = mesh_.pp() > 1 ? fmt::format(" x pp {}", mesh_.pp()) : std::string();
  if (mesh_.cp() > 1) {
    pp += fmt::format(" x cp {} ({})", mesh_.cp(),
                      cp_options_.algorithm == CpAlgorithm::kUlysses ? "ulysses" : "ring");
  }
  return fmt::format("{} rank{} = {} x dp {}{}{}", world_.size(), world_.size() == 1 ? "" : "s", tp,
                     mesh_.dp(), pp, experts);
}

int64_t DistributedHooks::ModelParameterCount(const ParameterSet& params) {
  // Every rank holds each of its sets whole: a set is held by (group size x copies) ranks.
  double share[1] = {static_cast<double>(split_elements_) / (CopiesSplit() * data_.size()) +
                     static_cast<double>(dense_elements_) / (CopiesDense() * tokens_.size()) +
                     static_cast<double>(expert_elements_) /
                         (CopiesExperts() * expert_data_.size())};
  AllReduceSum(share);
  return static_cast<int64_t>(std::llround(share[0]));
}

void DistributedHooks::ScaleGradients(ParameterSet& params, float factor) {
  if (factor == 1.0f) return;
  copy_opt_->ScaleGradients(factor);
  split_opt_->ScaleGradients(factor);
  dense_opt_->ScaleGradients(factor);
  expert_opt_->ScaleGradients(factor);
}

void DistributedHooks::OptimizerStep(AdamW& optimizer, ParameterSet& params, float lr) {
  const internal::StepTrace::Span span(trace_.get(), "optimizer step", "optimizer",
                                       parallel::TraceStream::kCompute);
  copy_opt_->Step(lr);
  split_opt_->Step(lr);
  dense_opt_->Step(lr);
  expert_opt_->Step(lr);
  gathered_ = zero_stage_ < 3;
}

int64_t DistributedHooks::OptimizerStepCount(const AdamW& optimizer) {
  return dense_opt_ ? dense_opt_->step() : optimizer.step();
}

void DistributedHooks::GatherParameters(ParameterSet& params) {
  if (gathered_) return;
  const internal::StepTrace::Span span(trace_.get(), "parameter all-gather", "sync",
                                       parallel::TraceStream::kComm);
  copy_opt_->GatherParameters();
  split_opt_->GatherParameters();
  dense_opt_->GatherParameters();
  expert_opt_->GatherParameters();
  gathered_ = true;
}

void DistributedHooks::ReleaseParameters(ParameterSet& params) {
  in_step_ = false;
  const ReductionTimes t = TakeReductionTimes();
  run_times_.reduce_seconds += t.reduce_seconds;
  run_times_.blocked_seconds += t.blocked_seconds;
  run_times_.buckets += t.buckets;
  run_times_.overlapped += t.overlapped;
  if (zero_stage_ < 3) return;
  copy_opt_->ReleaseParameters();
  split_opt_->ReleaseParameters();
  dense_opt_->ReleaseParameters();
  expert_opt_->ReleaseParameters();
  gathered_ = false;
}

void DistributedHooks::AllReduceSum(std::span<double> values) {
  // The transports reduce float32/bfloat16/int32/int64, not float64: all-gather the doubles'
  // bits and add them up in rank order, which also gives every rank the same bits.
  const size_t n = values.size();
  if (n == 0) return;
  std::vector<double> all(n * static_cast<size_t>(world_.size()));
  world_.AllGather(values.data(), all.data(), n, DType::kInt64).Wait();
  for (size_t i = 0; i < n; ++i) {
    double s = 0;
    for (int r = 0; r < world_.size(); ++r) s += all[static_cast<size_t>(r) * n + i];
    values[i] = s;
  }
}

parallel::Mesh DistributedHooks::BlockMesh(const MoeBlock& block) const {
  // The run's mesh with this block's experts (blocks may hold different numbers,
  // experts_per_block).
  return parallel::Mesh(mesh_.config(), block.config.num_experts, block.config.hidden_dim);
}

void DistributedHooks::GatherExperts(TensorMap& map, const std::string& suffix) {
  // Over the ranks of this stage (the stages hold different MoE blocks), in world-rank order.
  comm::Communicator& stage = stage_ != nullptr ? *stage_ : world_;
  const int w = stage.size();
  std::vector<int> members;
  for (int r = 0; r < world_.size(); ++r) {
    if (mesh_.Coords(r).pp_rank == coords_.pp_rank) members.push_back(r);
  }
  SY_CHECK(static_cast<int>(members.size()) == w, "stage group of {} ranks, mesh says {}", w,
           members.size());
  for (const MoeBlock& block : moe_blocks_) {
    const parallel::Mesh mesh = BlockMesh(block);
    for (const ExpertField& f : kExpertFields) {
      const std::string key = block.prefix + "experts." + f.name + suffix;
      auto it = map.find(key);
      if (it == map.end()) continue;
      const Tensor local = it->second;
      const int64_t n = local.numel();
      Tensor all = Tensor::Empty({w * n}, DType::kFloat32);
      stage
          .AllGather(local.data<float>(), all.data<float>(), static_cast<size_t>(n),
                     DType::kFloat32)
          .Wait();
      moe::ExpertWeights full;
      full.*f.member = Tensor::Zeros(FullShape(block.config, std::string("experts.") + f.name));
      for (int r = 0; r < w; ++r) {
        moe::ExpertWeights shard;
        shard.*f.member = all.Slice(r * n, (r + 1) * n).Reshape(local.shape());
        parallel::PlaceShard(
            shard, parallel::ShardOf(mesh, members[static_cast<size_t>(r)], block.config.model_dim),
            &full);
      }
      it->second = full.*f.member;
    }
  }
}

void DistributedHooks::SliceExperts(TensorMap& map, const std::string& suffix) const {
  for (const MoeBlock& block : moe_blocks_) {
    const parallel::ShardSpec spec =
        parallel::ShardOf(BlockMesh(block), world_.rank(), block.config.model_dim);
    for (const ExpertField& f : kExpertFields) {
      const std::string key = block.prefix + "experts." + f.name + suffix;
      auto it = map.find(key);
      if (it == map.end()) continue;
      ExpectShape(key, it->second, FullShape(block.config, std::string("experts.") + f.name));
      moe::ExpertWeights full;
      full.*f.member =
          it->second.dtype() == DType::kFloat32 ? it->second : it->second.To(DType::kFloat32);
      it->second = parallel::ShardExperts(full, spec).*f.member;
    }
  }
}

void DistributedHooks::GatherTensorParallel(ParameterSet& params, TensorMap& map,
                                            const std::string& suffix) {
  if (mesh_.tp() == 1) return;
  for (const Parameter& p : params.all()) {  // the same order on every rank of the group
    if (!p.tp_shard.split()) continue;
    auto it = map.find(p.name + suffix);
    if (it == map.end()) continue;
    it->second = GatherFull(tp_group_, it->second, p.tp_shard);
  }
}

void DistributedHooks::SliceTensorParallel(ParameterSet& params, TensorMap& map,
                                           const std::string& suffix) const {
  if (mesh_.tp() == 1) return;
  for (const Parameter& p : params.all()) {
    if (!p.tp_shard.split()) continue;
    auto it = map.find(p.name + suffix);
    if (it == map.end()) continue;
    const Tensor full =
        it->second.dtype() == DType::kFloat32 ? it->second : it->second.To(DType::kFloat32);
    it->second =
        ShardOf(it->first, full, p.tp_shard, tp_group_.rank(), static_cast<int>(tp_group_.size()));
  }
}

void DistributedHooks::GatherStages(TensorMap& map) {
  if (mesh_.pp() == 1) return;
  comm::Communicator& pipeline = groups_->Get(parallel::GroupKind::kPipeline);
  TensorMap all;
  for (int s = 0; s < pipeline.size(); ++s) {
    std::vector<std::byte> bytes;
    if (s == pipeline.rank()) bytes = SerializeSafetensors(map);
    int64_t size[1] = {static_cast<int64_t>(bytes.size())};
    pipeline.Broadcast(size, 1, DType::kInt64, {.root = s}).Wait();
    // As int32 words (the transports move typed elements), then the exact size again.
    const size_t words = (static_cast<size_t>(size[0]) + 3) / 4;
    bytes.resize(words * 4);
    pipeline.Broadcast(bytes.data(), words, DType::kInt32, {.root = s}).Wait();
    bytes.resize(static_cast<size_t>(size[0]));
    for (auto& [name, t] : ParseSafetensors(bytes, fmt::format("pipeline stage {}", s))) {
      all[name] = t;
    }
  }
  map = std::move(all);
}

TensorMap DistributedHooks::ModelValuesForCheckpoint(ParameterSet& params) {
  TensorMap values;
  for (const Parameter& p : params.all()) {
    if (!p.tied_copy) values.emplace(p.name, p.value);
  }
  GatherExperts(values, "");
  GatherTensorParallel(params, values, "");
  GatherStages(values);
  return values;
}

TensorMap DistributedHooks::OptimizerStateForCheckpoint(const AdamW& optimizer,
                                                        ParameterSet& params) {
  if (!dense_opt_ || dense_opt_->step() == 0) return {};
  TensorMap state = dense_opt_->FullState();
  for (auto& [name, t] : split_opt_->FullState()) state[name] = t;
  for (auto& [name, t] : expert_opt_->FullState()) state[name] = t;
  GatherExperts(state, ".exp_avg");
  GatherExperts(state, ".exp_avg_sq");
  GatherTensorParallel(params, state, ".exp_avg");
  GatherTensorParallel(params, state, ".exp_avg_sq");
  GatherStages(state);
  return state;
}

void DistributedHooks::LoadModelValues(ParameterSet& params, const TensorMap& values) {
  TensorMap mine = values;
  SliceExperts(mine, "");
  SliceTensorParallel(params, mine, "");
  params.LoadValues(mine, /*allow_extra=*/mesh_.pp() > 1);  // other stages' parameters
}

void DistributedHooks::LoadOptimizerState(AdamW& optimizer, const TensorMap& state, int64_t step,
                                          ParameterSet& params) {
  Prepare(params, optimizer);
  if (step == 0 && state.empty()) return;
  TensorMap mine = state;
  SliceExperts(mine, ".exp_avg");
  SliceExperts(mine, ".exp_avg_sq");
  SliceTensorParallel(params, mine, ".exp_avg");
  SliceTensorParallel(params, mine, ".exp_avg_sq");
  copy_opt_->LoadFullState(mine, step);
  split_opt_->LoadFullState(mine, step);
  dense_opt_->LoadFullState(mine, step);
  expert_opt_->LoadFullState(mine, step);
}

// ---- RankTrainer ----

RankTrainer::RankTrainer(const TrainConfig& config, comm::Communicator& world, int ranks_in_process)
    : RankTrainer(config, world, ranks_in_process, ZeroOptions{}) {}

RankTrainer::RankTrainer(const TrainConfig& config, comm::Communicator& world, int ranks_in_process,
                         const ZeroOptions& zero) {
  parallel::ParallelOptions options = TrainParallelOptions(config, world.size());
  if (config.a2a_algo == "2dh" && config.a2a_ranks_per_node == 0) {
    // The launcher's node size, as far as it divides the expert group (the nodes of the 2DH
    // all-to-all are consecutive ranks of the expert group).
    options.hierarchical_ranks_per_node =
        std::gcd(std::max(1, world.topology().ranks_per_node), options.mesh.ep);
  }
  // The run's process groups: built once, shared by every MoE block and the optimizer (every
  // block's experts split over them alike, TrainParallelOptions checks).
  const moe::LayerConfig first = MoeBlockLayerConfig(config, config.model.moe_every - 1);
  groups_ = parallel::MakeLayerGroups(world, first, options);
  // DeepSpeed's TP de-duplication (parallel::ParallelOptions::tp_dedup): each tp rank runs the
  // experts on its share of the rows, so expert gradients are summed over tp too.
  const bool dedup = options.tp_dedup && groups_->mesh().tp_duplicates_tokens() &&
                     options.dispatch != parallel::DispatchKind::kAllGather;
  const TensorParallelOptions tp{.sequence_parallel = config.tp > 1 && config.sequence_parallel,
                                 .comm_overlap = config.tp > 1 && config.tp_comm_overlap};
  ZeroOptions buckets = zero;
  buckets.bucket_elements = static_cast<int64_t>(config.bucket_mb * 1024 * 1024 / sizeof(float));
  hooks_ = std::make_unique<DistributedHooks>(
      groups_, static_cast<int>(config.zero_stage), ranks_in_process, buckets,
      dedup ? parallel::GroupKind::kExpertHolders : parallel::GroupKind::kExpertData, tp);
  hooks_->SetOverlapGradReduce(config.overlap_grad_reduce);
  hooks_->SetStepTrace(config.trace_step, config.out + "/trace.json");
  if (config.model.moe_every > 0) {
    // Every adaptive r the run will use must suit the experts' H-shards (n = ep / E when the
    // experts are fewer than the ep ranks, else 1): 0 or a divisor of n.
    const int shards = groups_->mesh().shards();
    const auto entries = static_cast<int64_t>(
        std::count(config.adaptive_r.begin(), config.adaptive_r.end(), ',') + 1);
    for (int64_t s = 0; s < entries; ++s) {
      const int r = AdaptiveRAtStep(config.adaptive_r, s);
      SY_REQUIRE(r < 0 || r == 0 || shards % r == 0, InvalidArgument,
                 "config: 'adaptive_r' \"{}\": r = {} is neither 0 nor a divisor of the {} "
                 "H-shard(s) of each expert (ep / num_experts when the experts are fewer than "
                 "the ep ranks, else 1)",
                 config.adaptive_r, r, shards);
    }
  }
  if (config.cp > 1) {
    hooks_->SetContextParallel(ContextParallelOptions{
        .algorithm = config.cp_algo == "ulysses" ? CpAlgorithm::kUlysses : CpAlgorithm::kRing,
        .split = SequenceSplitKind::kZigzag,
        .causal = true});
  }
  if (config.pp > 1) {
    // Every rank of this stage (collective over the world): checkpoints gather the experts of
    // the stage's MoE blocks over it.
    const int stage = groups_->coords().pp_rank;
    hooks_->SetPipeline(world.Split(stage, world.rank(), fmt::format("stage{}", stage)),
                        config.model.tied_head);
  }
  DistributedHooks* hooks = hooks_.get();
  FeedForwardFactory factory;
  if (config.model.moe_every > 0) {
    factory = [hooks, config, options, groups = groups_](int64_t block, const std::string& prefix,
                                                         ParameterSet& params, uint64_t seed) {
      const moe::LayerConfig layer = MoeBlockLayerConfig(config, block);
      hooks->AddMoeBlock(prefix, layer);
      auto ffn =
          std::make_unique<ParallelMoeFeedForward>(params, prefix, layer, options, groups, seed);
      ffn->set_adaptive_r(config.adaptive_r);
      hooks->AddTracedLayer(&ffn->layer());
      return ffn;
    };
  }
  trainer_ = std::make_unique<Trainer>(config, std::move(factory), hooks);
  hooks_->Prepare(trainer_->model().parameters(), trainer_->optimizer());
}

RankTrainer::~RankTrainer() = default;

// ---- RunDistributedTraining ----

RunSummary RunDistributedTraining(comm::Launcher& launcher, const TrainConfig& config,
                                  const DistributedRunOptions& options) {
  ValidateTrainConfig(config);
  SY_REQUIRE(config.ranks == launcher.world_size(), InvalidArgument,
             "config: 'ranks' is {} but the launcher starts {} ranks ({})", config.ranks,
             launcher.world_size(), launcher.kind());
  RequireRunInputsOutsideRunDirectory(config, options.run.config_file,
                                      options.run.resume);  // before any rank reads or writes
  TrainConfig c = config;
  if (c.ep == 0) c.ep = TrainExpertParallelSize(c, static_cast<int>(c.ranks));  // as it runs
  const bool agree = launcher.ranks_in_process() < launcher.world_size();
  if (!agree) RequireTrainingMemory(c, launcher.ranks_in_process());  // every rank, up front
  std::mutex mu;
  RunSummary summary;
  launcher.Run([&](comm::Communicator& world) {
    // Ranks that share this process or node share its cores (the threading policy divides them)
    // and its memory.
    int sharing = launcher.ranks_in_process();
    if (agree) {
      comm::AgreeOnConfig(world, "train", AgreementEntries(c, options.run));
      sharing = std::max(sharing, world.topology().ranks_per_node);
      RequireTrainingMemory(c, sharing);
    }
    // Tensors this rank's thread allocates are counted (the run summary's measured peak).
    ScopedMemoryAccount account(std::make_shared<MemoryAccount>());
    RankTrainer rank(c, world, sharing);
    RunSummary s = rank.trainer().Run(options.run);
    if (world.rank() == 0 || agree) {
      std::lock_guard<std::mutex> lock(mu);
      summary = std::move(s);
    }
  });
  return summary;
}

}  // namespace switchyard::train
