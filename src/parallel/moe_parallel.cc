#include "switchyard/parallel/moe_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>

#include "parallel/collectives.h"
#include "parallel/dispatcher.h"
#include "parallel/expert_weights.h"
#include "parallel/routing.h"
#include "parallel/trace_context.h"
#include "switchyard/core/error.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/losses.h"
#include "switchyard/moe/plan.h"
#include "switchyard/moe/router_stats.h"
#include "switchyard/moe/variants.h"

namespace switchyard::parallel {

std::string_view DispatchKindName(DispatchKind kind) {
  switch (kind) {
    case DispatchKind::kAllToAll: return "alltoall";
    case DispatchKind::kAllToAllV: return "alltoallv";
    case DispatchKind::kAllGather: return "allgather";
  }
  return "?";
}

DispatchKind DispatchKindFromName(std::string_view name) {
  for (DispatchKind k :
       {DispatchKind::kAllToAll, DispatchKind::kAllToAllV, DispatchKind::kAllGather}) {
    if (name == DispatchKindName(k)) return k;
  }
  throw InvalidArgument(
      fmt::format("dispatch: expected 'alltoall', 'alltoallv' or 'allgather', got '{}'", name));
}

std::string_view BatchScopeName(BatchScope scope) {
  return scope == BatchScope::kGlobal ? "global" : "per_rank";
}

BatchScope BatchScopeFromName(std::string_view name) {
  if (name == "global") return BatchScope::kGlobal;
  if (name == "per_rank") return BatchScope::kPerRank;
  throw InvalidArgument(
      fmt::format("batch scope: expected 'global' or 'per_rank', got '{}'", name));
}

int AdaptiveRFromString(std::string_view text) {
  if (text == "auto") return kAdaptiveRAuto;
  if (text == "default") return kAdaptiveRDefault;
  int r = -1;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), r);
  SY_REQUIRE(ec == std::errc() && ptr == text.data() + text.size() && r >= 0, InvalidArgument,
             "adaptive r: expected 'auto' or an integer >= 0, got '{}'", text);
  return r;
}

double PredictedVolume(int r, double capacity_volume, double expert_params, int64_t num_experts) {
  if (r == 0) return 2.0 * expert_params;
  return 4.0 * capacity_volume * r +
         2.0 * expert_params / (static_cast<double>(num_experts) * static_cast<double>(r));
}

int ChooseAdaptiveR(int shards, double capacity_volume, double expert_params, int64_t num_experts) {
  int best = 1;
  double best_volume = std::numeric_limits<double>::infinity();
  for (int r = 1; r <= shards; ++r) {
    if (shards % r != 0) continue;
    double v = PredictedVolume(r, capacity_volume, expert_params, num_experts);
    if (v < best_volume) best = r, best_volume = v;
  }
  if (PredictedVolume(0, capacity_volume, expert_params, num_experts) < best_volume) best = 0;
  return best;
}

// What the backward needs: the step's routing and the dispatcher's handle.
struct ParallelState {
  DType x_dtype = DType::kFloat32;
  Tensor x;  // [T, M] float32
  moe::GateResult gate;
  moe::DispatchPlan plan;
  bool has_batch_sums = false;
  moe::GateLossSums batch_sums;
  // aux_loss global in the per-rank scope: the loss sums are the token group's, so the aux share
  // is multiplied by the number of shards and the z-loss's by token-group / routing-group tokens.
  float aux_coef_scale = 1.0f;
  float z_coef_scale = 1.0f;
  int r = 1;
  moe::ExpertWeights weights;  // the compute weights (gathered, expert_weights.h)
  std::unique_ptr<internal::DispatchStep> step;
  moe::VariantState variants;  // residual MLP, shared expert (replicated, on own tokens)

  internal::StepInput Input() const { return {plan, x, weights, r}; }
};

namespace {

// check_finite for this rank's shard of the expert weights.
void CheckFiniteShard(const moe::ExpertWeights& w, int rank) {
  for (const auto& [name, t] :
       {std::pair<const char*, const Tensor*>{"experts.fc1.weight", &w.fc1_weight},
        {"experts.fc1.bias", &w.fc1_bias},
        {"experts.fc2.weight", &w.fc2_weight},
        {"experts.fc2.bias", &w.fc2_bias},
        {"experts.fc3.weight", &w.fc3_weight}}) {
    moe::CheckFinite(fmt::format("{} (the shard of rank {})", name, rank), *t);
  }
}

// The shapes (and with check_finite the values) of the dense variants' parameters.
void CheckVariants(const moe::LayerConfig& c, const moe::LayerParams& params) {
  if (!moe::HasVariants(c)) return;
  const moe::NamedTensors given = moe::ParamsToMap(c, params);
  for (const auto& [name, shape] : moe::ParamShapes(c)) {
    if (name.starts_with("gate.") || name.starts_with("experts.")) continue;
    auto it = given.find(name);
    SY_REQUIRE(it != given.end(), InvalidArgument, "{}: missing (expected {})", name,
               ShapeToString(shape));
    ExpectDType(name, it->second, DType::kFloat32);
    ExpectShape(name, it->second, shape);
    if (c.check_finite) moe::CheckFinite(name, it->second);
  }
}

Tensor ToFloat32(const Tensor& t) {
  return t.dtype() == DType::kFloat32 ? t : t.To(DType::kFloat32);
}

double ExpertParamCount(const moe::LayerConfig& c) {
  const double m = static_cast<double>(c.model_dim), h = static_cast<double>(c.hidden_dim);
  double per = h * m * (c.gated ? 3.0 : 2.0) + (c.fc_bias ? h + m : 0.0);
  return per * static_cast<double>(c.num_experts);
}

// The checks of a forward's inputs: x [T, model_dim] floating, the gate [E, model_dim], this rank's
// expert shard, the variants' parameters, and with check_finite every value finite.
void CheckForwardInputs(const moe::LayerConfig& c, const moe::LayerParams& params, const Tensor& x,
                        const ShardSpec& spec, int64_t global_token_offset, int rank) {
  ExpectFloating("x", x);
  ExpectShape("x", x, {kAnySize, c.model_dim});
  ExpectDType("gate.weight", params.gate_weight, DType::kFloat32);
  ExpectShape("gate.weight", params.gate_weight, {c.num_experts, c.model_dim});
  CheckShard(params.experts, spec, c.gated, c.fc_bias);
  CheckVariants(c, params);
  SY_REQUIRE(global_token_offset >= 0, InvalidArgument,
             "global_token_offset: expected >= 0, got {}", global_token_offset);
  if (c.check_finite) {
    // As moe::MoeLayer does; a rank that throws here fails its peers' next collective.
    moe::CheckFinite(fmt::format("x (rank {}, tokens from {})", rank, global_token_offset), x);
    moe::CheckFinite("gate.weight", params.gate_weight);
    moe::CheckFinite("gate.expert_bias", params.expert_bias);
    CheckFiniteShard(params.experts, rank);
  }
}
}  // namespace

Mesh LayerMesh(const moe::LayerConfig& config, const ParallelOptions& options, int world_size) {
  MeshConfig mc = options.mesh;
  if (mc.world_size == 0 || mc.world_size == 1) mc.world_size = world_size;
  SY_REQUIRE(mc.world_size == world_size, InvalidArgument,
             "mesh world size {} differs from the communicator's {} ranks", mc.world_size,
             world_size);
  return ExpertMesh(mc, config.num_experts, config.hidden_dim);
}

std::shared_ptr<ProcessGroups> MakeLayerGroups(comm::Communicator& world,
                                               const moe::LayerConfig& config,
                                               const ParallelOptions& options) {
  return std::make_shared<ProcessGroups>(world, LayerMesh(config, options, world.size()));
}

namespace {

// Whether groups built for `have` serve a layer whose options give `want`: the same ranks in every
// group (world, tp, ep, etp, arrangement and the H-shards per expert).
void RequireSameGroups(const Mesh& want, const Mesh& have) {
  auto describe = [](const Mesh& m) {
    const MeshConfig& c = m.config();
    return fmt::format(
        "world {}, tp {}, pp {}, cp {}, ep {}, etp {}, arrangement {}, order {}, {} H-shard(s) per "
        "expert",
        m.world_size(), c.tp, c.pp, c.cp, m.ep(),
        // The etp key is Megatron's; DeepSpeed's H-shards are the last figure.
        m.arrangement() == Arrangement::kMegatron ? c.etp : 1, ArrangementName(m.arrangement()),
        c.order, m.shards());
  };
  SY_REQUIRE(want.SameLayout(have), InvalidArgument,
             "process groups: built for the mesh ({}), but the layer's options ask for ({})",
             describe(have), describe(want));
}

// The layer's mesh, after checking the config and that `groups` serve it.
Mesh ValidatedMesh(const moe::LayerConfig& config, const ParallelOptions& options,
                   const ProcessGroups* groups) {
  moe::ValidateConfig(config);
  SY_REQUIRE(groups != nullptr, InvalidArgument, "ParallelMoeLayer: the process groups are null");
  Mesh mesh = LayerMesh(config, options, groups->world().size());
  RequireSameGroups(mesh, groups->mesh());
  return mesh;
}

}  // namespace

ParallelMoeLayer::ParallelMoeLayer(moe::LayerConfig config, ParallelOptions options,
                                   std::shared_ptr<ProcessGroups> groups)
    : config_(std::move(config)),
      options_(std::move(options)),
      groups_(std::move(groups)),
      mesh_(ValidatedMesh(config_, options_, groups_.get())),
      coords_(mesh_.Coords(groups_->world().rank())) {
  const Mesh& mesh = mesh_;
  options_.mesh = mesh.config();
  const int n = mesh.shards();
  const int r = options_.adaptive_r;
  SY_REQUIRE(r == kAdaptiveRDefault || r == kAdaptiveRAuto || r == 0 || (r >= 1 && n % r == 0),
             InvalidArgument,
             "adaptive r {}: expected 'auto', 0 or a divisor of the {} H-shard(s) of each expert",
             r, n);
  const int per_node = options_.hierarchical_ranks_per_node;
  if (per_node > 0) {
    SY_REQUIRE(options_.dispatch == DispatchKind::kAllToAll, InvalidArgument,
               "the hierarchical (2DH) all-to-all applies to dispatch alltoall, not {}",
               DispatchKindName(options_.dispatch));
    SY_REQUIRE(mesh.expert_group_size() % per_node == 0, InvalidArgument,
               "2DH: {} ranks per node does not divide the expert group of {} ranks", per_node,
               mesh.expert_group_size());
  }
  dedup_ = options_.tp_dedup && mesh.tp_duplicates_tokens() &&
           options_.dispatch != DispatchKind::kAllGather;
  const bool exchange = options_.dispatch != DispatchKind::kAllGather;
  SY_REQUIRE(options_.overlap_degree >= 1, InvalidArgument, "overlap degree: expected >= 1, got {}",
             options_.overlap_degree);
  SY_REQUIRE(options_.overlap_degree == 1 || exchange, InvalidArgument,
             "overlap degree {} applies to dispatch alltoall or alltoallv, not allgather",
             options_.overlap_degree);
  const int g = options_.smart_group;
  if (g != kSmartOff) {
    SY_REQUIRE(exchange, InvalidArgument,
               "the smart schedule applies to dispatch alltoall or alltoallv, not allgather");
    SY_REQUIRE(per_node == 0, InvalidArgument,
               "the smart schedule (pair-wise steps) and the 2DH all-to-all are alternatives");
    SY_REQUIRE(g == kSmartAuto || (g >= 1 && mesh.expert_group_size() % g == 0), InvalidArgument,
               "smart schedule group size {}: expected 'auto' or a divisor of the expert group of "
               "{} ranks",
               g, mesh.expert_group_size());
  }
  if (options_.shadow.policy != ShadowPolicy::kNone) {
    SY_REQUIRE(exchange && n == 1 && !dedup_, InvalidArgument,
               "shadow experts need dispatch alltoall or alltoallv, unsharded experts (E >= the "
               "expert group size) and no TP de-duplication");
    for (int64_t e : options_.shadow.experts) {
      SY_REQUIRE(e >= 0 && e < config_.num_experts, InvalidArgument,
                 "shadow: expert {} does not exist (expected 0 .. {})", e, config_.num_experts - 1);
    }
  }
  spec_ = ShardOf(mesh, groups_->world().rank(), config_);
  internal::DispatcherSetup setup{groups_, config_, options_, mesh.shards(), spec_.local_experts,
                                  dedup_};
  local_ = internal::MakeLocalDispatcher(setup);
  dispatcher_ = options_.dispatch == DispatchKind::kAllGather
                    ? internal::MakeAllGatherDispatcher(setup)
                    : internal::MakeExchangeDispatcher(setup);
}

ParallelMoeLayer::~ParallelMoeLayer() = default;

moe::LayerParams ParallelMoeLayer::ShardParams(const moe::LayerParams& full) const {
  moe::LayerParams p;
  p.gate_weight = full.gate_weight;
  p.expert_bias = full.expert_bias;
  p.experts = ShardExperts(full.experts, spec_);
  // The variants are dense: every rank holds them whole, as the gate.
  p.residual_mlp = full.residual_mlp;
  p.coefficient_weight = full.coefficient_weight;
  p.coefficient_bias = full.coefficient_bias;
  p.shared_mlp = full.shared_mlp;
  return p;
}

const CostModel& ParallelMoeLayer::cost_model() const { return dispatcher_->cost_model(); }

int ParallelMoeLayer::ResolveAdaptiveR(int requested, double capacity_volume) const {
  const int n = mesh().shards();
  int r = requested == kAdaptiveRDefault ? options_.adaptive_r : requested;
  if (r == kAdaptiveRDefault) return mesh().arrangement() == Arrangement::kMegatron ? n : 1;
  if (r == kAdaptiveRAuto) {
    return ChooseAdaptiveR(n, capacity_volume, ExpertParamCount(config_), config_.num_experts);
  }
  SY_REQUIRE(r == 0 || (r >= 1 && n % r == 0), InvalidArgument,
             "adaptive r {}: expected 'auto', 0 or a divisor of the {} H-shard(s) of each expert",
             r, n);
  return r;
}

ParallelOutput ParallelMoeLayer::Forward(const moe::LayerParams& params, const Tensor& x,
                                         const ParallelForwardOptions& options) {
  const moe::LayerConfig& c = config_;
  ParallelOutput out;
  CommStats* st = &out.stats;
  internal::ScopedTotal total(st);
  internal::ScopedTraceContext trace(tracer_, coords().rank, "forward");
  CheckForwardInputs(c, params, x, spec_, options.global_token_offset, coords().rank);
  const int threads = std::max(1, options.threads);
  const int64_t t_num = x.size(0), e_num = c.num_experts, m_dim = c.model_dim;
  const bool global = options_.batch_scope == BatchScope::kGlobal;
  comm::Communicator& expert = groups_->Get(GroupKind::kExpert);
  // The ranks whose tokens are routed as one batch: the token group (global scope), or the
  // context-parallel group (per-rank scope: its ranks hold parts of the same sequences).
  comm::Communicator& routing = groups_->Get(global ? GroupKind::kTokens : GroupKind::kContext);
  const bool shared = global || routing.size() > 1;

  auto state = std::make_shared<ParallelState>();
  ParallelState& s = *state;
  s.x_dtype = x.dtype();
  s.x = ToFloat32(x);

  // Gate.
  {
    internal::TraceSpan span("gate");
    s.gate = moe::GateForward(c, s.x, params.gate_weight, params.expert_bias,
                              {options.global_token_offset, options.step, options.training,
                               options.token_index, options.forced_experts});
  }
  const int64_t k = s.gate.top_k;

  // Losses: of the routing group's batch (per-expert sums added over its ranks).
  // The sequence loss lays its sums out per sequence of the batch: it needs the batch's size.
  int64_t batch_tokens = 0;
  if (c.aux_loss == moe::AuxLoss::kSequence && shared) {
    std::vector<int64_t> v{t_num};
    internal::AllReduceSum(routing, v, Traffic::kRouting, st);
    batch_tokens = v[0];
  }
  // aux_loss global is the loss of the micro-batch on every rank of the stage (the token group)
  // in either scope. In the per-rank scope each shard's objective holds that loss whole, so the
  // shards' gradient shares, summed, count it once per shard.
  const bool global_aux = c.aux_loss == moe::AuxLoss::kGlobal;
  comm::Communicator& loss_group = global_aux ? groups_->Get(GroupKind::kTokens) : routing;
  moe::GateLossSums sums = moe::ComputeGateLossSums(c, s.gate, batch_tokens);
  // The per-rank scope's z-loss stays the routing group's.
  std::vector<double> route_z{sums.z, sums.num_tokens};
  if (global_aux && !global && shared) {
    internal::AllReduceSum(routing, route_z, Traffic::kRouting, st);
  }
  if (global_aux ? loss_group.size() > 1 : shared) {
    std::vector<double> v = sums.ToVector();
    internal::AllReduceSum(loss_group, v, Traffic::kRouting, st);
    sums = moe::GateLossSums::FromVector(c, v);
    s.has_batch_sums = true;
  }
  std::vector<double> aux_counts;
  if (global_aux) {
    aux_counts = sums.choices;
    moe::UseRunningMeanCounts(
        c, options.aux_counts_so_far ? *options.aux_counts_so_far : moe::AuxCountsSoFar{}, &sums);
    s.has_batch_sums = true;
    if (!global) {
      s.aux_coef_scale = static_cast<float>(loss_group.size() / routing.size());
      if (route_z[1] > 0) s.z_coef_scale = static_cast<float>(sums.num_tokens / route_z[1]);
    }
  }
  if (c.aux_loss == moe::AuxLoss::kHfConcat) s.has_batch_sums = true;  // Backward's part
  if (s.has_batch_sums) s.batch_sums = sums;
  moe::GateLosses losses = moe::GateLossesFromSums(c, sums);
  if (global_aux && !global) {
    losses.z_loss = route_z[1] > 0 ? static_cast<float>(route_z[0] / route_z[1]) : 0.0f;
  }

  // Route: capacity, slots, drops.
  moe::PlanOptions plan_options;
  plan_options.global_token_offset = options.global_token_offset;
  plan_options.step = options.step;
  plan_options.token_index = options.token_index;
  if (!global && !c.dropless && !c.capacity && c.capacity_factor <= 0) {
    // The per-rank scope's largest load over the expert group (of each routing group's batch).
    std::vector<int64_t> loads(static_cast<size_t>(e_num), 0);
    for (size_t i = 0; i < s.gate.experts.size(); ++i) {
      if (s.gate.routed[i]) ++loads[static_cast<size_t>(s.gate.experts[i])];
    }
    if (shared) internal::AllReduceSum(routing, loads, Traffic::kRouting, st);
    std::vector<int64_t> v{*std::max_element(loads.begin(), loads.end())};
    internal::AllReduceMax(expert, v, Traffic::kRouting, st);
    plan_options.global_max_load = v[0];
  }
  internal::PairDecisions dec =
      shared ? internal::GlobalDecisions(c, s.gate, plan_options, routing, st)
             : internal::PerRankDecisions(c, s.gate, plan_options);

  // The step's adaptive r picks the dispatcher (r = 0: local); the dispatcher lays out the plan.
  int64_t buffer_capacity = dec.local_capacity;
  const int requested_r =
      options.adaptive_r == kAdaptiveRDefault ? options_.adaptive_r : options.adaptive_r;
  if (dispatcher_->needs_group_capacity() || requested_r == kAdaptiveRAuto) {
    std::vector<int64_t> v{buffer_capacity};
    internal::AllReduceMax(expert, v, Traffic::kRouting, st);
    buffer_capacity = v[0];
  }
  const double capacity_volume = static_cast<double>(e_num * buffer_capacity * m_dim);
  s.r = ResolveAdaptiveR(requested_r, capacity_volume);
  internal::Dispatcher& dispatcher = s.r == 0 ? *local_ : *dispatcher_;
  const internal::BufferLayout layout = dispatcher.Layout(buffer_capacity, s.r);
  if (!c.dropless) {
    moe::RequireExpertBufferMemory(c, e_num, std::max(layout.stride, buffer_capacity));
  }
  {
    internal::TraceSpan span("plan");
    s.plan = internal::LayoutPlan(dec, layout.stride);
  }
  out.adaptive_r = s.r;
  out.predicted_volume = PredictedVolume(s.r, capacity_volume, ExpertParamCount(c), c.num_experts);
  out.buffer_capacity = layout.stride > 0 ? layout.stride : buffer_capacity;

  // Dispatch -> experts -> combine.
  s.weights = internal::GatherComputeWeights(*groups_, params.experts, spec_, s.r, st);
  const internal::ExpertKernels experts{{c.activation, c.gated}, threads};
  internal::DispatchInfo info;
  Tensor y;
  s.step = dispatcher.Forward(s.Input(), experts, &y, &info, st);
  if (moe::HasVariants(c)) y = moe::VariantsForward(c, params, s.x, y, &s.variants, threads);
  out.overlap_degree = info.overlap_degree;
  out.smart_group = info.smart_group;
  out.shadowed = std::move(info.shadowed);

  moe::LayerOutput& lo = out.layer;
  lo.y = x.dtype() == DType::kFloat32 ? y : y.To(x.dtype());
  lo.l_aux = losses.l_aux;
  lo.z_loss = losses.z_loss;
  lo.capacity = dec.capacity;
  lo.topk_idx = Tensor::FromVector(s.gate.experts, {t_num, k});
  lo.locations = Tensor::FromVector(dec.locations, {t_num, k});
  lo.gates = Tensor::FromVector(s.gate.gates, {t_num, k});
  lo.combine_weights = Tensor::FromVector(dec.weights, {t_num, k});
  lo.expert_loads = dec.loads;
  lo.expert_counts = s.plan.counts;
  lo.dropped = s.plan.dropped;
  lo.aux_counts = std::move(aux_counts);
  lo.concat_sums = moe::ConcatSumsOf(c, sums);
  if (options.entropy) lo.entropy_sum = moe::RouterEntropySum(c, s.gate);
  if (options.save_for_backward) out.state = std::move(state);
  return out;
}

ParallelGradients ParallelMoeLayer::Backward(const moe::LayerParams& params,
                                             const ParallelOutput& forward, const Tensor& dy_in,
                                             int threads, const moe::RouterLoadSums* concat_total) {
  const moe::LayerConfig& c = config_;
  ParallelGradients g;
  CommStats* st = &g.stats;
  internal::ScopedTotal total(st);
  internal::ScopedTraceContext trace(tracer_, coords().rank, "backward");
  SY_REQUIRE(forward.state != nullptr, InvalidArgument,
             "Backward: the forward ran with save_for_backward = false");
  const ParallelState& s = *forward.state;
  const int64_t t_num = s.x.size(0), m_dim = c.model_dim;
  threads = std::max(1, threads);
  ExpectFloating("dy", dy_in);
  ExpectShape("dy", dy_in, {t_num, m_dim});
  CheckShard(params.experts, spec_, c.gated, c.fc_bias);
  CheckVariants(c, params);
  if (c.check_finite) {
    moe::CheckFinite(fmt::format("dy (rank {})", coords().rank), dy_in);
    moe::CheckFinite("gate.weight", params.gate_weight);
    CheckFiniteShard(params.experts, coords().rank);
  }
  const Tensor dy = ToFloat32(dy_in);

  // The variants give the experts' output its gradient; then combine -> experts -> dispatch, in
  // reverse, and the gate.
  Tensor dx;
  Tensor d_moe = dy;
  if (moe::HasVariants(c)) {
    moe::VariantGradients vg =
        moe::VariantsBackward(c, params, s.variants, s.x, dy, &g.params, threads);
    d_moe = vg.d_moe_y;
    dx = vg.x;
  }
  const internal::ExpertKernels experts{{c.activation, c.gated}, threads};
  internal::DispatchGradients dg = s.step->Backward(s.Input(), experts, d_moe, st);
  if (dx.defined()) {
    internal::AddInto(dx, dg.x);
  } else {
    dx = dg.x;
  }
  internal::TraceSpan gate_span("gate backward");
  std::vector<float> d_gates = moe::CombineWeightsBackward(c, s.gate, s.plan, dg.weights);
  std::vector<float> d_scores = moe::GateValuesBackward(c, s.gate, d_gates);
  moe::GateLossSums concat_batch;
  const moe::GateLossSums* batch = s.has_batch_sums ? &s.batch_sums : nullptr;
  if (batch != nullptr && concat_total != nullptr && c.aux_loss == moe::AuxLoss::kHfConcat) {
    concat_batch = s.batch_sums;
    moe::UseConcatenationCounts(c, *concat_total, &concat_batch);
    batch = &concat_batch;
  }
  moe::GateGradients gg =
      moe::GateBackward(c, s.gate, s.x, params.gate_weight, d_scores,
                        c.aux_loss_coef * s.aux_coef_scale, c.z_loss_coef * s.z_coef_scale, batch);
  internal::AddInto(dx, gg.x);
  g.x = s.x_dtype == DType::kFloat32 ? dx : dx.To(s.x_dtype);
  g.params.gate_weight = gg.gate_weight;
  g.params.experts = internal::ReduceComputeGrads(*groups_, dg.experts, spec_, s.r, st);
  return g;
}

std::vector<int64_t> ParallelMoeLayer::BatchExpertLoads(const ParallelOutput& forward,
                                                        CommStats* stats) {
  std::vector<int64_t> loads = forward.layer.expert_loads;
  internal::AllReduceSum(groups_->Get(GroupKind::kTokens), loads, Traffic::kRouting, stats);
  return loads;
}

void ParallelMoeLayer::SyncGradients(moe::LayerParams* grads, bool mean, CommStats* stats) {
  internal::ScopedTotal total(stats);
  internal::ScopedTraceContext trace(tracer_, coords().rank, "sync");
  comm::Communicator& tokens = groups_->Get(GroupKind::kTokens);
  comm::Communicator& holders =
      groups_->Get(dedup_ ? GroupKind::kExpertHolders : GroupKind::kExpertData);
  const float scale = mean ? 1.0f / static_cast<float>(mesh().data_shards()) : 1.0f;
  auto sync = [&](comm::Communicator& group, const Tensor& t) {
    if (!t.defined()) return;
    internal::AllReduceSum(group, t, Traffic::kWeights, stats);
    if (scale != 1.0f) {
      float* p = t.data<float>();
      for (int64_t i = 0; i < t.numel(); ++i) p[i] *= scale;
    }
  };
  sync(tokens, grads->gate_weight);
  // The variants are dense and see each rank's own tokens: summed like the gate.
  for (const moe::ExpertWeights* w : {&grads->residual_mlp, &grads->shared_mlp}) {
    for (const Tensor* t :
         {&w->fc1_weight, &w->fc1_bias, &w->fc2_weight, &w->fc2_bias, &w->fc3_weight}) {
      sync(tokens, *t);
    }
  }
  sync(tokens, grads->coefficient_weight);
  sync(tokens, grads->coefficient_bias);
  moe::ExpertWeights& e = grads->experts;
  for (const Tensor* t : {&e.fc1_weight, &e.fc1_bias, &e.fc2_weight, &e.fc2_bias, &e.fc3_weight}) {
    sync(holders, *t);
  }
}

}  // namespace switchyard::parallel
