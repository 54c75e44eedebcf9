#include "switchyard/parallel/moe_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <limits>

#include "parallel/allgather_dispatch.h"
#include "parallel/collectives.h"
#include "parallel/exchange.h"
#include "parallel/expert_weights.h"
#include "parallel/routing.h"
#include "parallel/shadow.h"
#include "parallel/trace_context.h"
#include "switchyard/core/error.h"
#include "switchyard/moe/dispatch.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/losses.h"
#include "switchyard/moe/plan.h"

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

// What the backward needs.
struct ParallelState {
  enum class Mode { kLocal, kExchange, kAllGather };
  Mode mode = Mode::kExchange;
  DType x_dtype = DType::kFloat32;
  Tensor x;  // [T, M] float32
  moe::GateResult gate;
  moe::DispatchPlan plan;
  bool has_batch_sums = false;
  moe::GateLossSums batch_sums;
  int r = 1;
  moe::ExpertWeights weights;                      // the weights computed with (gathered)
  moe::ExpertActivations acts;                     // kLocal, kAllGather
  std::vector<moe::ExpertActivations> phase_acts;  // kExchange: per pipeline phase
  moe::ExpertActivations shadow_acts;              // kExchange with shadowed experts
  std::shared_ptr<internal::ShadowExperts> shadow;
  Tensor expert_out;  // rows computed by this rank (kAllGather)
  Tensor out_buf;     // expert outputs in the plan's buffer layout (kLocal, kExchange)
  std::shared_ptr<internal::TokenExchange> exchange;
  std::shared_ptr<internal::AllGatherDispatch> allgather;
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

Tensor ToFloat32(const Tensor& t) {
  return t.dtype() == DType::kFloat32 ? t : t.To(DType::kFloat32);
}

double ExpertParamCount(const moe::LayerConfig& c) {
  const double m = static_cast<double>(c.model_dim), h = static_cast<double>(c.hidden_dim);
  double per = h * m * (c.gated ? 3.0 : 2.0) + (c.fc_bias ? h + m : 0.0);
  return per * static_cast<double>(c.num_experts);
}

void AddInto(const Tensor& dst, const Tensor& src) {
  float* d = dst.data<float>();
  const float* s = src.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
}

// sum += g for every defined tensor (sum empty: takes g).
void Accumulate(moe::ExpertWeights* sum, const moe::ExpertWeights& g) {
  if (!sum->fc1_weight.defined()) {
    *sum = g;
    return;
  }
  AddInto(sum->fc1_weight, g.fc1_weight);
  AddInto(sum->fc2_weight, g.fc2_weight);
  if (g.fc1_bias.defined()) AddInto(sum->fc1_bias, g.fc1_bias);
  if (g.fc2_bias.defined()) AddInto(sum->fc2_bias, g.fc2_bias);
  if (g.fc3_weight.defined()) AddInto(sum->fc3_weight, g.fc3_weight);
}

}  // namespace

Mesh LayerMesh(const moe::LayerConfig& config, const ParallelOptions& options, int world_size) {
  MeshConfig mc = options.mesh;
  if (mc.world_size == 0 || mc.world_size == 1) mc.world_size = world_size;
  SY_REQUIRE(mc.world_size == world_size, InvalidArgument,
             "mesh world size {} differs from the communicator's {} ranks", mc.world_size,
             world_size);
  return Mesh(mc, config.num_experts, config.hidden_dim);
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
    return fmt::format("world {}, tp {}, ep {}, etp {}, arrangement {}, {} H-shard(s) per expert",
                       m.world_size(), m.tp(), m.ep(), m.config().etp,
                       ArrangementName(m.arrangement()), m.shards());
  };
  const bool same = want.world_size() == have.world_size() && want.tp() == have.tp() &&
                    want.ep() == have.ep() && want.config().etp == have.config().etp &&
                    want.arrangement() == have.arrangement() && want.shards() == have.shards();
  SY_REQUIRE(same, InvalidArgument,
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
  SY_REQUIRE(!config_.residual_moe && config_.shared_expert_hidden == 0, InvalidArgument,
             "the parallel layer does not support residual_moe or shared experts yet (run them "
             "as dense layers around it)");
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
  cost_ = options_.cost_model;
  spec_ = ShardOf(mesh, groups_->world().rank(), config_.model_dim);
}

ParallelMoeLayer::~ParallelMoeLayer() = default;

moe::LayerParams ParallelMoeLayer::ShardParams(const moe::LayerParams& full) const {
  moe::LayerParams p;
  p.gate_weight = full.gate_weight;
  p.expert_bias = full.expert_bias;
  p.experts = ShardExperts(full.experts, spec_);
  return p;
}

const CostModel& ParallelMoeLayer::ResolvedCostModel(int threads) {
  if (!cost_resolved_) {
    if (!cost_.complete()) {
      cost_ = MeasureCostModel(groups_->Get(GroupKind::kExpert), cost_, config_.model_dim,
                               config_.hidden_dim, threads);
    }
    cost_resolved_ = true;
  }
  return cost_;
}

int ParallelMoeLayer::ResolveSmartGroup(const moe::DispatchPlan& plan, int threads,
                                        CommStats* stats) {
  if (options_.smart_group != kSmartAuto) return options_.smart_group;
  comm::Communicator& expert = groups_->Get(GroupKind::kExpert);
  const int p = expert.size();
  if (p == 1) return kSmartOff;
  int64_t kept = 0;
  for (int64_t n : plan.counts) kept += n;
  std::vector<int64_t> rows{kept};
  internal::AllReduceMax(expert, rows, Traffic::kRouting, stats);
  const CostModel& model = ResolvedCostModel(threads);
  const double m = static_cast<double>(config_.model_dim);
  const double bytes = static_cast<double>(rows[0]) * m * 4.0 * (p - 1) / p;
  const double flops = static_cast<double>(rows[0]) *
                       moe::ExpertFlops(1, config_.model_dim, config_.hidden_dim, config_.gated);
  return ChooseSmartGroup(p, bytes, flops, model);
}

std::vector<int64_t> ParallelMoeLayer::ChooseShadows(const moe::DispatchPlan& plan, int r,
                                                     int threads, CommStats* stats) {
  const ShadowOptions& o = options_.shadow;
  if (o.policy == ShadowPolicy::kNone || r != 1) return {};
  if (o.policy == ShadowPolicy::kList) {
    std::vector<int64_t> list = o.experts;
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
    return list;
  }
  comm::Communicator& expert = groups_->Get(GroupKind::kExpert);
  ShadowProblem pr;
  pr.ranks = expert.size();
  pr.num_experts = config_.num_experts;
  pr.counts = internal::AllGather(expert, plan.counts, Traffic::kRouting, stats);
  pr.model_dim = config_.model_dim;
  pr.hidden_dim = config_.hidden_dim;
  pr.gated = config_.gated;
  pr.bias = config_.fc_bias;
  return ChooseShadowExperts(pr, ResolvedCostModel(threads));
}

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
  ExpectFloating("x", x);
  ExpectShape("x", x, {kAnySize, c.model_dim});
  ExpectDType("gate.weight", params.gate_weight, DType::kFloat32);
  ExpectShape("gate.weight", params.gate_weight, {c.num_experts, c.model_dim});
  CheckShard(params.experts, spec_, c.gated, c.fc_bias);
  SY_REQUIRE(options.global_token_offset >= 0, InvalidArgument,
             "global_token_offset: expected >= 0, got {}", options.global_token_offset);
  if (c.check_finite) {
    // As moe::MoeLayer does; a rank that throws here fails its peers' next collective.
    moe::CheckFinite(
        fmt::format("x (rank {}, tokens from {})", coords().rank, options.global_token_offset), x);
    moe::CheckFinite("gate.weight", params.gate_weight);
    moe::CheckFinite("gate.expert_bias", params.expert_bias);
    CheckFiniteShard(params.experts, coords().rank);
  }
  const int threads = std::max(1, options.threads);
  const int64_t t_num = x.size(0), e_num = c.num_experts, m_dim = c.model_dim;
  const bool global = options_.batch_scope == BatchScope::kGlobal;
  comm::Communicator& tokens = groups_->Get(GroupKind::kTokens);
  comm::Communicator& expert = groups_->Get(GroupKind::kExpert);

  auto state = std::make_shared<ParallelState>();
  ParallelState& s = *state;
  s.x_dtype = x.dtype();
  s.x = ToFloat32(x);
  {
    internal::TraceSpan span("gate");
    s.gate = moe::GateForward(c, s.x, params.gate_weight, params.expert_bias,
                              {options.global_token_offset, options.step, options.training});
  }
  const int64_t k = s.gate.top_k;

  // Losses: of the whole batch in the global scope (per-expert sums added over the token shards).
  moe::GateLossSums sums = moe::ComputeGateLossSums(c, s.gate);
  if (global) {
    std::vector<double> v = sums.ToVector();
    internal::AllReduceSum(tokens, v, Traffic::kRouting, st);
    s.batch_sums = moe::GateLossSums::FromVector(c, v);
    s.has_batch_sums = true;
  }
  moe::GateLosses losses = moe::GateLossesFromSums(c, global ? s.batch_sums : sums);

  // Routing: capacity, slots, drops.
  internal::PairDecisions dec;
  if (global) {
    dec =
        internal::GlobalDecisions(c, s.gate, options.global_token_offset, options.step, tokens, st);
  } else {
    std::optional<int64_t> max_load;
    if (!c.dropless && !c.capacity && c.capacity_factor <= 0) {
      std::vector<int64_t> loads(static_cast<size_t>(e_num), 0);
      for (size_t i = 0; i < s.gate.experts.size(); ++i) {
        if (s.gate.routed[i]) ++loads[static_cast<size_t>(s.gate.experts[i])];
      }
      std::vector<int64_t> v{*std::max_element(loads.begin(), loads.end())};
      internal::AllReduceMax(expert, v, Traffic::kRouting, st);
      max_load = v[0];
    }
    dec = internal::PerRankDecisions(c, s.gate,
                                     {options.global_token_offset, options.step, max_load});
  }

  // Adaptive r and the rows per expert on the wire.
  const int n = mesh().shards();
  int64_t buffer_capacity = dec.local_capacity;
  const bool fixed_wire = options_.dispatch == DispatchKind::kAllToAll;
  const int requested_r =
      options.adaptive_r == kAdaptiveRDefault ? options_.adaptive_r : options.adaptive_r;
  if (fixed_wire || requested_r == kAdaptiveRAuto) {
    std::vector<int64_t> v{buffer_capacity};
    internal::AllReduceMax(expert, v, Traffic::kRouting, st);
    buffer_capacity = v[0];
  }
  const double capacity_volume = static_cast<double>(e_num * buffer_capacity * m_dim);
  s.r = ResolveAdaptiveR(requested_r, capacity_volume);
  const int tp_shares = dedup_ ? groups_->Get(GroupKind::kTensor).size() : 1;
  const int tp_share = dedup_ ? groups_->Get(GroupKind::kTensor).rank() : 0;
  int64_t stride = 0;
  const int degree = s.r >= 1 ? options_.overlap_degree : 1;
  if (fixed_wire && s.r >= 1) {
    const int64_t slices = static_cast<int64_t>(tp_shares) * (n / s.r) * degree;
    stride = (buffer_capacity + slices - 1) / slices * slices;
  }
  if (!c.dropless) moe::RequireExpertBufferMemory(c, e_num, std::max(stride, buffer_capacity));
  {
    internal::TraceSpan span("plan");
    s.plan = internal::LayoutPlan(dec, stride);
  }
  out.adaptive_r = s.r;
  out.predicted_volume = PredictedVolume(s.r, capacity_volume, ExpertParamCount(c), c.num_experts);
  out.buffer_capacity = stride > 0 ? stride : buffer_capacity;

  // Experts.
  const moe::ExpertOptions eopt{c.activation, c.gated};
  s.weights = internal::GatherComputeWeights(*groups_, params.experts, spec_, s.r, st);
  Tensor y;
  if (s.r == 0) {
    s.mode = ParallelState::Mode::kLocal;
    Tensor buf = moe::Dispatch(s.plan, s.x, c.prescore, threads);
    s.out_buf = moe::ExpertsForward(
        eopt, s.weights, buf, internal::ShareGroups(s.plan, tp_shares, tp_share), &s.acts, threads);
    if (dedup_) internal::GatherTpShares(groups_->Get(GroupKind::kTensor), s.plan, s.out_buf, st);
  } else if (options_.dispatch == DispatchKind::kAllGather) {
    s.mode = ParallelState::Mode::kAllGather;
    s.allgather = std::make_shared<internal::AllGatherDispatch>(
        expert, internal::AllGatherSpec{n, s.r, mesh().local_experts(), c.prescore}, s.plan, s.x,
        st);
    s.expert_out = moe::ExpertsForward(eopt, s.weights, s.allgather->expert_input(),
                                       s.allgather->groups(), &s.acts, threads);
    y = s.allgather->Combine(s.expert_out, st);
  } else {
    s.mode = ParallelState::Mode::kExchange;
    internal::ExchangeSpec es;
    es.shards = n;
    es.r = s.r;
    es.local_experts = mesh().local_experts();
    es.tp_shares = tp_shares;
    es.tp_share = tp_share;
    es.fixed = fixed_wire;
    if (options_.hierarchical_ranks_per_node > 0) {
      es.options.algorithm = comm::Algorithm::kHierarchical;
      es.options.ranks_per_node = options_.hierarchical_ranks_per_node;
    }
    es.overlap_degree = degree;
    es.smart_group = ResolveSmartGroup(s.plan, threads, st);
    std::vector<int64_t> shadowed = ChooseShadows(s.plan, s.r, threads, st);
    if (!shadowed.empty()) {
      s.shadow = std::make_shared<internal::ShadowExperts>(expert, std::move(shadowed),
                                                           mesh().local_experts(), s.weights);
      es.skip = s.shadow->Mask(e_num);
    }
    s.exchange = std::make_shared<internal::TokenExchange>(expert, es, s.plan, st);
    out.overlap_degree = degree;
    out.smart_group = es.smart_group;
    if (s.shadow) out.shadowed = s.shadow->experts();
    Tensor buf;
    {
      internal::TraceSpan span("encode");
      buf = moe::Dispatch(s.plan, s.x, c.prescore, threads);
    }
    if (s.shadow) s.shadow->StartBroadcast();
    Tensor shadow_out;
    std::function<void()> local_work;
    if (s.shadow) {
      local_work = [&] {
        s.shadow->FinishBroadcast(st);
        internal::TraceSpan span("shadow experts");
        shadow_out = moe::ExpertsForward(eopt, s.shadow->weights(), buf, s.shadow->Groups(s.plan),
                                         &s.shadow_acts, threads);
      };
    }
    s.phase_acts.resize(static_cast<size_t>(s.exchange->phases()));
    s.out_buf = s.exchange->Pipeline(
        buf,
        [&](int phase, const Tensor& rows) {
          return moe::ExpertsForward(eopt, s.weights, rows, s.exchange->phase_groups(phase),
                                     &s.phase_acts[static_cast<size_t>(phase)], threads);
        },
        local_work, st);
    if (shadow_out.defined()) AddInto(s.out_buf, shadow_out);
    if (dedup_) internal::GatherTpShares(groups_->Get(GroupKind::kTensor), s.plan, s.out_buf, st);
  }
  if (s.mode != ParallelState::Mode::kAllGather) {
    internal::TraceSpan span("decode");
    y = moe::Combine(s.plan, s.out_buf, c.prescore, threads);
  }

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
  if (options.save_for_backward) out.state = std::move(state);
  return out;
}

ParallelGradients ParallelMoeLayer::Backward(const moe::LayerParams& params,
                                             const ParallelOutput& forward, const Tensor& dy_in,
                                             int threads) {
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
  if (c.check_finite) {
    moe::CheckFinite(fmt::format("dy (rank {})", coords().rank), dy_in);
    moe::CheckFinite("gate.weight", params.gate_weight);
    CheckFiniteShard(params.experts, coords().rank);
  }
  const Tensor dy = ToFloat32(dy_in);
  const moe::ExpertOptions eopt{c.activation, c.gated};

  Tensor dx;
  std::vector<float> d_weights;
  moe::ExpertGradients eg;
  if (s.mode == ParallelState::Mode::kAllGather) {
    Tensor d_out = s.allgather->CombineBackward(dy, s.expert_out, st);
    eg = moe::ExpertsBackward(eopt, s.weights, s.acts, d_out, threads);
    internal::AllGatherDispatch::Grads ag = s.allgather->DispatchBackward(eg.input, st);
    dx = ag.x;
    d_weights = std::move(ag.weights);
  } else {
    moe::CombineGradients cg;
    {
      internal::TraceSpan span("decode backward");
      cg = moe::CombineBackward(s.plan, dy, s.out_buf, c.prescore, threads);
    }
    Tensor d_in_buf;
    if (s.mode == ParallelState::Mode::kLocal) {
      eg = moe::ExpertsBackward(eopt, s.weights, s.acts, cg.expert_out, threads);
      d_in_buf = eg.input;
    } else {
      Tensor shadow_d_in;
      std::function<void()> local_work;
      if (s.shadow) {
        local_work = [&] {
          internal::TraceSpan span("shadow experts backward");
          moe::ExpertGradients sg = moe::ExpertsBackward(eopt, s.shadow->weights(), s.shadow_acts,
                                                         cg.expert_out, threads);
          shadow_d_in = sg.input;
          s.shadow->StartReduce(sg.weights);
        };
      }
      d_in_buf = s.exchange->Pipeline(
          cg.expert_out,
          [&](int k, const Tensor& rows) {
            moe::ExpertGradients pg = moe::ExpertsBackward(
                eopt, s.weights, s.phase_acts[static_cast<size_t>(k)], rows, threads);
            Accumulate(&eg.weights, pg.weights);
            return pg.input;
          },
          local_work, st);
      if (shadow_d_in.defined()) AddInto(d_in_buf, shadow_d_in);
      if (s.shadow) s.shadow->FinishReduce(&eg.weights, st);
    }
    if (dedup_) internal::GatherTpShares(groups_->Get(GroupKind::kTensor), s.plan, d_in_buf, st);
    internal::TraceSpan encode_span("encode backward");
    moe::DispatchGradients dg = moe::DispatchBackward(s.plan, d_in_buf, s.x, c.prescore, threads);
    dx = dg.x;
    d_weights = cg.weights;
    for (size_t i = 0; i < d_weights.size(); ++i) d_weights[i] += dg.weights[i];
  }
  internal::TraceSpan gate_span("gate backward");
  std::vector<float> d_gates = moe::CombineWeightsBackward(c, s.gate, s.plan, d_weights);
  std::vector<float> d_scores = moe::GateValuesBackward(c, s.gate, d_gates);
  moe::GateGradients gg =
      moe::GateBackward(c, s.gate, s.x, params.gate_weight, d_scores, c.aux_loss_coef,
                        c.z_loss_coef, s.has_batch_sums ? &s.batch_sums : nullptr);
  AddInto(dx, gg.x);
  g.x = s.x_dtype == DType::kFloat32 ? dx : dx.To(s.x_dtype);
  g.params.gate_weight = gg.gate_weight;
  g.params.experts = internal::ReduceComputeGrads(*groups_, eg.weights, spec_, s.r, st);
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
  moe::ExpertWeights& e = grads->experts;
  for (const Tensor* t : {&e.fc1_weight, &e.fc1_bias, &e.fc2_weight, &e.fc2_bias, &e.fc3_weight}) {
    sync(holders, *t);
  }
}

}  // namespace switchyard::parallel
