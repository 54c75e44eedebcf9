// The layer against the plain reference (reference_moe.h) for every option: forward outputs,
// routing, losses, and every gradient against central finite differences of the float64
// reference.
#include "switchyard/moe/layer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "moe/reference_moe.h"
#include "switchyard/core/rng.h"
#include "switchyard/moe/gate.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

using testing::RefOptions;
using testing::RefParams;

std::vector<float> Floats(const Tensor& t) {
  Tensor f = t.dtype() == DType::kFloat32 ? t : t.To(DType::kFloat32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

struct Variant {
  std::string name;
  std::function<void(LayerConfig&)> edit;
  int64_t tokens = 13;  // not a multiple of E
  // Adjusts the random parameters.
  std::function<void(const LayerConfig&, LayerParams&)> edit_params = nullptr;
  int64_t global_token_offset = 0;
  bool skew = false;     // every token prefers expert 0 (extreme imbalance)
  bool training = true;  // the calls' mode (ForwardOptions::training)
};

// gtest prints the parameter of a failing test with this.
void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

LayerConfig BaseConfig() {
  LayerConfig c;
  c.model_dim = 6;
  c.hidden_dim = 5;
  c.num_experts = 4;
  c.top_k = 2;
  c.capacity_factor = 1.0f;
  c.aux_loss_coef = 0.3f;
  c.z_loss_coef = 0.05f;
  c.seed = 7;
  return c;
}

// All tokens prefer expert 0: its gate row aligns with a constant direction of x.
void SkewToExpertZero(const LayerConfig& c, LayerParams& p) {
  float* w = p.gate_weight.data<float>();
  for (int64_t m = 0; m < c.model_dim; ++m) w[m] = 3.0f;
}

// Large enough to change some choices under every score function (checked by
// ForwardMatchesReference), small enough not to change all of them.
void SetExpertBias(const LayerConfig&, LayerParams& p) {
  float* b = p.expert_bias.data<float>();
  b[0] = 0.3f;
  b[1] = -0.2f;
  b[2] = 0.05f;
  b[3] = -0.1f;
}

std::vector<Variant> Variants() {
  using C = LayerConfig;
  return {
      {"default", [](C&) {}},
      {"top1", [](C& c) { c.top_k = 1; }},
      {"top3", [](C& c) { c.top_k = 3; }},
      {"k_equals_E", [](C& c) { c.top_k = 4; }},
      {"k_greater_than_E_clamped", [](C& c) { c.top_k = 7; }},
      {"sigmoid", [](C& c) { c.score_function = ScoreFunction::kSigmoid; }},
      {"softmax_after_topk", [](C& c) { c.score_function = ScoreFunction::kSoftmaxAfterTopK; }},
      {"no_normalize_gate", [](C& c) { c.normalize_gate = false; }},
      {"tutel_noise",
       [](C& c) {
         c.noise = NoiseKind::kTutelNormal;
         c.noise_std = 2.0f;
       },
       13, nullptr, 1000},
      {"jitter",
       [](C& c) {
         c.noise = NoiseKind::kJitter;
         c.jitter_eps = 0.1f;
       }},
      {"gumbel_second", [](C& c) { c.noise = NoiseKind::kGumbelSecond; }},
      {"gumbel_top3",
       [](C& c) {
         c.noise = NoiseKind::kGumbelSecond;
         c.top_k = 3;
       }},
      {"noise_off_when_not_training", [](C& c) { c.noise = NoiseKind::kTutelNormal; }, 13, nullptr,
       0, false,
       /*training=*/false},
      {"random_routing", [](C& c) { c.random_routing = true; }},
      // Removed 2nd choices free slots for later pairs; survivors are renormalized.
      {"random_routing_drops_renormalize",
       [](C& c) {
         c.random_routing = true;
         c.capacity_factor = 0.5f;
         c.renormalize_after_drop = true;
       }},
      {"random_routing_top3",  // only the 2nd choice is tested; the 3rd always stays
       [](C& c) {
         c.random_routing = true;
         c.top_k = 3;
       }},
      {"expert_bias", [](C& c) { c.expert_bias = true; }, 13, SetExpertBias},
      // softmax_after_topk ranks logits + bias; the gates are the softmax of the unbiased logits.
      {"expert_bias_softmax_after_topk",
       [](C& c) {
         c.expert_bias = true;
         c.score_function = ScoreFunction::kSoftmaxAfterTopK;
       },
       13, SetExpertBias},
      {"expert_bias_sigmoid",
       [](C& c) {
         c.expert_bias = true;
         c.score_function = ScoreFunction::kSigmoid;
       },
       13, SetExpertBias},
      {"drops_position", [](C& c) { c.capacity_factor = 0.5f; }},
      {"drops_probs",
       [](C& c) {
         c.capacity_factor = 0.5f;
         c.drop_policy = DropPolicy::kProbs;
       }},
      {"drops_random",
       [](C& c) {
         c.capacity_factor = 0.5f;
         c.drop_policy = DropPolicy::kRandom;
       }},
      {"drops_renormalize",
       [](C& c) {
         c.capacity_factor = 0.5f;
         c.renormalize_after_drop = true;
       }},
      {"token_order_slots",
       [](C& c) {
         c.capacity_factor = 0.5f;
         c.slot_order = SlotOrder::kTokenOrder;
       }},
      {"batch_prioritized",
       [](C& c) {
         c.capacity_factor = 0.5f;
         c.batch_prioritized_routing = true;
       }},
      {"cf_zero", [](C& c) { c.capacity_factor = 0.0f; }},
      {"cf_negative", [](C& c) { c.capacity_factor = -0.5f; }},
      {"cf_zero_extreme_imbalance", [](C& c) { c.capacity_factor = 0.0f; }, 13, nullptr, 0, true},
      {"min_capacity_alignment",
       [](C& c) {
         c.capacity_factor = 0.5f;
         c.min_capacity = 5;
         c.alignment = 4;
       }},
      {"explicit_capacity", [](C& c) { c.capacity = 3; }},
      {"deepspeed_formula",
       [](C& c) {
         c.capacity_formula = CapacityFormula::kDeepSpeed;
         c.capacity_factor = 0.7f;
       }},
      {"every_token_dropped", [](C& c) { c.capacity = 0; }},
      {"experts_with_zero_tokens", [](C& c) { c.top_k = 1; }, 13, nullptr, 0, true},
      {"dropless", [](C& c) { c.dropless = true; }},
      {"dropless_imbalanced", [](C& c) { c.dropless = true; }, 13, nullptr, 0, true},
      {"prescore", [](C& c) { c.prescore = true; }},
      {"prescore_drops",
       [](C& c) {
         c.prescore = true;
         c.capacity_factor = 0.5f;
         c.renormalize_after_drop = true;
       }},
      {"relu", [](C& c) { c.activation = kernels::Activation::kRelu; }},
      {"silu", [](C& c) { c.activation = kernels::Activation::kSilu; }},
      {"swiglu",
       [](C& c) {
         c.activation = kernels::Activation::kSilu;
         c.gated = true;
       }},
      {"no_bias", [](C& c) { c.fc_bias = false; }},
      {"aux_all_choices",
       [](C& c) {
         c.aux_loss = AuxLoss::kGShardAllChoices;
         c.top_k = 3;
       }},
      {"aux_importance_load",
       [](C& c) {
         c.aux_loss = AuxLoss::kImportanceLoad;
         c.noise = NoiseKind::kTutelNormal;
         c.noise_std = 1.0f;
         c.aux_loss_coef = 10.0f;  // the loss's gradient dominates
       }},
      {"aux_importance_load_sigmoid",
       [](C& c) {
         c.aux_loss = AuxLoss::kImportanceLoad;
         c.score_function = ScoreFunction::kSigmoid;
         c.aux_loss_coef = 10.0f;
       }},
      {"aux_sigmoid",
       [](C& c) {
         c.score_function = ScoreFunction::kSigmoid;
         c.aux_loss_coef = 10.0f;
       }},
      {"aux_gshard_dominant", [](C& c) { c.aux_loss_coef = 10.0f; }},
      {"z_loss_dominant", [](C& c) { c.z_loss_coef = 10.0f; }},
      {"aux_none", [](C& c) { c.aux_loss = AuxLoss::kNone; }},
      {"residual_moe", [](C& c) { c.residual_moe = true; }},
      {"shared_expert", [](C& c) { c.shared_expert_hidden = 3; }},
      {"residual_shared_gated_nobias",
       [](C& c) {
         c.residual_moe = true;
         c.shared_expert_hidden = 3;
         c.gated = true;
         c.fc_bias = false;
       }},
      {"preset_deepspeed_top1",
       [](C& c) {
         c = PresetConfig("deepspeed", 1);
         c.model_dim = 6, c.hidden_dim = 5, c.num_experts = 4, c.capacity_factor = 0.6f;
         c.aux_loss_coef = 0.3f;
         c.min_capacity = 2;
       }},
      {"preset_deepspeed_top2",
       [](C& c) {
         c = PresetConfig("deepspeed", 2);
         c.model_dim = 6, c.hidden_dim = 5, c.num_experts = 4, c.capacity_factor = 0.5f;
         c.aux_loss_coef = 0.3f;
       }},
      {"preset_deepspeed_top3",
       [](C& c) {
         c = PresetConfig("deepspeed", 3);
         c.model_dim = 6, c.hidden_dim = 5, c.num_experts = 4, c.capacity_factor = 0.4f;
         c.aux_loss_coef = 0.3f;
       }},
      // ---- Megatron-Core / DeepSeek-V3 router options ----
      {"group_limited_top1_per_group",
       [](C& c) {
         c.num_experts = 8, c.num_groups = 4, c.group_topk = 2, c.top_k = 3;  // k/gk = 1
       }},
      {"group_limited_whole_group", [](C& c) { c.num_groups = 2, c.group_topk = 1, c.top_k = 2; }},
      {"group_limited_softmax_after_topk",
       [](C& c) {
         c.score_function = ScoreFunction::kSoftmaxAfterTopK;
         c.num_experts = 8, c.num_groups = 4, c.group_topk = 2, c.top_k = 4;
       }},
      {"deepseek_v3",
       [](C& c) {
         c.score_function = ScoreFunction::kSigmoid;
         c.num_experts = 8, c.num_groups = 4, c.group_topk = 2, c.top_k = 4;  // top-2 sums
         c.expert_bias = true;
         c.topk_scaling_factor = 2.5f;
         c.aux_loss = AuxLoss::kSequence, c.sequence_length = 6, c.aux_loss_coef = 10.0f;
       },
       12, SetExpertBias},
      {"topk_scaling_softmax", [](C& c) { c.topk_scaling_factor = 1.5f; }},
      {"topk_scaling_softmax_after_topk",
       [](C& c) {
         c.score_function = ScoreFunction::kSoftmaxAfterTopK;
         c.topk_scaling_factor = 2.0f;
       }},
      {"topk_scaling_sigmoid_top1",
       [](C& c) {
         c.score_function = ScoreFunction::kSigmoid;
         c.top_k = 1;
         c.topk_scaling_factor = 2.5f;
       }},
      {"aux_sequence",
       [](C& c) {
         c.aux_loss = AuxLoss::kSequence, c.sequence_length = 4, c.aux_loss_coef = 10.0f;
       },
       12},
      {"aux_sequence_softmax_after_topk_top3",
       [](C& c) {
         c.score_function = ScoreFunction::kSoftmaxAfterTopK, c.top_k = 3;
         c.aux_loss = AuxLoss::kSequence, c.sequence_length = 3, c.aux_loss_coef = 10.0f;
       },
       12},
      {"aux_sequence_one_sequence",
       [](C& c) {
         c.aux_loss = AuxLoss::kSequence, c.sequence_length = 12, c.aux_loss_coef = 10.0f;
       },
       12},
      {"one_token", [](C&) {}, 1},
      {"one_token_top1", [](C& c) { c.top_k = 1; }, 1},
  };
}

// GShard random routing on its own terms (docs/moe.md, "Gate"): token t's 2nd choice is removed
// unless 2 * g_2 > U, U the kStreamRandomRouting draw at the global token index (docs/moe.md). A
// removed choice has location -1 and weight 0, adds to no load and is not a drop. The variant must
// remove some but not all 2nd choices, or it could not tell random routing from none or from top-1.
void ExpectSomeSecondChoicesRemoved(const LayerConfig& c, const LayerOutput& out, int64_t tokens,
                                    int64_t k, const ForwardOptions& opt) {
  const CounterRng rng(StepSeed(c.seed, opt.step), kStreamRandomRouting);
  const float* gates = out.gates.data<float>();
  const float* weights = out.combine_weights.data<float>();
  const int32_t* loc = out.locations.data<int32_t>();
  int64_t removed = 0, unplaced = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const float u = rng.Uniform(static_cast<uint64_t>(opt.global_token_offset + t));
    for (int64_t j = 0; j < k; ++j) unplaced += loc[t * k + j] < 0;
    if (2.0f * gates[t * k + 1] > u) continue;
    ++removed;
    EXPECT_EQ(loc[t * k + 1], -1) << "token " << t << ": removed 2nd choice has a slot";
    EXPECT_EQ(weights[t * k + 1], 0.0f) << "token " << t;
    if (k == 2 && loc[t * k] >= 0) {
      // The lone survivor: weight 1 under DeepSpeed's renormalization, g_1 under Tutel's.
      EXPECT_FLOAT_EQ(weights[t * k], c.renormalize_after_drop ? 1.0f : gates[t * k])
          << "token " << t;
    }
  }
  EXPECT_GT(removed, 0) << "no 2nd choice was removed";
  EXPECT_LT(removed, tokens) << "every 2nd choice was removed";
  int64_t routed = 0;
  for (int64_t load : out.expert_loads) routed += load;
  EXPECT_EQ(routed, tokens * k - removed) << "removed choices must not count in the loads";
  EXPECT_EQ(out.dropped, unplaced - removed) << "removed choices must not count as drops";
}

class LayerVsReference : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    const Variant& v = GetParam();
    config_ = BaseConfig();
    v.edit(config_);
    ASSERT_NO_THROW(ValidateConfig(config_));
    params_ = InitParams(config_, 11);
    if (v.edit_params) v.edit_params(config_, params_);
    tokens_ = v.tokens;
    auto xv =
        switchyard::testing::RandomVector(static_cast<size_t>(tokens_ * config_.model_dim), 3);
    if (v.skew) {
      SkewToExpertZero(config_, params_);
      for (float& f : xv) f = 0.5f + 0.5f * f;  // positive: every token prefers expert 0
    }
    x_ = Tensor::FromVector(xv, {tokens_, config_.model_dim});
    opt_.global_token_offset = v.global_token_offset;
    ref_opt_.global_token_offset = v.global_token_offset;
    opt_.training = v.training;
    ref_opt_.training = v.training;
  }

  LayerConfig config_;
  LayerParams params_;
  int64_t tokens_ = 0;
  Tensor x_;
  ForwardOptions opt_;
  RefOptions ref_opt_;
};

TEST_P(LayerVsReference, ForwardMatchesReference) {
  MoeLayer layer(config_);
  LayerOutput out = layer.Forward(params_, x_, opt_);
  RefParams rp = testing::ToRefParams(ParamsToMap(config_, params_));
  auto ref = testing::ReferenceForward(config_, rp, testing::ToDoubles(x_), tokens_, ref_opt_);
  const int64_t k = layer.top_k();
  ASSERT_EQ(out.topk_idx.shape(), (Shape{tokens_, k}));
  EXPECT_EQ(out.capacity, ref.capacity);
  for (int64_t i = 0; i < tokens_ * k; ++i) {
    EXPECT_EQ(out.topk_idx.data<int32_t>()[i], ref.topk[static_cast<size_t>(i)]) << "pair " << i;
    EXPECT_EQ(out.locations.data<int32_t>()[i], ref.locations[static_cast<size_t>(i)])
        << "pair " << i;
    EXPECT_NEAR(out.gates.data<float>()[i], ref.gates[static_cast<size_t>(i)], 1e-5);
    EXPECT_NEAR(out.combine_weights.data<float>()[i], ref.weights[static_cast<size_t>(i)], 1e-5);
  }
  for (int64_t i = 0; i < x_.numel(); ++i) {
    double want = ref.y[static_cast<size_t>(i)];
    EXPECT_NEAR(out.y.data<float>()[i], want, 1e-5 + 1e-4 * std::abs(want)) << "y[" << i << "]";
  }
  const std::string& name = GetParam().name;
  if (name.find("drops") != std::string::npos || name == "every_token_dropped") {
    EXPECT_GT(out.dropped, 0) << "the variant is meant to drop";
  }
  if (config_.random_routing && opt_.training && k >= 2) {
    ExpectSomeSecondChoicesRemoved(config_, out, tokens_, k, opt_);
  }
  if (config_.expert_bias) {
    // A bias that changes no choice would pass with the bias ignored.
    LayerConfig unbiased = config_;
    unbiased.expert_bias = false;
    auto plain = testing::ReferenceForward(unbiased, rp, testing::ToDoubles(x_), tokens_, ref_opt_);
    EXPECT_NE(plain.topk, ref.topk) << "the expert bias changes no choice";
  }
  if (GroupLimited(config_)) {
    // A group limit that changes no choice would pass with the limit ignored.
    LayerConfig unlimited = config_;
    unlimited.num_groups = 1, unlimited.group_topk = 0;
    auto plain =
        testing::ReferenceForward(unlimited, rp, testing::ToDoubles(x_), tokens_, ref_opt_);
    EXPECT_NE(plain.topk, ref.topk) << "the group limit changes no choice";
  }
  if (config_.aux_loss == AuxLoss::kSequence && tokens_ > config_.sequence_length) {
    // Per-sequence statistics differ from those of the whole batch.
    LayerConfig whole = config_;
    whole.sequence_length = tokens_;
    auto batch = testing::ReferenceForward(whole, rp, testing::ToDoubles(x_), tokens_, ref_opt_);
    EXPECT_GT(std::abs(batch.l_aux - ref.l_aux), 1e-4) << "sequences make no difference";
  }
  EXPECT_NEAR(out.l_aux, ref.l_aux, 1e-5 + 1e-5 * std::abs(ref.l_aux));
  EXPECT_NEAR(out.z_loss, ref.z_loss, 1e-5 + 1e-5 * std::abs(ref.z_loss));
}

// Central differences of the float64 reference objective against the layer's gradients.
TEST_P(LayerVsReference, GradientsMatchFiniteDifferences) {
  MoeLayer layer(config_);
  LayerOutput out = layer.Forward(params_, x_, opt_);
  auto dyv = switchyard::testing::RandomVector(static_cast<size_t>(x_.numel()), 5);
  Tensor dy = Tensor::FromVector(dyv, x_.shape());
  LayerGradients grads = layer.Backward(params_, out, dy);

  NamedTensors named = ParamsToMap(config_, params_);
  NamedTensors named_grads = ParamsToMap(config_, grads.params);
  RefParams rp = testing::ToRefParams(named);
  std::vector<double> xd = testing::ToDoubles(x_);
  std::vector<double> dyd(dyv.begin(), dyv.end());
  const double h = 1e-6;
  auto objective = [&] {
    return testing::ReferenceObjective(config_, rp, xd, tokens_, dyd, ref_opt_);
  };
  auto check = [&](const std::string& name, std::vector<double>& values, const Tensor& grad) {
    ASSERT_TRUE(grad.defined()) << name << ": no gradient";
    ASSERT_EQ(grad.numel(), static_cast<int64_t>(values.size())) << name;
    int failures = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      double keep = values[i];
      values[i] = keep + h;
      double up = objective();
      values[i] = keep - h;
      double down = objective();
      values[i] = keep;
      double fd = (up - down) / (2 * h);
      double got = grad.At(static_cast<int64_t>(i));
      if (std::abs(got - fd) > 2e-4 + 2e-3 * std::abs(fd) && failures++ < 5) {
        ADD_FAILURE() << name << "[" << i << "]: layer " << got << ", finite differences " << fd;
      }
    }
  };
  check("x", xd, grads.x);
  for (auto& [name, values] : rp) {
    if (name == "gate.expert_bias") continue;  // not trained by gradient
    check("grad." + name, values, named_grads[name]);
  }
  EXPECT_EQ(named_grads.count("gate.expert_bias"), 0u);
}

// bfloat16 activations (docs/moe.md, "Details and conventions": stored in bfloat16, computed in
// float32): for every option, the layer on bfloat16 x and dy equals the float32 layer on the same
// rounded values, with only y and the x gradient rounded; routing, losses and every parameter
// gradient (float32) are the same bits.
TEST_P(LayerVsReference, BFloat16ActivationsEqualTheFloat32PathOnRoundedInputs) {
  MoeLayer layer(config_);
  const Tensor x16 = x_.To(DType::kBFloat16);
  const Tensor x32 = x16.To(DType::kFloat32);
  auto dyv = switchyard::testing::RandomVector(static_cast<size_t>(x_.numel()), 5);
  const Tensor dy16 = Tensor::FromVector(dyv, x_.shape()).To(DType::kBFloat16);
  const Tensor dy32 = dy16.To(DType::kFloat32);
  LayerOutput o16 = layer.Forward(params_, x16, opt_);
  LayerOutput o32 = layer.Forward(params_, x32, opt_);
  ASSERT_EQ(o16.y.dtype(), DType::kBFloat16);
  EXPECT_EQ(Floats(o16.y), Floats(o32.y.To(DType::kBFloat16)));
  EXPECT_EQ(Floats(o16.gates), Floats(o32.gates));
  EXPECT_EQ(Floats(o16.combine_weights), Floats(o32.combine_weights));
  for (int64_t i = 0; i < o16.topk_idx.numel(); ++i) {
    ASSERT_EQ(o16.topk_idx.data<int32_t>()[i], o32.topk_idx.data<int32_t>()[i]) << "pair " << i;
    ASSERT_EQ(o16.locations.data<int32_t>()[i], o32.locations.data<int32_t>()[i]) << "pair " << i;
  }
  EXPECT_EQ(o16.l_aux, o32.l_aux);
  EXPECT_EQ(o16.z_loss, o32.z_loss);
  LayerGradients g16 = layer.Backward(params_, o16, dy16);
  LayerGradients g32 = layer.Backward(params_, o32, dy32);
  ASSERT_EQ(g16.x.dtype(), DType::kBFloat16);
  EXPECT_EQ(Floats(g16.x), Floats(g32.x.To(DType::kBFloat16)));
  NamedTensors n16 = ParamsToMap(config_, g16.params);
  NamedTensors n32 = ParamsToMap(config_, g32.params);
  ASSERT_EQ(n16.size(), n32.size());
  for (const auto& [name, grad] : n32) {
    ASSERT_TRUE(n16.count(name)) << name;
    EXPECT_EQ(n16.at(name).dtype(), DType::kFloat32) << name;
    EXPECT_EQ(Floats(n16.at(name)), Floats(grad)) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Options, LayerVsReference, ::testing::ValuesIn(Variants()),
                         [](const auto& variant) { return variant.param.name; });

}  // namespace
}  // namespace switchyard::moe
