#include "switchyard/train/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/json.h"
#include "switchyard/core/limits.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/parallel/schedule.h"
#include "switchyard/train/checkpoint.h"
#include "train/config_fields.h"

namespace switchyard::train {

using nlohmann::json;

namespace {

// Whether `text` is valid UTF-8 (what a JSON string can hold).
bool IsValidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto b = static_cast<unsigned char>(text[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (b < 0x80) {
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      n = 1, cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 2, cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 3, cp = b & 0x07;
    } else {
      return false;
    }
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= text.size()) return false;
      const auto c = static_cast<unsigned char>(text[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

json StringJson(const std::string& text) {
  if (IsValidUtf8(text)) return text;
  std::string hex;
  for (char ch : text) hex += fmt::format("{:02x}", static_cast<unsigned char>(ch));
  return json{{"hex", hex}};
}

// The string of StringJson's {"hex": ...} form; throws `bad` for anything else.
template <typename Bad>
std::string StringFromHexJson(const json& v, Bad&& bad) {
  if (!v.is_object() || v.size() != 1 || !v.contains("hex") || !v.at("hex").is_string()) {
    throw bad();
  }
  const std::string hex = v.at("hex").get<std::string>();
  if (hex.size() % 2 != 0) throw bad();
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    int byte = 0;
    for (size_t k = 0; k < 2; ++k) {
      const char c = hex[i + k];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) throw bad();
      byte = byte * 16 + d;
    }
    if (byte == 0) throw bad();  // no path holds a NUL byte
    out += static_cast<char>(byte);
  }
  return out;
}

struct ToJsonVisitor {
  json& j;
  template <typename T>
  void operator()(const ConfigKeyInfo& info, const T& v) {
    const char* key = info.name;
    if constexpr (config_keys::IsChoice<T>::value) {
      j[key] = std::string(v.name());
    } else if constexpr (kIsModelChoice<T>) {
      j[key] = std::string(ChoiceTraits<T>::Name(v));
    } else if constexpr (std::is_same_v<T, NormKind>) {
      j[key] = std::string(NormKindName(v));
    } else if constexpr (std::is_same_v<T, kernels::Activation>) {
      j[key] = std::string(kernels::ActivationName(v));
    } else if constexpr (std::is_same_v<T, Recompute>) {
      j[key] = std::string(RecomputeName(v));
    } else if constexpr (std::is_same_v<T, Precision>) {
      j[key] = std::string(PrecisionName(v));
    } else if constexpr (std::is_same_v<T, std::string>) {
      j[key] = StringJson(v);  // paths may hold bytes that are not UTF-8
    } else {
      j[key] = v;
    }
  }
};

struct FromJsonVisitor {
  const json& j;
  std::set<std::string>& used;
  template <typename T>
  void operator()(const ConfigKeyInfo& info, T& dst) {
    const char* key = info.name;
    if (!j.contains(key)) return;
    used.insert(key);
    const json& v = j.at(key);
    auto bad = [&](const std::string& expected) {
      return InvalidArgument(
          fmt::format("config: key '{}': expected {}, got {}", key, expected, v.dump()));
    };
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) throw bad("true or false");
      dst = v.get<bool>();
    } else if constexpr (config_keys::IsChoice<T>::value) {
      using E = typename T::Enum;
      if (!v.is_string()) throw bad("one of " + ChoiceNamesText<E>());
      const T parsed(v.get<std::string>());
      SY_REQUIRE(parsed.valid(), InvalidArgument, "config: '{}' must be {}, got \"{}\"", key,
                 ChoiceNamesText<E>(), parsed.name());
      dst = parsed;
    } else if constexpr (std::is_same_v<T, std::string>) {
      // Text keys may be a bare number (--adaptive_r 2, "smart_schedule": 2).
      const bool numeric = info.values.kind == KeyValues::Kind::kText;
      if (numeric && v.is_number_integer()) {
        dst = std::to_string(v.get<int64_t>());
        return;
      }
      if (v.is_object()) {  // StringJson's form of text that is not UTF-8
        dst = StringFromHexJson(v, [&] {
          return bad("a string, or {\"hex\": \"<the bytes in hex>\"} for bytes that are not UTF-8");
        });
        return;
      }
      if (!v.is_string()) throw bad(numeric ? "a string or an integer" : "a string");
      dst = v.get<std::string>();
    } else if constexpr (kIsModelChoice<T>) {
      if (!v.is_string()) throw bad("one of " + ChoiceNamesText<T>());
      SY_REQUIRE(ChoiceFromName(v.get<std::string>(), dst), InvalidArgument,
                 "config: '{}' must be {}, got \"{}\"", key, ChoiceNamesText<T>(),
                 v.get<std::string>());
    } else if constexpr (std::is_same_v<T, NormKind>) {
      if (!v.is_string()) throw bad("\"layernorm\" or \"rmsnorm\"");
      dst = NormKindFromName(v.get<std::string>());
    } else if constexpr (std::is_same_v<T, kernels::Activation>) {
      if (!v.is_string()) throw bad("\"relu\", \"gelu\" or \"silu\"");
      dst = kernels::ActivationFromName(v.get<std::string>());
    } else if constexpr (std::is_same_v<T, Recompute>) {
      if (!v.is_string()) throw bad("\"none\", \"full\" or \"selective\"");
      dst = RecomputeFromName(v.get<std::string>());
    } else if constexpr (std::is_same_v<T, Precision>) {
      if (!v.is_string()) throw bad("\"fp32\" or \"bf16\"");
      dst = PrecisionFromName(v.get<std::string>());
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      // A JSON array, or the command line's "4,8" (a string).
      // Entries below the row's lower bound (1 unless the row says, e.g. 0 for block indices).
      const int64_t lo = info.values.ranged ? info.values.int_lo : 1;
      const std::string expected = fmt::format("a list of integers >= {} ([4, 8] or \"4,8\")", lo);
      std::vector<int64_t> out;
      if (v.is_string()) {
        const std::string text = v.get<std::string>();
        size_t at = 0;
        while (at <= text.size() && !text.empty()) {
          const size_t comma = std::min(text.find(',', at), text.size());
          const std::string item = text.substr(at, comma - at);
          size_t used_chars = 0;
          int64_t n = 0;
          try {
            n = std::stoll(item, &used_chars);
          } catch (const std::exception&) {
            throw bad(expected);
          }
          if (used_chars != item.size() || n < lo) throw bad(expected);
          out.push_back(n);
          at = comma + 1;
        }
      } else if (v.is_number_integer()) {  // one MoE block
        if (v.get<int64_t>() < lo) throw bad(expected);
        out.push_back(v.get<int64_t>());
      } else if (v.is_array()) {
        for (const json& e : v) {
          if (!e.is_number_integer() || e.get<int64_t>() < lo) throw bad(expected);
          out.push_back(e.get<int64_t>());
        }
      } else {
        throw bad(expected);
      }
      dst = std::move(out);
    } else if constexpr (std::is_integral_v<T>) {
      if (!v.is_number_integer()) throw bad("an integer");
      if constexpr (std::is_unsigned_v<T>) {
        if (v.is_number_unsigned() || v.get<int64_t>() >= 0) {
          dst = v.get<T>();
        } else {
          throw bad("a non-negative integer");
        }
      } else {
        // A value the field cannot hold would be truncated silently (threads is an int; 2^63
        // does not fit int64).
        const bool above = v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX;
        const int64_t x = above ? INT64_MAX : v.get<int64_t>();
        if (above || x < std::numeric_limits<T>::min() || x > std::numeric_limits<T>::max()) {
          throw bad(fmt::format("an integer in [{}, {}]", std::numeric_limits<T>::min(),
                                std::numeric_limits<T>::max())
                        .c_str());
        }
        dst = static_cast<T>(x);
      }
    } else {
      if (!v.is_number()) throw bad("a number");
      dst = v.get<T>();
    }
  }
};

// Every key as a JSON object (TrainConfigToJson's text).
json ConfigJson(const TrainConfig& config) {
  json j = json::object();
  VisitFields(config, ToJsonVisitor{j});
  return j;
}

}  // namespace

std::string StringToJsonValue(const std::string& text) { return StringJson(text).dump(); }

std::string TrainConfigToJson(const TrainConfig& config) { return ConfigJson(config).dump(2); }

TrainConfig TrainConfigFromJson(std::string_view json_text, const TrainConfig& base) {
  json j;
  try {
    j = ParseJsonStrict(json_text, "config");
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("config: not valid JSON: {}", e.what()));
  }
  SY_REQUIRE(j.is_object(), InvalidArgument, "config: expected a JSON object, got {}",
             j.type_name());
  TrainConfig c = base;
  std::set<std::string> used;
  VisitFields(c, FromJsonVisitor{j, used});
  for (const auto& [key, value] : j.items()) {
    SY_REQUIRE(used.count(key) != 0, InvalidArgument, "config: unknown key '{}'", key);
  }
  return c;
}

namespace {

// Static checks of config_keys.def: each row's value kind fits its field's type.
using namespace config_keys;  // NOLINT(google-build-using-namespace): the table's vocabulary
#define SY_TRAIN_KEY(key, Type, default_value, category, resume, values, ...) \
  static_assert(KindFits<Type>(values.kind), "config_keys.def: '" #key "': wrong value kind");
#define SY_MODEL_KEY(key, category, resume, values, ...)           \
  static_assert(KindFits<decltype(ModelConfig::key)>(values.kind), \
                "config_keys.def: '" #key "': wrong value kind");
#include "switchyard/train/config_keys.def"
#undef SY_TRAIN_KEY
#undef SY_MODEL_KEY

}  // namespace

const std::vector<ConfigKeyInfo>& TrainConfigTable() {
  static const std::vector<ConfigKeyInfo> kTable = {
#define SY_MODEL_KEY(key, category, resume, values, layer_key, help) \
  {#key, category, resume, values, layer_key, help},
#define SY_TRAIN_KEY(key, Type, default_value, ...) SY_MODEL_KEY(key, __VA_ARGS__)
#include "switchyard/train/config_keys.def"
#undef SY_TRAIN_KEY
#undef SY_MODEL_KEY
  };
  return kTable;
}

const ConfigKeyInfo* FindConfigKey(std::string_view key) {
  for (const ConfigKeyInfo& info : TrainConfigTable()) {
    if (key == info.name) return &info;
  }
  return nullptr;
}

std::vector<ConfigKey> TrainConfigKeys() {
  std::vector<ConfigKey> keys;
  for (const ConfigKeyInfo& info : TrainConfigTable()) {
    const char* type = "";
    switch (info.values.kind) {
      case KeyValues::Kind::kInt: type = "INT"; break;
      case KeyValues::Kind::kFloat: type = "FLOAT"; break;
      case KeyValues::Kind::kBool: type = "BOOL"; break;
      case KeyValues::Kind::kPath: type = "PATH"; break;
      case KeyValues::Kind::kText:
      case KeyValues::Kind::kChoice: type = "NAME"; break;
      case KeyValues::Kind::kList: type = "LIST"; break;
    }
    keys.push_back({info.name, info.help, type});
  }
  return keys;
}

void SetTrainConfigValue(TrainConfig& config, std::string_view key, std::string_view text) {
  json value;
  try {
    value = json::parse(text);
  } catch (const json::exception&) {
    value = StringJson(std::string(text));  // a bare string; a path may not be UTF-8
  }
  json j = json::object();
  j[std::string(key)] = value;
  config = TrainConfigFromJson(j.dump(), config);
}

int64_t NumMoeBlocks(const ModelConfig& model) {
  int64_t n = 0;
  for (int64_t i = 0; i < model.num_layers; ++i) n += IsMoeBlock(model, i) ? 1 : 0;
  return n;
}

int64_t BlockExperts(const TrainConfig& c, int64_t block) {
  if (c.experts_per_block.empty() || c.model.moe_every <= 0) return c.num_experts;
  // The MoE blocks before this one (mlp_only_layers may leave gaps).
  size_t ordinal = 0;
  for (int64_t i = 0; i < block; ++i) ordinal += IsMoeBlock(c.model, i) ? 1 : 0;
  SY_CHECK(ordinal < c.experts_per_block.size(), "block {} has no experts_per_block entry", block);
  return c.experts_per_block[ordinal];
}

moe::LayerConfig MoeBlockLayerConfig(const TrainConfig& c, int64_t block) {
  moe::LayerConfig layer = MoeLayerConfig(c);
  layer.num_experts = BlockExperts(c, block);
  moe::ValidateConfig(layer);
  return layer;
}

bool UsesConcatAux(const TrainConfig& c) {
  return c.aux_loss == "hf_concat" && NumMoeBlocks(c.model) > 0;
}

int64_t RouterGroupCount(const TrainConfig& c) {
  if (c.router_group_by == RouterGroupBy::kNone) return c.num_groups;
  const char* what = c.router_group_by == RouterGroupBy::kEpRank ? "ep_rank" : "node";
  SY_REQUIRE(c.group_topk > 0, InvalidArgument,
             "config: 'router_group_by' {} limits each token to 'group_topk' groups: set "
             "'group_topk' (>= 1), got {}",
             what, c.group_topk);
  SY_REQUIRE(c.num_groups == 1, InvalidArgument,
             "config: 'router_group_by' {} derives the router's groups from the layout: leave "
             "'num_groups' unset (1), got {}",
             what, c.num_groups);
  const int64_t ep = ResolveLayout(c, static_cast<int>(c.ranks)).ep;
  int64_t groups = ep;
  if (c.router_group_by == RouterGroupBy::kNode) {
    const int64_t node = c.a2a_ranks_per_node;
    SY_REQUIRE(node > 0 && ep % node == 0, InvalidArgument,
               "config: 'router_group_by' node groups the experts by nodes of "
               "'a2a_ranks_per_node' consecutive ranks of the expert group: it must be set and "
               "divide the expert-parallel size {}, got {}",
               ep, node);
    groups = ep / node;
  }
  const std::vector<int64_t> experts =
      c.experts_per_block.empty() ? std::vector<int64_t>{c.num_experts} : c.experts_per_block;
  for (int64_t e : experts) {
    SY_REQUIRE(e % ep == 0, InvalidArgument,
               "config: 'router_group_by' {} needs whole experts on every expert-parallel rank: "
               "{} experts do not divide by 'ep' {}",
               what, e, ep);
  }
  return groups;
}

moe::LayerConfig MoeLayerConfig(const TrainConfig& c) {
  json j = json::object();
  if (!c.moe_layer_config.empty()) {
    try {
      j = ParseJsonStrict(ReadTextFile(c.moe_layer_config), c.moe_layer_config);
    } catch (const json::exception& e) {
      throw InvalidArgument(fmt::format("{}: not valid JSON: {}", c.moe_layer_config, e.what()));
    }
    SY_REQUIRE(j.is_object(), InvalidArgument, "{}: expected a JSON object", c.moe_layer_config);
    SY_REQUIRE(!j.contains("training"), InvalidArgument,
               "{}: key 'training' is not allowed in a training run's MoE layer config: the "
               "trainer runs its training steps with the config's gate noise and random routing "
               "and its evaluations without them; remove the key",
               c.moe_layer_config);
  }
  // The keys with a layer_key in config_keys.def, over the file's values.
  const json mine = ConfigJson(c);
  for (const ConfigKeyInfo& info : TrainConfigTable()) {
    if (*info.layer_key == '\0') continue;
    // check_finite false keeps the file's value.
    if (std::string_view(info.name) == "check_finite" && !c.check_finite) continue;
    j[info.layer_key] = mine.at(info.name);
  }
  j["hidden_dim"] = c.expert_hidden_dim > 0 ? c.expert_hidden_dim : c.model.hidden_dim;
  if (c.model.mlp == MlpKind::kSwiGlu) {  // the families' experts: down(silu(gate x) * up x)
    j["gated"] = true;
    j["activation"] = "silu";
    j["fc_bias"] = c.model.mlp_bias;
  }
  if (c.hf_router) {
    // Softmax over all experts then the top k, renormalized (norm_topk_prob) or not, dropless
    // (docs/models.md "Routers": softmax_after_topk equals softmax-then-renormalize for every k,
    // which normalize_gate does only for k > 1).
    j["score_function"] = c.norm_topk_prob ? "softmax_after_topk" : "softmax";
    j["normalize_gate"] = false;
    j["dropless"] = true;
  }
  if (c.router_group_by != RouterGroupBy::kNone) j["num_groups"] = RouterGroupCount(c);
  // aux_loss sequence: a batch's rows are its samples' seq_len positions in turn (batch-major).
  if (c.aux_loss == "sequence") {
    const int64_t file_length = j.contains("sequence_length") && j["sequence_length"].is_number()
                                    ? j["sequence_length"].get<int64_t>()
                                    : 0;
    SY_REQUIRE(file_length == 0 || file_length == c.model.seq_len, InvalidArgument,
               "config: 'moe_layer_config' {} sets sequence_length {} for aux_loss \"sequence\", "
               "but the run's sequences are 'seq_len' {} tokens: remove the key (train sets it)",
               c.moe_layer_config, file_length, c.model.seq_len);
    j["sequence_length"] = c.model.seq_len;
  }
  try {
    return moe::LayerConfigFromJson(j.dump());
  } catch (const InvalidArgument& e) {
    // The layer's checks name "layer.json"; here the options come from the run's keys (and the
    // moe_layer_config file when one is given): name those instead.
    std::string message = e.what();
    constexpr std::string_view kLayerFile = "layer.json: ";
    if (message.starts_with(kLayerFile)) message.erase(0, kLayerFile.size());
    throw InvalidArgument(fmt::format(
        "config: the MoE layer options (the run's MoE keys{}): {}",
        c.moe_layer_config.empty() ? std::string()
                                   : fmt::format(" over 'moe_layer_config' {}", c.moe_layer_config),
        message));
  }
}

int AdaptiveRAtStep(std::string_view adaptive_r, int64_t step) {
  std::vector<int> rs;
  const std::string text(adaptive_r);
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    at = comma + 1;
    try {
      rs.push_back(parallel::AdaptiveRFromString(item));
    } catch (const InvalidArgument&) {
      throw InvalidArgument(fmt::format(
          "config: 'adaptive_r' \"{}\": expected \"default\", \"auto\", an integer r >= 0 or a "
          "comma-separated list of those (one per step, in turn); \"{}\" is none of them",
          text, item));
    }
  }
  return rs[static_cast<size_t>(step % static_cast<int64_t>(rs.size()))];
}

}  // namespace switchyard::train

namespace switchyard::train {

const std::vector<std::string>& ResumeMustMatchKeys() {
  static const std::vector<std::string> kKeys = [] {
    std::vector<std::string> keys;
    for (const ConfigKeyInfo& info : TrainConfigTable()) {
      if (info.resume == KeyResume::kMustMatch) keys.emplace_back(info.name);
    }
    return keys;
  }();
  return kKeys;
}

bool IsLayoutKey(std::string_view key) {
  const ConfigKeyInfo* info = FindConfigKey(key);
  return info != nullptr && info->category == KeyCategory::kLayout;
}

namespace {

// The values `arch` gives a run (docs/models.md, the family table): the families' components,
// router, balancing loss (Hugging Face's, hf_concat) and its coefficient, and norms. Sizes stay the
// run's (model_dim, layers, heads, experts), except the kv heads of Mixtral (a quarter of the
// heads, at least one).
json ArchPreset(Arch arch, const TrainConfig& c) {
  if (arch == Arch::kGpt) return json::object();
  json j = {{"norm", "rmsnorm"},        {"position_embedding", "rope"},
            {"attention_bias", "none"}, {"mlp", "swiglu"},
            {"mlp_bias", false},        {"tied_head", false},
            {"hf_router", true},        {"norm_topk_prob", false},
            {"moe_every", 1},           {"rope_theta", 10000.0},
            {"norm_eps", 1e-5},         {"aux_loss_coef", 0.001},
            {"capacity_factor", 0.0},   {"aux_loss", "hf_concat"}};
  switch (arch) {
    case Arch::kMixtral:
      j["rope_theta"] = 1e6;
      j["norm_topk_prob"] = true;
      j["num_kv_heads"] = std::max<int64_t>(1, c.model.num_heads / 4);
      break;
    case Arch::kQwen2Moe:
      j["norm_eps"] = 1e-6;
      j["attention_bias"] = "qkv";
      // Qwen2MoeConfig's defaults make the shared expert as wide as the dense MLP (both 5632).
      j["gated_shared_expert_hidden"] = c.model.hidden_dim;
      break;
    case Arch::kOlmoe:
      j["qk_norm"] = true;
      j["aux_loss_coef"] = 0.01;
      break;
    case Arch::kGpt: break;
  }
  return j;
}

// Sets the `arch` preset's values of the keys no source set (ResolveTrainConfig).
void ApplyArchPreset(ResolvedTrainConfig& r) {
  json preset = ArchPreset(r.config.arch, r.config);
  json take = json::object();
  for (const auto& [key, value] : preset.items()) {
    if (r.explicit_keys.count(key) == 0) take[key] = value;
  }
  if (!take.empty()) r.config = TrainConfigFromJson(take.dump(), r.config);
}

// Takes the moe_layer_config file's values for the shared keys no source set explicitly;
// collects the keys whose explicit values disagree with the file's.
void ApplyMoeLayerFile(ResolvedTrainConfig& r) {
  TrainConfig& c = r.config;
  if (c.moe_layer_config.empty()) return;
  const json file = ParseJsonStrict(ReadTextFile(c.moe_layer_config), c.moe_layer_config);
  SY_REQUIRE(file.is_object(), InvalidArgument, "{}: expected a JSON object", c.moe_layer_config);
  std::vector<std::string> conflicts;
  // The keys with a layer_key in config_keys.def. (The layer's hidden_dim is the experts' hidden
  // size: expert_hidden_dim or, when that is 0, hidden_dim.)
  for (const ConfigKeyInfo& info : TrainConfigTable()) {
    const char* layer_key = info.layer_key;
    const char* train_key = info.name;
    if (*layer_key == '\0' || !file.contains(layer_key)) continue;
    const json& theirs = file.at(layer_key);
    const json all = ConfigJson(c);
    json mine = all.at(train_key);
    std::string key = train_key;
    auto source = r.explicit_keys.find(key);
    if (key == "expert_hidden_dim" && c.expert_hidden_dim == 0) {
      // 0 means hidden_dim: the effective value, and hidden_dim's source when that is explicit.
      mine = all.at("hidden_dim");
      if (source == r.explicit_keys.end()) {
        auto h = r.explicit_keys.find("hidden_dim");
        if (h != r.explicit_keys.end()) {
          source = h;
          key = "hidden_dim";
        }
      }
    }
    if (source != r.explicit_keys.end()) {
      if (mine != theirs) {
        conflicts.push_back(fmt::format("'{}': {} gives {}, {} gives {} ('{}')", key,
                                        source->second, mine.dump(), c.moe_layer_config,
                                        theirs.dump(), layer_key));
      }
      continue;
    }
    json one = json::object();
    one[train_key] = theirs;
    try {
      c = TrainConfigFromJson(one.dump(), c);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("{}: key '{}': {}", c.moe_layer_config, layer_key, e.what()));
    }
    r.explicit_keys[train_key] = c.moe_layer_config;
  }
  SY_REQUIRE(conflicts.empty(), InvalidArgument,
             "config: explicit values disagree (set each in one place, or make them equal): {}",
             fmt::join(conflicts, "; "));
}

}  // namespace

ResolvedTrainConfig ResolveTrainConfig(const TrainConfigSources& s) {
  ResolvedTrainConfig r;
  r.config = s.defaults;
  json checkpoint = json::object();
  std::string checkpoint_name;
  if (!s.resume.empty()) {
    checkpoint_name = "checkpoint " + ResolveCheckpoint(s.resume);
    checkpoint = json::parse(ReadCheckpointConfigJson(s.resume));
    json taken = json::object();
    for (const auto& [key, value] : checkpoint.items()) {
      if (IsLayoutKey(key) || key == "out") continue;
      taken[key] = value;
      r.explicit_keys[key] = checkpoint_name;
    }
    // Keys this program does not know (a newer checkpoint) are an error here, as in a file.
    r.config = TrainConfigFromJson(taken.dump(), r.config);
  }
  std::map<std::string, std::string> user;  // keys set by --config or a flag -> source
  if (!s.config_file.empty()) {
    const std::string text = ReadTextFile(s.config_file);
    const json parsed = ParseJsonStrict(text, s.config_file);  // errors name the file
    r.config = TrainConfigFromJson(text, r.config);            // validates the keys
    for (const auto& [key, value] : parsed.items()) {
      user[key] = fmt::format("--config {}", s.config_file);
    }
  }
  for (const auto& [key, text] : s.flags) {
    SetTrainConfigValue(r.config, key, text);
    user[key] = "--" + key;
  }
  r.out_given = user.count("out") != 0;
  if (!s.resume.empty()) {
    // Every setting that must match the checkpoint and is given otherwise, in one message.
    std::vector<std::string> conflicts;
    const json mine = json::parse(TrainConfigToJson(r.config));
    for (const std::string& key : ResumeMustMatchKeys()) {
      auto it = user.find(key);
      if (it == user.end() || !checkpoint.contains(key)) continue;
      if (mine.at(key) != checkpoint.at(key)) {
        conflicts.push_back(fmt::format("'{}': {} gives {}, the checkpoint has {}", key, it->second,
                                        mine.at(key).dump(), checkpoint.at(key).dump()));
      }
    }
    SY_REQUIRE(conflicts.empty(), InvalidArgument,
               "resume: {} settings differ from the {} (a resumed run takes them from its "
               "checkpoint: leave them out): {}",
               conflicts.size(), checkpoint_name, fmt::join(conflicts, "; "));
  }
  for (const auto& [key, source] : user) r.explicit_keys[key] = source;
  ApplyArchPreset(r);
  ApplyMoeLayerFile(r);
  return r;
}

}  // namespace switchyard::train
