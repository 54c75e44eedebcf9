#include "switchyard/train/moe_feed_forward.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "switchyard/core/clock.h"
#include "switchyard/core/rng.h"
#include "switchyard/moe/gate.h"
#include "switchyard/train/router_trace.h"

namespace switchyard::train {
namespace {

// What the backward needs besides the layer's own state.
struct MoeState {
  moe::LayerOutput out;
  std::shared_ptr<const ConcatAuxTotals> concat_totals;  // aux_loss hf_concat
};

}  // namespace

MoeFeedForward::MoeFeedForward(ParameterSet& params, const std::string& prefix,
                               moe::LayerConfig config, uint64_t seed)
    : layer_(config), prefix_(prefix), params_(&params) {
  layer_params_ = moe::InitParams(config, seed ^ (InitStream(prefix) - kStreamInit));
  for (const auto& [name, tensor] : moe::ParamsToMap(config, layer_params_)) {
    ParamOptions o;
    o.group = name.starts_with("experts.") ? ParamGroup::kExpert : ParamGroup::kDense;
    o.weight_decay = tensor.dim() >= 2 && name.ends_with(".weight");
    o.trainable = name != "gate.expert_bias";
    params.Add(prefix + name, tensor, o);
  }
}

FeedForwardOutput MoeFeedForward::Forward(const Tensor& x, const FeedForwardContext& context) {
  const double t0 = NowSeconds();
  moe::ForwardOptions o;
  o.global_token_offset = context.global_token_offset;
  if (context.token_index) o.token_index = *context.token_index;
  o.step = context.step;
  o.threads = context.threads;
  o.save_for_backward = context.save_for_backward;
  o.training = context.training;
  o.entropy = context.training;  // the step's router statistics (docs/observability.md)
  const moe::MoeLayer& layer = layer_;
  const bool global_aux = layer.config().aux_loss == moe::AuxLoss::kGlobal && context.training;
  const int64_t key = MicroBatchKey(context.global_token_offset, context.token_index.get());
  if (global_aux) o.aux_counts_so_far = aux_counts_.Before(context.step, key);
  TracedForward traced(router_trace_, prefix_, context.step, context.training, x.size(0),
                       context.global_token_offset, context.token_index.get(), layer.top_k());
  o.forced_experts = traced.forced;
  auto state = std::make_shared<MoeState>();
  RebindLayerParams(*params_, prefix_, &layer_params_);
  state->out = layer.Forward(layer_params_, x, o);
  state->concat_totals = context.concat_totals;
  traced.Record(state->out, context.save_for_backward);
  if (global_aux) aux_counts_.Add(context.step, key, state->out.aux_counts);
  FeedForwardOutput r =
      MoeFeedForwardOutput(layer.config(), state->out, x.size(0), layer_params_.expert_bias);
  if (context.save_for_backward) r.state = state;
  times_.seconds += NowSeconds() - t0;
  return r;
}

Tensor MoeFeedForward::Backward(const FeedForwardOutput& forward, const Tensor& dy,
                                float loss_scale, int threads) {
  SY_CHECK(forward.state != nullptr, "MoeFeedForward::Backward needs save_for_backward");
  const double t0 = NowSeconds();
  const auto& s = *static_cast<const MoeState*>(forward.state.get());
  const moe::MoeLayer& layer = layer_;
  // The layer differentiates sum(y * dy) + loss. For sum(y * dy) + loss_scale * loss, pass
  // dy / loss_scale and scale every gradient by loss_scale.
  Tensor d = dy;
  if (loss_scale != 1.0f) {
    SY_REQUIRE(loss_scale != 0.0f, InvalidArgument, "MoeFeedForward: loss_scale must not be 0");
    d = dy.Clone();
    float* p = d.data<float>();
    for (int64_t i = 0; i < d.numel(); ++i) p[i] /= loss_scale;
  }
  RebindLayerParams(*params_, prefix_, &layer_params_);
  moe::LayerGradients g =
      layer.Backward(layer_params_, s.out, d, threads, ConcatTotalsOf(s.concat_totals));
  for (const auto& [name, grad] : moe::ParamsToMap(layer.config(), g.params)) {
    Parameter& p = params_->Get(prefix_ + name);
    if (!p.options.trainable) continue;
    ExpectShape(p.name, grad, p.value.shape());
    float* dst = p.grad.data<float>();
    const float* src = grad.data<float>();
    for (int64_t i = 0; i < grad.numel(); ++i) dst[i] += loss_scale * src[i];
  }
  Tensor dx = g.x;
  if (loss_scale != 1.0f) {
    float* p = dx.data<float>();
    for (int64_t i = 0; i < dx.numel(); ++i) p[i] *= loss_scale;
  }
  times_.seconds += NowSeconds() - t0;
  return dx;
}

FeedForwardTimes MoeFeedForward::TakeTimes() { return std::exchange(times_, FeedForwardTimes{}); }

void MoeFeedForward::EndStep(std::span<const int64_t> global_expert_counts) {
  const moe::LayerConfig& c = layer_.config();
  if (!c.expert_bias) return;
  RebindLayerParams(*params_, prefix_, &layer_params_);
  moe::UpdateExpertBias(global_expert_counts, c.expert_bias_update_rate, layer_params_.expert_bias);
}

FeedForwardFactory MoeFeedForwardFactory(const moe::LayerConfig& config) {
  return MoeFeedForwardFactory([config](int64_t) { return config; });
}

FeedForwardFactory MoeFeedForwardFactory(
    std::function<moe::LayerConfig(int64_t block)> config_of_block) {
  return [config_of_block = std::move(config_of_block)](int64_t block, const std::string& prefix,
                                                        ParameterSet& params, uint64_t seed) {
    return std::make_unique<MoeFeedForward>(params, prefix, config_of_block(block), seed);
  };
}

const moe::RouterLoadSums* ConcatTotalsOf(const std::shared_ptr<const ConcatAuxTotals>& totals) {
  if (totals == nullptr) return nullptr;
  SY_CHECK(totals->ready,
           "aux_loss hf_concat: the micro-batch's totals are not set before its "
           "backward");
  return &totals->sums;
}

FeedForwardOutput MoeFeedForwardOutput(const moe::LayerConfig& config, const moe::LayerOutput& out,
                                       int64_t num_tokens, const Tensor& expert_bias) {
  FeedForwardOutput r;
  r.y = out.y;
  // hf_concat: the loss is the concatenation's, which the caller computes from routing's
  // concat_sums of every layer; this layer's own value is not a term of the objective.
  const bool concat = config.aux_loss == moe::AuxLoss::kHfConcat;
  const double l_aux = concat ? 0.0 : out.l_aux;
  r.aux_loss = l_aux;
  r.z_loss = out.z_loss;
  r.loss = static_cast<double>(config.aux_loss_coef) * l_aux +
           static_cast<double>(config.z_loss_coef) * out.z_loss;
  RoutingStats& s = r.routing;
  s.expert_loads = out.expert_loads;
  s.expert_counts = out.expert_counts;
  for (int64_t l : out.expert_loads) s.routed += l;
  s.dropped = out.dropped;
  s.num_tokens = num_tokens;
  s.entropy_sum = out.entropy_sum;
  s.l_aux = l_aux;
  s.z_loss = out.z_loss;
  s.concat_sums = out.concat_sums;
  if (expert_bias.defined() && expert_bias.numel() > 0) {
    const float* b = expert_bias.data<float>();
    const auto [lo, hi] = std::minmax_element(b, b + expert_bias.numel());
    s.bias_min = *lo;
    s.bias_max = *hi;
  }
  return r;
}

void RebindLayerParams(const ParameterSet& params, const std::string& prefix,
                       moe::LayerParams* layer) {
  auto rebind = [&](const std::string& name, Tensor& t) {
    if (!t.defined()) return;
    const Parameter* p = params.Find(prefix + name);
    if (p != nullptr && !p->value.SharesStorageWith(t)) t = p->value;
  };
  auto mlp = [&](const std::string& group, moe::ExpertWeights& w) {
    rebind(group + "fc1.weight", w.fc1_weight);
    rebind(group + "fc1.bias", w.fc1_bias);
    rebind(group + "fc2.weight", w.fc2_weight);
    rebind(group + "fc2.bias", w.fc2_bias);
    rebind(group + "fc3.weight", w.fc3_weight);
  };
  rebind("gate.weight", layer->gate_weight);
  rebind("gate.expert_bias", layer->expert_bias);
  mlp("experts.", layer->experts);
  mlp("residual_mlp.", layer->residual_mlp);
  rebind("coefficient.weight", layer->coefficient_weight);
  rebind("coefficient.bias", layer->coefficient_bias);
  mlp("shared_experts.", layer->shared_mlp);
}

}  // namespace switchyard::train
