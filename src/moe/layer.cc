#include "switchyard/moe/layer.h"

#include <cmath>
#include <cstring>

#include "moe/parallel_for.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/rng.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/moe/dispatch.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/losses.h"
#include "switchyard/moe/plan.h"
#include "switchyard/moe/router_stats.h"
#include "switchyard/moe/variants.h"

namespace switchyard::moe {

struct LayerState {
  DType x_dtype = DType::kFloat32;
  Tensor x;  // [T, M] float32
  GateResult gate;
  DispatchPlan plan;
  Tensor expert_out;  // [num_rows, M]
  ExpertActivations experts;
  VariantState variants;  // residual_moe, shared experts
  // aux_loss global: the loss sums with the running mean of the counts (the backward's batch);
  // hf_concat: this layer's sums (the backward replaces the counts by the concatenation's).
  std::optional<GateLossSums> loss_sums;
};

namespace {

using kernels::Trans;

constexpr int64_t kConvertGrain = 1 << 14;

Tensor ToFloat32(const Tensor& t, int threads) {
  if (t.dtype() == DType::kFloat32) return t;
  Tensor out = Tensor::Empty(t.shape());
  const BFloat16* src = t.data<BFloat16>();
  float* dst = out.data<float>();
  ParallelFor(t.numel(), threads, kConvertGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = static_cast<float>(src[i]);
  });
  return out;
}

Tensor FromFloat32(const Tensor& t, DType dtype, int threads) {
  if (dtype == DType::kFloat32) return t;
  Tensor out = Tensor::Empty(t.shape(), dtype);
  const float* src = t.data<float>();
  BFloat16* dst = out.data<BFloat16>();
  ParallelFor(t.numel(), threads, kConvertGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = BFloat16(src[i]);
  });
  return out;
}

ExpertOptions OptionsOf(const LayerConfig& c) { return {c.activation, c.gated}; }

struct NamedSlot {
  std::string name;
  Shape shape;
  Tensor LayerParams::*member = nullptr;
  ExpertWeights LayerParams::*group = nullptr;
  Tensor ExpertWeights::*weight = nullptr;
  int64_t fan_in = 0;  // InitParams: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); 0: zeros
};

std::vector<NamedSlot> Slots(const LayerConfig& c) {
  const int64_t e = c.num_experts, m = c.model_dim, h = c.hidden_dim;
  std::vector<NamedSlot> s;
  s.push_back({"gate.weight", {e, m}, &LayerParams::gate_weight, nullptr, nullptr, m});
  if (c.expert_bias) s.push_back({"gate.expert_bias", {e}, &LayerParams::expert_bias});
  auto mlp = [&](const std::string& prefix, ExpertWeights LayerParams::*group, Shape lead,
                 int64_t hidden) {
    auto with = [&](std::initializer_list<int64_t> tail) {
      Shape sh = lead;
      sh.insert(sh.end(), tail);
      return sh;
    };
    s.push_back(
        {prefix + "fc1.weight", with({hidden, m}), nullptr, group, &ExpertWeights::fc1_weight, m});
    if (c.fc_bias) {
      s.push_back(
          {prefix + "fc1.bias", with({hidden}), nullptr, group, &ExpertWeights::fc1_bias, m});
    }
    s.push_back({prefix + "fc2.weight", with({m, hidden}), nullptr, group,
                 &ExpertWeights::fc2_weight, hidden});
    if (c.fc_bias) {
      s.push_back(
          {prefix + "fc2.bias", with({m}), nullptr, group, &ExpertWeights::fc2_bias, hidden});
    }
    if (c.gated) {
      s.push_back({prefix + "fc3.weight", with({hidden, m}), nullptr, group,
                   &ExpertWeights::fc3_weight, m});
    }
  };
  mlp("experts.", &LayerParams::experts, {e}, h);
  if (c.residual_moe) {
    mlp("residual_mlp.", &LayerParams::residual_mlp, {}, h);
    s.push_back(
        {"coefficient.weight", {2, m}, &LayerParams::coefficient_weight, nullptr, nullptr, m});
    if (c.fc_bias) {
      s.push_back({"coefficient.bias", {2}, &LayerParams::coefficient_bias, nullptr, nullptr, m});
    }
  }
  if (c.shared_expert_hidden > 0) {
    mlp("shared_experts.", &LayerParams::shared_mlp, {}, c.shared_expert_hidden);
  }
  return s;
}

Tensor& Member(LayerParams& p, const NamedSlot& s) {
  return s.member ? p.*(s.member) : (p.*(s.group)).*(s.weight);
}
const Tensor& Member(const LayerParams& p, const NamedSlot& s) {
  return s.member ? p.*(s.member) : (p.*(s.group)).*(s.weight);
}

void CheckParams(const LayerConfig& c, const LayerParams& p) {
  for (const NamedSlot& s : Slots(c)) {
    const Tensor& t = Member(p, s);
    ExpectDType(s.name, t, DType::kFloat32);
    ExpectShape(s.name, t, s.shape);
    if (c.check_finite) CheckFinite(s.name, t);
  }
}

void AddInto(const Tensor& dst, const Tensor& src) {
  float* d = dst.data<float>();
  const float* s = src.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
}

}  // namespace

void CheckFinite(std::string_view name, const Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  auto report = [&](int64_t i, double v) {
    int64_t rest = i;
    std::vector<int64_t> idx(t.shape().size());
    for (size_t d = t.shape().size(); d-- > 0;) {
      idx[d] = rest % t.shape()[d];
      rest /= t.shape()[d];
    }
    throw InvalidArgument(
        fmt::format("{}: element {} is {} (check_finite is on)", name, ShapeToString(idx), v));
  };
  if (t.dtype() == DType::kFloat32) {
    const float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (!std::isfinite(p[i])) report(i, p[i]);
    }
  } else if (t.dtype() == DType::kBFloat16) {
    const BFloat16* p = t.data<BFloat16>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      float v = static_cast<float>(p[i]);
      if (!std::isfinite(v)) report(i, v);
    }
  }
}

std::vector<std::pair<std::string, Shape>> ParamShapes(const LayerConfig& config) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const NamedSlot& s : Slots(config)) out.emplace_back(s.name, s.shape);
  return out;
}

LayerParams ParamsFromMap(const LayerConfig& config, const NamedTensors& tensors) {
  LayerParams p;
  for (const NamedSlot& s : Slots(config)) {
    auto it = tensors.find(s.name);
    SY_REQUIRE(it != tensors.end(), InvalidArgument,
               "missing tensor '{}' (expected shape {}, needed by the layer config)", s.name,
               ShapeToString(s.shape));
    ExpectFloating(s.name, it->second);
    ExpectShape(s.name, it->second, s.shape);
    Member(p, s) =
        it->second.dtype() == DType::kFloat32 ? it->second : it->second.To(DType::kFloat32);
  }
  return p;
}

NamedTensors ParamsToMap(const LayerConfig& config, const LayerParams& params) {
  NamedTensors out;
  for (const NamedSlot& s : Slots(config)) {
    const Tensor& t = Member(params, s);
    if (t.defined()) out[s.name] = t;
  }
  return out;
}

LayerParams InitParams(const LayerConfig& config, uint64_t seed) {
  LayerParams p;
  uint64_t bytes = 0;
  for (const NamedSlot& s : Slots(config)) {
    bytes += static_cast<uint64_t>(CheckedMul(NumElements(s.shape), 4, s.name));
  }
  RequireMemory(bytes, "the layer's parameters");
  uint64_t id = 0;
  for (const NamedSlot& s : Slots(config)) {
    Tensor t = Tensor::Zeros(s.shape);
    if (s.fan_in > 0) {
      float bound = 1.0f / std::sqrt(static_cast<float>(s.fan_in));
      CounterRng rng(seed, kStreamInit + id);
      float* d = t.data<float>();
      for (int64_t i = 0; i < t.numel(); ++i) {
        d[i] = bound * (2.0f * rng.Uniform(static_cast<uint64_t>(i)) - 1.0f);
      }
    }
    Member(p, s) = t;
    ++id;
  }
  return p;
}

MoeLayer::MoeLayer(LayerConfig config) : config_(std::move(config)) { ValidateConfig(config_); }

int64_t MoeLayer::top_k() const { return EffectiveTopK(config_); }

LayerOutput MoeLayer::Forward(const LayerParams& params, const Tensor& x,
                              const ForwardOptions& options) const {
  const LayerConfig& c = config_;
  const int threads = std::max(1, options.threads);
  ExpectFloating("x", x);
  ExpectShape("x", x, {kAnySize, c.model_dim});
  CheckParams(c, params);
  if (c.check_finite) CheckFinite("x", x);
  SY_REQUIRE(options.global_token_offset >= 0, InvalidArgument,
             "global_token_offset: expected >= 0, got {}", options.global_token_offset);
  const int64_t t_num = x.size(0), k = top_k();

  auto state = std::make_shared<LayerState>();
  LayerState& s = *state;
  s.x_dtype = x.dtype();
  s.x = ToFloat32(x, threads);
  s.gate = GateForward(c, s.x, params.gate_weight, params.expert_bias,
                       {options.global_token_offset, options.step, options.training,
                        options.token_index, options.forced_experts});
  GateLossSums sums = ComputeGateLossSums(c, s.gate);
  std::vector<double> aux_counts;
  if (c.aux_loss == AuxLoss::kGlobal) {
    aux_counts = sums.choices;
    UseRunningMeanCounts(
        c, options.aux_counts_so_far ? *options.aux_counts_so_far : AuxCountsSoFar{}, &sums);
    s.loss_sums = sums;
  }
  if (c.aux_loss == AuxLoss::kHfConcat) s.loss_sums = sums;
  const GateLosses losses = GateLossesFromSums(c, sums);
  s.plan = MakeDispatchPlan(
      c, s.gate,
      {options.global_token_offset, options.step, options.global_max_load, options.token_index});
  const ExpertOptions eopt = OptionsOf(c);
  Tensor expert_in = Dispatch(s.plan, s.x, c.prescore, threads);
  s.expert_out =
      ExpertsForward(eopt, params.experts, expert_in, GroupsOf(s.plan), &s.experts, threads);
  Tensor y = Combine(s.plan, s.expert_out, c.prescore, threads);

  y = VariantsForward(c, params, s.x, y, &s.variants, threads);

  LayerOutput out;
  out.y = FromFloat32(y, x.dtype(), threads);
  out.l_aux = losses.l_aux;
  out.z_loss = losses.z_loss;
  out.capacity = s.plan.capacity;
  out.topk_idx = Tensor::FromVector(s.gate.experts, {t_num, k});
  out.locations = Tensor::FromVector(s.plan.slots, {t_num, k});
  out.gates = Tensor::FromVector(s.gate.gates, {t_num, k});
  out.combine_weights = Tensor::FromVector(s.plan.weights, {t_num, k});
  out.expert_loads = s.plan.loads;
  out.expert_counts = s.plan.counts;
  out.dropped = s.plan.dropped;
  out.aux_counts = std::move(aux_counts);
  out.concat_sums = ConcatSumsOf(c, sums);
  if (options.entropy) out.entropy_sum = RouterEntropySum(c, s.gate);
  if (options.save_for_backward) out.state = std::move(state);
  return out;
}

LayerGradients MoeLayer::Backward(const LayerParams& params, const LayerOutput& forward,
                                  const Tensor& dy_in, int threads,
                                  const RouterLoadSums* concat_total) const {
  const LayerConfig& c = config_;
  threads = std::max(1, threads);
  SY_REQUIRE(forward.state != nullptr, InvalidArgument,
             "Backward: the forward ran with save_for_backward = false");
  const LayerState& s = *forward.state;
  const int64_t t_num = s.x.size(0), m_dim = c.model_dim;
  ExpectFloating("dy", dy_in);
  ExpectShape("dy", dy_in, {t_num, m_dim});
  if (c.check_finite) CheckFinite("dy", dy_in);
  CheckParams(c, params);
  const Tensor dy = ToFloat32(dy_in, threads);
  const ExpertOptions eopt = OptionsOf(c);
  LayerGradients g;

  // Variants first: they give the MoE part its output gradient.
  VariantGradients vg = VariantsBackward(c, params, s.variants, s.x, dy, &g.params, threads);
  const Tensor& d_moe = vg.d_moe_y;
  Tensor dx = vg.x;

  // combine -> experts -> dispatch -> combine weights -> gate values -> gate.
  CombineGradients cg = CombineBackward(s.plan, d_moe, s.expert_out, c.prescore, threads);
  ExpertGradients eg = ExpertsBackward(eopt, params.experts, s.experts, cg.expert_out, threads);
  g.params.experts = eg.weights;
  DispatchGradients dg = DispatchBackward(s.plan, eg.input, s.x, c.prescore, threads);
  AddInto(dx, dg.x);
  std::vector<float> d_weights = cg.weights;
  for (size_t i = 0; i < d_weights.size(); ++i) d_weights[i] += dg.weights[i];
  std::vector<float> d_gates = CombineWeightsBackward(c, s.gate, s.plan, d_weights);
  std::vector<float> d_scores = GateValuesBackward(c, s.gate, d_gates);
  std::optional<GateLossSums> batch = s.loss_sums;
  if (batch && concat_total != nullptr) UseConcatenationCounts(c, *concat_total, &*batch);
  GateGradients gg = GateBackward(c, s.gate, s.x, params.gate_weight, d_scores, c.aux_loss_coef,
                                  c.z_loss_coef, batch ? &*batch : nullptr);
  AddInto(dx, gg.x);
  g.params.gate_weight = gg.gate_weight;
  g.x = FromFloat32(dx, s.x_dtype, threads);
  return g;
}

}  // namespace switchyard::moe
