#include "switchyard/moe/config.h"

#include <gtest/gtest.h>

#include <string>

#include "switchyard/core/error.h"

namespace switchyard::moe {
namespace {

const char* kMinimal = R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4})";

// The error message of parsing `json`, or "" if it parsed.
std::string ParseError(const std::string& json) {
  try {
    LayerConfigFromJson(json);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(LayerConfigJson, MinimalGivesTutelDefaults) {
  LayerConfig c = LayerConfigFromJson(kMinimal);
  LayerConfig d;
  EXPECT_EQ(c.model_dim, 8);
  EXPECT_EQ(c.hidden_dim, 16);
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.top_k, d.top_k);
  EXPECT_EQ(c.capacity_factor, d.capacity_factor);
  EXPECT_EQ(c.activation, kernels::Activation::kGelu);
  EXPECT_EQ(c.preset, "tutel");
  EXPECT_FALSE(c.capacity.has_value());
}

TEST(LayerConfigJson, EveryKeyIsRead) {
  LayerConfig c = LayerConfigFromJson(R"({
    "model_dim": 8, "hidden_dim": 16, "num_experts": 4, "top_k": 3,
    "score_function": "softmax_after_topk", "normalize_gate": false, "noise": "jitter",
    "noise_std": 0.5, "jitter_eps": 0.02, "random_routing": true, "expert_bias": true,
    "expert_bias_update_rate": 0.01, "capacity_factor": -1.5,
    "min_capacity": 3, "alignment": 2, "capacity": 7, "capacity_formula": "deepspeed",
    "drop_policy": "probs", "slot_order": "token_order", "batch_prioritized_routing": true,
    "renormalize_after_drop": true, "dropless": false, "prescore": true, "activation": "silu",
    "gated": true, "fc_bias": false, "aux_loss": "gshard_all_choices", "aux_loss_coef": 0.5,
    "z_loss_coef": 0.25, "residual_moe": true, "shared_expert_hidden": 32, "seed": 99,
    "check_finite": true, "preset": "tutel"})");
  EXPECT_EQ(c.top_k, 3);
  EXPECT_EQ(c.score_function, ScoreFunction::kSoftmaxAfterTopK);
  EXPECT_FALSE(c.normalize_gate);
  EXPECT_EQ(c.noise, NoiseKind::kJitter);
  EXPECT_FLOAT_EQ(c.noise_std, 0.5f);
  EXPECT_FLOAT_EQ(c.jitter_eps, 0.02f);
  EXPECT_TRUE(c.random_routing);
  EXPECT_TRUE(c.expert_bias);
  EXPECT_FLOAT_EQ(c.expert_bias_update_rate, 0.01f);
  EXPECT_FLOAT_EQ(c.capacity_factor, -1.5f);
  EXPECT_EQ(c.min_capacity, 3);
  EXPECT_EQ(c.alignment, 2);
  EXPECT_EQ(c.capacity, 7);
  EXPECT_EQ(c.capacity_formula, CapacityFormula::kDeepSpeed);
  EXPECT_EQ(c.drop_policy, DropPolicy::kProbs);
  EXPECT_EQ(c.slot_order, SlotOrder::kTokenOrder);
  EXPECT_TRUE(c.batch_prioritized_routing);
  EXPECT_TRUE(c.renormalize_after_drop);
  EXPECT_TRUE(c.prescore);
  EXPECT_EQ(c.activation, kernels::Activation::kSilu);
  EXPECT_TRUE(c.gated);
  EXPECT_FALSE(c.fc_bias);
  EXPECT_EQ(c.aux_loss, AuxLoss::kGShardAllChoices);
  EXPECT_FLOAT_EQ(c.aux_loss_coef, 0.5f);
  EXPECT_FLOAT_EQ(c.z_loss_coef, 0.25f);
  EXPECT_TRUE(c.residual_moe);
  EXPECT_EQ(c.shared_expert_hidden, 32);
  EXPECT_EQ(c.seed, 99u);
  EXPECT_TRUE(c.check_finite);
}

// "training" is the mode of the calls, not a layer option: the layer file reader takes it (and
// round-trips it through ToJson), the layer config reader refuses it with a message naming it.
TEST(LayerConfigJson, TrainingIsAKeyOfTheFileNotOfTheLayer) {
  const std::string eval =
      R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "training": false})";
  LayerFile f = LayerFileFromJson(eval);
  ASSERT_TRUE(f.training.has_value());
  EXPECT_FALSE(*f.training);
  EXPECT_EQ(f.config.num_experts, 4);
  EXPECT_FALSE(LayerFileFromJson(kMinimal).training.has_value());
  LayerFile again = LayerFileFromJson(ToJson(f.config, f.training));
  EXPECT_EQ(again.training, f.training);
  EXPECT_EQ(ToJson(again.config), ToJson(f.config));
  EXPECT_EQ(ToJson(f.config).find("training"), std::string::npos);
  EXPECT_NE(ParseError(eval).find("key 'training' is not a layer option"), std::string::npos)
      << ParseError(eval);
  EXPECT_NE(ParseError(R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "training": 1})"),
            "");
  try {
    LayerFileFromJson(R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "training": 1})");
    ADD_FAILURE() << "a non-bool training was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'training'"), std::string::npos) << e.what();
  }
}

TEST(LayerConfigJson, DeepSpeedPresetDependsOnK) {
  auto ds = [](int k) {
    return LayerConfigFromJson(
        R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "preset": "deepspeed", "top_k": )" +
        std::to_string(k) + "}");
  };
  LayerConfig k1 = ds(1), k2 = ds(2), k3 = ds(3);
  for (const LayerConfig* c : {&k1, &k2, &k3}) {
    EXPECT_EQ(c->preset, "deepspeed");
    EXPECT_EQ(c->capacity_formula, CapacityFormula::kDeepSpeed);
    EXPECT_EQ(c->min_capacity, 4);
    EXPECT_TRUE(c->renormalize_after_drop);
  }
  EXPECT_EQ(k1.drop_policy, DropPolicy::kRandom);
  EXPECT_EQ(k2.drop_policy, DropPolicy::kPosition);
  EXPECT_EQ(k2.slot_order, SlotOrder::kChoiceMajor);
  EXPECT_EQ(k2.aux_loss, AuxLoss::kGShard);
  EXPECT_EQ(k3.drop_policy, DropPolicy::kProbs);
  EXPECT_EQ(k3.slot_order, SlotOrder::kTokenOrder);
  EXPECT_EQ(k3.aux_loss, AuxLoss::kGShardAllChoices);
  // Explicit keys override the preset, wherever they appear.
  LayerConfig o = LayerConfigFromJson(
      R"({"min_capacity": 1, "model_dim": 8, "hidden_dim": 16, "num_experts": 4,
          "preset": "deepspeed"})");
  EXPECT_EQ(o.min_capacity, 1);
}

TEST(LayerConfigJson, RoundTripsThroughToJson) {
  for (const char* json :
       {kMinimal,
        R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4, "preset": "deepspeed",
            "top_k": 3, "capacity_factor": 1.1, "capacity": 5, "seed": 18446744073709551615})",
        R"({"model_dim": 1, "hidden_dim": 1, "num_experts": 1, "capacity_factor": 0.3,
            "aux_loss": "none", "noise": "tutel_normal", "noise_std": 0.1})"}) {
    LayerConfig c = LayerConfigFromJson(json);
    std::string once = ToJson(c);
    LayerConfig again = LayerConfigFromJson(once);
    EXPECT_EQ(ToJson(again), once);
    EXPECT_EQ(again.capacity_factor, c.capacity_factor);
    EXPECT_EQ(again.capacity, c.capacity);
    EXPECT_EQ(again.seed, c.seed);
  }
}

TEST(LayerConfigJson, ErrorsNameTheKeyOnOneLine) {
  struct Case {
    std::string json;
    std::string expect;  // substring of the message
  };
  const std::string base = R"("model_dim": 8, "hidden_dim": 16, "num_experts": 4)";
  std::vector<Case> cases = {
      {"{" + base + R"(, "top_k": 0})", "key 'top_k': expected an integer in [1,"},
      {"{" + base + R"(, "top_k": -1})", "key 'top_k'"},
      {"{" + base + R"(, "top_k": 2.5})", "key 'top_k': expected an integer"},
      {"{" + base + R"(, "top_k": "2"})", "got \"2\""},
      {"{" + base + R"(, "activation": "tanh"})",
       "key 'activation': expected one of relu, gelu or silu, got \"tanh\""},
      {"{" + base + R"(, "capcity_factor": 1})",
       "unknown key 'capcity_factor' (did you mean "
       "'capacity_factor'?)"},
      {"{" + base + R"(, "zzz": 1})", "unknown key 'zzz'"},
      {"{" + base + R"(, "normalize_gate": 1})", "key 'normalize_gate': expected true or false"},
      {"{" + base + R"(, "drop_policy": "first"})", "one of position, probs or random"},
      {"{" + base + R"(, "preset": "megatron"})", "key 'preset': expected tutel or deepspeed"},
      {"{" + base + R"(, "capacity_factor": 1e300})", "key 'capacity_factor': expected a finite"},
      {"{" + base + R"(, "min_capacity": -1})", "key 'min_capacity'"},
      {"{" + base + R"(, "alignment": 0})", "key 'alignment'"},
      {"{" + base + R"(, "seed": -3})", "key 'seed': expected a non-negative integer"},
      {"{" + base + R"(, "capacity": 4, "dropless": true})", "capacity: an explicit capacity"},
      {"{" + base + R"(, "jitter_eps": 1.5})", "jitter_eps: expected a number in [0, 1)"},
      {R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 1, "aux_loss": "importance_load"})",
       "importance_load needs num_experts >= 2"},
      {R"({"model_dim": 8, "hidden_dim": 16})", "num_experts: expected an integer in [1,"},
      {"[1, 2]", "expected a JSON object"},
      {"{" + base, "invalid JSON"},
      {"", "invalid JSON"},
  };
  for (const Case& c : cases) {
    std::string msg = ParseError(c.json);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.json << "\n  -> " << msg;
    EXPECT_TRUE(msg.starts_with("layer.json: ")) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
  }
}

TEST(ValidateConfig, ChecksSizesAndOptions) {
  LayerConfig c;
  EXPECT_THROW(ValidateConfig(c), InvalidArgument);  // sizes 0
  c.model_dim = 4;
  c.hidden_dim = 4;
  c.num_experts = 2;
  EXPECT_NO_THROW(ValidateConfig(c));
  c.top_k = 0;
  EXPECT_THROW(ValidateConfig(c), InvalidArgument);
  c.top_k = 5;  // k > E is allowed and clamped
  EXPECT_NO_THROW(ValidateConfig(c));
  EXPECT_EQ(EffectiveTopK(c), 2);
  c.activation = kernels::Activation::kIdentity;
  EXPECT_THROW(ValidateConfig(c), InvalidArgument);
}

// The Megatron-Core / DeepSeek-V3 router keys (docs/moe.md, "Gate" and "Losses").
const std::string kBase = R"({"model_dim": 6, "hidden_dim": 5, "num_experts": 8)";

TEST(RouterConfig, KeysAreReadAndWritten) {
  LayerConfig c = LayerConfigFromJson(
      kBase + R"(, "top_k": 4, "score_function": "sigmoid", "num_groups": 4, "group_topk": 2,
      "topk_scaling_factor": 2.5, "aux_loss": "sequence", "sequence_length": 16,
      "expert_bias": true, "expert_bias_update_rate": 0.001})");
  EXPECT_EQ(c.num_groups, 4);
  EXPECT_EQ(c.group_topk, 2);
  EXPECT_FLOAT_EQ(c.topk_scaling_factor, 2.5f);
  EXPECT_EQ(c.aux_loss, AuxLoss::kSequence);
  EXPECT_EQ(c.sequence_length, 16);
  LayerConfig back = LayerConfigFromJson(ToJson(c));
  EXPECT_EQ(back.num_groups, 4);
  EXPECT_EQ(back.group_topk, 2);
  EXPECT_FLOAT_EQ(back.topk_scaling_factor, 2.5f);
  EXPECT_EQ(back.aux_loss, AuxLoss::kSequence);
  EXPECT_EQ(back.sequence_length, 16);
  LayerConfig d;
  EXPECT_EQ(d.num_groups, 1);
  EXPECT_EQ(d.group_topk, 0);
  EXPECT_EQ(d.topk_scaling_factor, 1.0f);
  EXPECT_EQ(d.sequence_length, 0);
  LayerConfig g = LayerConfigFromJson(kBase + R"(, "aux_loss": "global"})");
  EXPECT_EQ(g.aux_loss, AuxLoss::kGlobal);
  EXPECT_EQ(LayerConfigFromJson(ToJson(g)).aux_loss, AuxLoss::kGlobal);
}

TEST(RouterConfig, BadValuesNameTheKey) {
  struct Case {
    std::string json, expected;
  };
  const std::vector<Case> cases = {
      {kBase + R"(, "num_groups": 3, "group_topk": 1})",
       "num_groups: expected a divisor of num_experts = 8"},
      {kBase + R"(, "num_groups": 0})", "key 'num_groups'"},
      {kBase + R"(, "num_groups": 4})", "num_groups: 4 groups without group_topk"},
      {kBase + R"(, "num_groups": 4, "group_topk": 5})",
       "group_topk: expected an integer in [0, num_groups = 4]"},
      {kBase + R"(, "top_k": 2, "num_groups": 4, "group_topk": 3})",
       "group_topk: expected <= top_k = 2"},
      {kBase + R"(, "top_k": 5, "num_groups": 4, "group_topk": 2})",
       "top_k: expected <= group_topk x experts per group = 2 x 2 = 4"},
      {kBase + R"(, "num_groups": 4, "group_topk": 2, "noise": "gumbel_second"})",
       "noise: gumbel_second"},
      {kBase + R"(, "topk_scaling_factor": 0})",
       "topk_scaling_factor: expected a finite number > 0"},
      {kBase + R"(, "topk_scaling_factor": -1})", "topk_scaling_factor"},
      {kBase + R"(, "topk_scaling_factor": 2, "renormalize_after_drop": true})",
       "topk_scaling_factor: 2 would be undone by renormalize_after_drop"},
      {kBase + R"(, "aux_loss": "sequence"})", "aux_loss: sequence needs sequence_length >= 1"},
      {kBase + R"(, "sequence_length": -1})", "key 'sequence_length'"},
      {kBase + R"(, "aux_loss": "global_batch"})", "key 'aux_loss'"},  // global is a value
  };
  for (const Case& c : cases) {
    EXPECT_NE(ParseError(c.json).find(c.expected), std::string::npos)
        << c.json << "\n  got: " << ParseError(c.json);
  }
}

}  // namespace
}  // namespace switchyard::moe
