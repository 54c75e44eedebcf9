#include "switchyard/moe/config.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/core/json.h"
#include "switchyard/core/limits.h"

namespace switchyard::moe {
namespace {

using Json = nlohmann::json;

// Sizes are bounded so that every row index of the expert buffers fits in int32 and products of
// sizes cannot overflow int64.
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxExperts = int64_t{1} << 20;

constexpr std::pair<std::string_view, ScoreFunction> kScoreFunctions[] = {
    {"softmax", ScoreFunction::kSoftmax},
    {"sigmoid", ScoreFunction::kSigmoid},
    {"softmax_after_topk", ScoreFunction::kSoftmaxAfterTopK}};
constexpr std::pair<std::string_view, NoiseKind> kNoiseKinds[] = {
    {"none", NoiseKind::kNone},
    {"tutel_normal", NoiseKind::kTutelNormal},
    {"jitter", NoiseKind::kJitter},
    {"gumbel_second", NoiseKind::kGumbelSecond}};
constexpr std::pair<std::string_view, CapacityFormula> kCapacityFormulas[] = {
    {"tutel", CapacityFormula::kTutel}, {"deepspeed", CapacityFormula::kDeepSpeed}};
constexpr std::pair<std::string_view, DropPolicy> kDropPolicies[] = {
    {"position", DropPolicy::kPosition},
    {"probs", DropPolicy::kProbs},
    {"random", DropPolicy::kRandom}};
constexpr std::pair<std::string_view, SlotOrder> kSlotOrders[] = {
    {"choice_major", SlotOrder::kChoiceMajor}, {"token_order", SlotOrder::kTokenOrder}};
constexpr std::pair<std::string_view, AuxLoss> kAuxLosses[] = {
    {"gshard", AuxLoss::kGShard},
    {"gshard_all_choices", AuxLoss::kGShardAllChoices},
    {"importance_load", AuxLoss::kImportanceLoad},
    {"sequence", AuxLoss::kSequence},
    {"global", AuxLoss::kGlobal},
    {"hf_concat", AuxLoss::kHfConcat},
    {"none", AuxLoss::kNone}};
constexpr std::pair<std::string_view, kernels::Activation> kActivations[] = {
    {"relu", kernels::Activation::kRelu},
    {"gelu", kernels::Activation::kGelu},
    {"silu", kernels::Activation::kSilu}};

template <typename Enum, size_t N>
std::string_view NameOf(const std::pair<std::string_view, Enum> (&table)[N], Enum v) {
  for (const auto& [name, value] : table) {
    if (value == v) return name;
  }
  return "?";
}

template <typename Enum, size_t N>
std::string NameList(const std::pair<std::string_view, Enum> (&table)[N]) {
  std::string s;
  for (size_t i = 0; i < N; ++i) {
    if (i) s += i + 1 == N ? " or " : ", ";
    s += table[i].first;
  }
  return s;
}

std::string_view JsonTypeName(const Json& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  if (v.is_array()) return "an array";
  return "an object";
}

[[noreturn]] void BadValue(std::string_view key, std::string_view expected, const Json& v) {
  std::string got = v.is_primitive() ? v.dump() : std::string(JsonTypeName(v));
  if (got.size() > 40) got = got.substr(0, 40) + "...";
  throw InvalidArgument(
      fmt::format("layer.json: key '{}': expected {}, got {}", key, expected, got));
}

int64_t GetInt(std::string_view key, const Json& v, int64_t lo, int64_t hi) {
  std::string expected = fmt::format("an integer in [{}, {}]", lo, hi);
  if (!v.is_number_integer()) BadValue(key, expected, v);
  if (v.is_number_unsigned()) {
    auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo) BadValue(key, expected, v);
    return static_cast<int64_t>(u);
  }
  auto i = v.get<int64_t>();
  if (i < lo || i > hi) BadValue(key, expected, v);
  return i;
}

// A float32 number in [lo, hi] (finite: JSON has no NaN, and 1e400 parses as infinity).
float GetFloat(std::string_view key, const Json& v, double lo = -std::numeric_limits<float>::max(),
               double hi = std::numeric_limits<float>::max()) {
  auto expected = [&] {
    if (lo == -std::numeric_limits<float>::max() && hi == std::numeric_limits<float>::max()) {
      return std::string("a finite float32 number");
    }
    if (hi == std::numeric_limits<float>::max()) return fmt::format("a finite number >= {}", lo);
    return fmt::format("a number in [{}, {}]", lo, hi);
  };
  if (!v.is_number()) BadValue(key, expected(), v);
  double d = v.get<double>();
  if (!std::isfinite(d) || std::abs(d) > std::numeric_limits<float>::max() || d < lo || d > hi) {
    BadValue(key, expected(), v);
  }
  return static_cast<float>(d);
}

bool GetBool(std::string_view key, const Json& v) {
  if (!v.is_boolean()) BadValue(key, "true or false", v);
  return v.get<bool>();
}

template <typename Enum, size_t N>
Enum GetEnum(std::string_view key, const Json& v,
             const std::pair<std::string_view, Enum> (&table)[N]) {
  std::string expected = "one of " + NameList(table);
  if (!v.is_string()) BadValue(key, expected, v);
  const auto& s = v.get_ref<const std::string&>();
  for (const auto& [name, value] : table) {
    if (s == name) return value;
  }
  BadValue(key, expected, v);
}

using Setter = std::function<void(LayerConfig&, std::string_view, const Json&)>;

const std::map<std::string, Setter, std::less<>>& Setters() {
  static const auto* setters = new std::map<std::string, Setter, std::less<>>{
      {"model_dim", [](LayerConfig& c, auto k, const Json& v) { c.model_dim = GetInt(k, v, 1, kMaxDim); }},
      {"hidden_dim", [](LayerConfig& c, auto k, const Json& v) { c.hidden_dim = GetInt(k, v, 1, kMaxDim); }},
      {"num_experts", [](LayerConfig& c, auto k, const Json& v) { c.num_experts = GetInt(k, v, 1, kMaxExperts); }},
      {"top_k", [](LayerConfig& c, auto k, const Json& v) { c.top_k = GetInt(k, v, 1, kMaxExperts); }},
      {"score_function", [](LayerConfig& c, auto k, const Json& v) { c.score_function = GetEnum(k, v, kScoreFunctions); }},
      {"normalize_gate", [](LayerConfig& c, auto k, const Json& v) { c.normalize_gate = GetBool(k, v); }},
      {"num_groups", [](LayerConfig& c, auto k, const Json& v) { c.num_groups = GetInt(k, v, 1, kMaxExperts); }},
      {"group_topk", [](LayerConfig& c, auto k, const Json& v) { c.group_topk = GetInt(k, v, 0, kMaxExperts); }},
      {"topk_scaling_factor", [](LayerConfig& c, auto k, const Json& v) { c.topk_scaling_factor = GetFloat(k, v); }},  // > 0: ValidateConfig
      {"noise", [](LayerConfig& c, auto k, const Json& v) { c.noise = GetEnum(k, v, kNoiseKinds); }},
      {"noise_std", [](LayerConfig& c, auto k, const Json& v) { c.noise_std = GetFloat(k, v, 0); }},
      {"jitter_eps", [](LayerConfig& c, auto k, const Json& v) { c.jitter_eps = GetFloat(k, v); }},  // [0, 1): ValidateConfig
      {"random_routing", [](LayerConfig& c, auto k, const Json& v) { c.random_routing = GetBool(k, v); }},
      {"expert_bias", [](LayerConfig& c, auto k, const Json& v) { c.expert_bias = GetBool(k, v); }},
      {"expert_bias_update_rate", [](LayerConfig& c, auto k, const Json& v) { c.expert_bias_update_rate = GetFloat(k, v, 0); }},
      {"capacity_factor", [](LayerConfig& c, auto k, const Json& v) { c.capacity_factor = GetFloat(k, v); }},
      {"min_capacity", [](LayerConfig& c, auto k, const Json& v) { c.min_capacity = GetInt(k, v, 0, std::numeric_limits<int32_t>::max()); }},
      {"alignment", [](LayerConfig& c, auto k, const Json& v) { c.alignment = GetInt(k, v, 1, kMaxDim); }},
      {"capacity", [](LayerConfig& c, auto k, const Json& v) {
         if (v.is_null()) {
           c.capacity.reset();
         } else {
           c.capacity = GetInt(k, v, 0, std::numeric_limits<int32_t>::max());
         }
       }},
      {"capacity_formula", [](LayerConfig& c, auto k, const Json& v) { c.capacity_formula = GetEnum(k, v, kCapacityFormulas); }},
      {"drop_policy", [](LayerConfig& c, auto k, const Json& v) { c.drop_policy = GetEnum(k, v, kDropPolicies); }},
      {"slot_order", [](LayerConfig& c, auto k, const Json& v) { c.slot_order = GetEnum(k, v, kSlotOrders); }},
      {"batch_prioritized_routing", [](LayerConfig& c, auto k, const Json& v) { c.batch_prioritized_routing = GetBool(k, v); }},
      {"renormalize_after_drop", [](LayerConfig& c, auto k, const Json& v) { c.renormalize_after_drop = GetBool(k, v); }},
      {"dropless", [](LayerConfig& c, auto k, const Json& v) { c.dropless = GetBool(k, v); }},
      {"prescore", [](LayerConfig& c, auto k, const Json& v) { c.prescore = GetBool(k, v); }},
      {"activation", [](LayerConfig& c, auto k, const Json& v) { c.activation = GetEnum(k, v, kActivations); }},
      {"gated", [](LayerConfig& c, auto k, const Json& v) { c.gated = GetBool(k, v); }},
      {"fc_bias", [](LayerConfig& c, auto k, const Json& v) { c.fc_bias = GetBool(k, v); }},
      {"aux_loss", [](LayerConfig& c, auto k, const Json& v) { c.aux_loss = GetEnum(k, v, kAuxLosses); }},
      {"aux_loss_coef", [](LayerConfig& c, auto k, const Json& v) { c.aux_loss_coef = GetFloat(k, v, 0); }},
      {"z_loss_coef", [](LayerConfig& c, auto k, const Json& v) { c.z_loss_coef = GetFloat(k, v, 0); }},
      {"sequence_length", [](LayerConfig& c, auto k, const Json& v) { c.sequence_length = GetInt(k, v, 0, kMaxDim); }},
      {"residual_moe", [](LayerConfig& c, auto k, const Json& v) { c.residual_moe = GetBool(k, v); }},
      {"shared_expert_hidden", [](LayerConfig& c, auto k, const Json& v) { c.shared_expert_hidden = GetInt(k, v, 0, kMaxDim); }},
      {"seed", [](LayerConfig& c, auto k, const Json& v) {
         if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0)) {
           BadValue(k, "a non-negative integer", v);
         }
         c.seed = v.get<uint64_t>();
       }},
      {"check_finite", [](LayerConfig& c, auto k, const Json& v) { c.check_finite = GetBool(k, v); }},
      {"preset", [](LayerConfig&, auto, const Json&) {}},  // handled first
  };
  return *setters;
}

// Levenshtein distance, for "did you mean" on unknown keys.
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string UnknownKeyMessage(const std::string& key) {
  std::string shown = key.size() > 40 ? key.substr(0, 40) + "..." : key;
  std::string best;
  size_t best_d = 4;  // suggest only close names
  if (key.size() <= 64) {
    for (const auto& [name, setter] : Setters()) {
      size_t d = EditDistance(key, name);
      if (d < best_d) {
        best_d = d;
        best = name;
      }
    }
  }
  if (!best.empty()) {
    return fmt::format("layer.json: unknown key '{}' (did you mean '{}'?)", shown, best);
  }
  return fmt::format("layer.json: unknown key '{}' (docs/moe.md lists the keys)", shown);
}

// The options of the Megatron-Core / DeepSeek-V3 router (docs/moe.md, "Gate" and "Losses").
void ValidateRouting(const LayerConfig& c) {
  const int64_t k = EffectiveTopK(c);
  SY_REQUIRE(
      c.num_groups >= 1 && c.num_groups <= c.num_experts && c.num_experts % c.num_groups == 0,
      InvalidArgument,
      "num_groups: expected a divisor of num_experts = {} (experts form equal contiguous "
      "groups), got {}",
      c.num_experts, c.num_groups);
  SY_REQUIRE(c.group_topk >= 0 && c.group_topk <= c.num_groups, InvalidArgument,
             "group_topk: expected an integer in [0, num_groups = {}] (0: no group limit), got {}",
             c.num_groups, c.group_topk);
  SY_REQUIRE(c.num_groups == 1 || c.group_topk > 0, InvalidArgument,
             "num_groups: {} groups without group_topk: set group_topk in [1, {}] (the groups a "
             "token may use), or num_groups to 1",
             c.num_groups, c.num_groups);
  if (c.group_topk > 0) {
    const int64_t per_group = c.num_experts / c.num_groups;
    SY_REQUIRE(k >= c.group_topk, InvalidArgument,
               "group_topk: expected <= top_k = {} (a group scores the sum of its top "
               "top_k / group_topk experts), got {}",
               k, c.group_topk);
    SY_REQUIRE(k <= c.group_topk * per_group, InvalidArgument,
               "top_k: expected <= group_topk x experts per group = {} x {} = {} (the eligible "
               "experts), got {}",
               c.group_topk, per_group, c.group_topk * per_group, k);
    SY_REQUIRE(c.noise != NoiseKind::kGumbelSecond, InvalidArgument,
               "noise: gumbel_second picks choices 2..k among all experts and cannot be combined "
               "with group-limited routing (group_topk = {})",
               c.group_topk);
  }
  SY_REQUIRE(std::isfinite(c.topk_scaling_factor) && c.topk_scaling_factor > 0, InvalidArgument,
             "topk_scaling_factor: expected a finite number > 0, got {}", c.topk_scaling_factor);
  SY_REQUIRE(c.topk_scaling_factor == 1.0f || !c.renormalize_after_drop, InvalidArgument,
             "topk_scaling_factor: {} would be undone by renormalize_after_drop (the survivors' "
             "weights are renormalized to sum 1); use one of them",
             c.topk_scaling_factor);
  SY_REQUIRE(c.sequence_length >= 0 && c.sequence_length <= kMaxDim, InvalidArgument,
             "sequence_length: expected an integer in [0, {}], got {}", kMaxDim, c.sequence_length);
  SY_REQUIRE(c.aux_loss != AuxLoss::kSequence || c.sequence_length > 0, InvalidArgument,
             "aux_loss: sequence needs sequence_length >= 1 (the rows of one sequence; rows are "
             "batch-major)");
}

}  // namespace

std::string_view ScoreFunctionName(ScoreFunction v) { return NameOf(kScoreFunctions, v); }
std::string_view NoiseKindName(NoiseKind v) { return NameOf(kNoiseKinds, v); }
std::string_view CapacityFormulaName(CapacityFormula v) { return NameOf(kCapacityFormulas, v); }
std::string_view DropPolicyName(DropPolicy v) { return NameOf(kDropPolicies, v); }
std::string_view SlotOrderName(SlotOrder v) { return NameOf(kSlotOrders, v); }
std::string_view AuxLossName(AuxLoss v) { return NameOf(kAuxLosses, v); }

void ValidateConfig(const LayerConfig& c) {
  auto require_range = [](std::string_view name, int64_t v, int64_t lo, int64_t hi) {
    SY_REQUIRE(v >= lo && v <= hi, InvalidArgument, "{}: expected an integer in [{}, {}], got {}",
               name, lo, hi, v);
  };
  require_range("model_dim", c.model_dim, 1, kMaxDim);
  require_range("hidden_dim", c.hidden_dim, 1, kMaxDim);
  require_range("num_experts", c.num_experts, 1, kMaxExperts);
  require_range("top_k", c.top_k, 1, kMaxExperts);
  require_range("min_capacity", c.min_capacity, 0, std::numeric_limits<int32_t>::max());
  require_range("alignment", c.alignment, 1, kMaxDim);
  require_range("shared_expert_hidden", c.shared_expert_hidden, 0, kMaxDim);
  if (c.capacity) {
    require_range("capacity", *c.capacity, 0, std::numeric_limits<int32_t>::max());
    SY_REQUIRE(!c.dropless, InvalidArgument,
               "capacity: an explicit capacity has no meaning with dropless = true");
  }
  auto require_finite = [](std::string_view name, float v) {
    SY_REQUIRE(std::isfinite(v), InvalidArgument, "{}: expected a finite number, got {}", name, v);
  };
  require_finite("capacity_factor", c.capacity_factor);
  require_finite("aux_loss_coef", c.aux_loss_coef);
  require_finite("z_loss_coef", c.z_loss_coef);
  require_finite("noise_std", c.noise_std);
  require_finite("expert_bias_update_rate", c.expert_bias_update_rate);
  auto require_non_negative = [](std::string_view name, float v) {
    SY_REQUIRE(v >= 0, InvalidArgument, "{}: expected a finite number >= 0, got {}", name, v);
  };
  require_non_negative("noise_std", c.noise_std);
  require_non_negative("aux_loss_coef", c.aux_loss_coef);
  require_non_negative("z_loss_coef", c.z_loss_coef);
  require_non_negative("expert_bias_update_rate", c.expert_bias_update_rate);
  // The weights must be addressable: E x H x M (and the shared expert's H x M) may not overflow.
  const int64_t expert_params =
      CheckedMul(CheckedMul(c.num_experts, c.hidden_dim, "num_experts x hidden_dim"), c.model_dim,
                 "num_experts x hidden_dim x model_dim");
  SY_REQUIRE(expert_params <= (int64_t{1} << 40), InvalidArgument,
             "num_experts x hidden_dim x model_dim = {} x {} x {} = {} parameters per expert "
             "weight: expected at most 2^40",
             c.num_experts, c.hidden_dim, c.model_dim, expert_params);
  SY_REQUIRE(c.jitter_eps >= 0 && c.jitter_eps < 1, InvalidArgument,
             "jitter_eps: expected a number in [0, 1), got {}", c.jitter_eps);
  if (c.aux_loss == AuxLoss::kImportanceLoad) {
    SY_REQUIRE(c.num_experts >= 2, InvalidArgument,
               "aux_loss: importance_load needs num_experts >= 2 (a variance over experts), got {}",
               c.num_experts);
    SY_REQUIRE(c.noise_std > 0, InvalidArgument,
               "aux_loss: importance_load needs noise_std > 0 (the sigma of its load estimate)");
  }
  ValidateRouting(c);
  SY_REQUIRE(c.preset == "tutel" || c.preset == "deepspeed", InvalidArgument,
             "preset: expected tutel or deepspeed, got '{}'", c.preset);
  SY_REQUIRE(c.activation == kernels::Activation::kRelu ||
                 c.activation == kernels::Activation::kGelu ||
                 c.activation == kernels::Activation::kSilu,
             InvalidArgument, "activation: expected relu, gelu or silu, got {}",
             kernels::ActivationName(c.activation));
}

LayerConfig PresetConfig(std::string_view preset, int64_t top_k) {
  LayerConfig c;
  if (preset == "tutel") return c;
  SY_REQUIRE(preset == "deepspeed", InvalidArgument,
             "preset: expected tutel or deepspeed, got '{}'", preset);
  c.preset = "deepspeed";
  c.top_k = top_k;
  c.capacity_formula = CapacityFormula::kDeepSpeed;
  c.min_capacity = 4;
  c.renormalize_after_drop = true;
  if (top_k == 1) c.drop_policy = DropPolicy::kRandom;
  if (top_k > 2) {
    c.drop_policy = DropPolicy::kProbs;
    c.slot_order = SlotOrder::kTokenOrder;
    c.aux_loss = AuxLoss::kGShardAllChoices;
  }
  return c;
}

namespace {

// layer.json's keys into a LayerConfig; `training`, if not null, receives the "training" key (the
// mode of the calls, which is not a layer option), which is otherwise refused.
LayerConfig ParseLayerJson(std::string_view json_text, std::optional<bool>* training) {
  Json j = ParseJsonStrict(json_text, "layer.json");
  SY_REQUIRE(j.is_object(), InvalidArgument, "layer.json: expected a JSON object, got {}",
             JsonTypeName(j));
  std::string preset = "tutel";
  if (auto it = j.find("preset"); it != j.end()) {
    if (!it->is_string()) BadValue("preset", "tutel or deepspeed", *it);
    preset = it->get<std::string>();
    if (preset != "tutel" && preset != "deepspeed") BadValue("preset", "tutel or deepspeed", *it);
  }
  int64_t top_k = LayerConfig{}.top_k;
  if (auto it = j.find("top_k"); it != j.end()) top_k = GetInt("top_k", *it, 1, kMaxExperts);
  LayerConfig c = PresetConfig(preset, top_k);
  const auto& setters = Setters();
  for (const auto& [key, value] : j.items()) {
    if (key == "training") {
      SY_REQUIRE(training != nullptr, InvalidArgument,
                 "layer.json: key 'training' is not a layer option: whether a forward pass trains "
                 "(gate noise, random routing) is chosen for each call, not by the layer config; "
                 "remove the key");
      *training = GetBool(key, value);
      continue;
    }
    auto it = setters.find(key);
    if (it == setters.end()) throw InvalidArgument(UnknownKeyMessage(key));
    it->second(c, key, value);
  }
  try {
    ValidateConfig(c);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("layer.json: {}", e.what()));
  }
  return c;
}

}  // namespace

LayerConfig LayerConfigFromJson(std::string_view json_text) {
  return ParseLayerJson(json_text, nullptr);
}

LayerFile LayerFileFromJson(std::string_view json_text) {
  LayerFile f;
  f.config = ParseLayerJson(json_text, &f.training);
  return f;
}

std::string ToJson(const LayerConfig& c, std::optional<bool> training) {
  Json j = {
      {"model_dim", c.model_dim},
      {"hidden_dim", c.hidden_dim},
      {"num_experts", c.num_experts},
      {"top_k", c.top_k},
      {"score_function", ScoreFunctionName(c.score_function)},
      {"normalize_gate", c.normalize_gate},
      {"num_groups", c.num_groups},
      {"group_topk", c.group_topk},
      {"topk_scaling_factor", c.topk_scaling_factor},
      {"noise", NoiseKindName(c.noise)},
      {"noise_std", c.noise_std},
      {"jitter_eps", c.jitter_eps},
      {"random_routing", c.random_routing},
      {"expert_bias", c.expert_bias},
      {"expert_bias_update_rate", c.expert_bias_update_rate},
      {"capacity_factor", c.capacity_factor},
      {"min_capacity", c.min_capacity},
      {"alignment", c.alignment},
      {"capacity", c.capacity ? Json(*c.capacity) : Json(nullptr)},
      {"capacity_formula", CapacityFormulaName(c.capacity_formula)},
      {"drop_policy", DropPolicyName(c.drop_policy)},
      {"slot_order", SlotOrderName(c.slot_order)},
      {"batch_prioritized_routing", c.batch_prioritized_routing},
      {"renormalize_after_drop", c.renormalize_after_drop},
      {"dropless", c.dropless},
      {"prescore", c.prescore},
      {"activation", kernels::ActivationName(c.activation)},
      {"gated", c.gated},
      {"fc_bias", c.fc_bias},
      {"aux_loss", AuxLossName(c.aux_loss)},
      {"aux_loss_coef", c.aux_loss_coef},
      {"z_loss_coef", c.z_loss_coef},
      {"sequence_length", c.sequence_length},
      {"residual_moe", c.residual_moe},
      {"shared_expert_hidden", c.shared_expert_hidden},
      {"seed", c.seed},
      {"check_finite", c.check_finite},
      {"preset", c.preset},
  };
  if (training) j["training"] = *training;
  return j.dump(2);
}

}  // namespace switchyard::moe
