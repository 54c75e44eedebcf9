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
  void operator()(const char* key, const T& v) {
    if constexpr (std::is_same_v<T, NormKind>) {
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
  void operator()(const char* key, T& dst) {
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
    } else if constexpr (std::is_same_v<T, std::string>) {
      // Keys whose text may be a bare number (--adaptive_r 2, "smart_schedule": 2).
      const std::string k = key;
      const bool numeric = k == "adaptive_r" || k == "smart_schedule" || k == "shadow_experts";
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
      const char* expected = "a list of integers >= 1 ([4, 8] or \"4,8\")";
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
          if (used_chars != item.size() || n < 1) throw bad(expected);
          out.push_back(n);
          at = comma + 1;
        }
      } else if (v.is_number_integer()) {  // one MoE block
        if (v.get<int64_t>() < 1) throw bad(expected);
        out.push_back(v.get<int64_t>());
      } else if (v.is_array()) {
        for (const json& e : v) {
          if (!e.is_number_integer() || e.get<int64_t>() < 1) throw bad(expected);
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

}  // namespace

std::string StringToJsonValue(const std::string& text) { return StringJson(text).dump(); }

std::string TrainConfigToJson(const TrainConfig& config) {
  json j = json::object();
  TrainConfig c = config;
  VisitFields(c, ToJsonVisitor{j});
  return j.dump(2);
}

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

std::vector<ConfigKey> TrainConfigKeys() {
  static const std::map<std::string, std::string> kHelp = {
      {"vocab_size", "vocabulary size (256: bytes)"},
      {"seq_len", "context length in tokens"},
      {"model_dim", "model (hidden) dimension"},
      {"num_layers", "transformer blocks"},
      {"num_heads", "attention heads (divide model_dim)"},
      {"hidden_dim", "hidden size of the dense FFN"},
      {"norm", "layernorm | rmsnorm"},
      {"activation", "FFN activation: gelu | relu | silu"},
      {"tied_head", "output head shares the embedding (true | false)"},
      {"moe_every", "MoE FFN in blocks i with i % N == N - 1 (0: dense model)"},
      {"init_std", "std of the normal initialization"},
      {"num_experts", "experts per MoE layer"},
      {"experts_per_block",
       "experts of each MoE block, e.g. 4,8 (PR-MoE pyramid; default: num_experts)"},
      {"top_k", "experts chosen per token"},
      {"capacity_factor", "expert capacity factor (0: no drops)"},
      {"expert_hidden_dim", "hidden size of an expert (0: hidden_dim)"},
      {"aux_loss_coef", "load-balancing loss coefficient"},
      {"z_loss_coef", "router z-loss coefficient"},
      {"moe_layer_config", "layer.json with the other MoE options (preset, drop policy, ...)"},
      {"check_finite", "MoE blocks reject non-finite inputs (true | false)"},
      {"routing_scope", "MoE capacity, drops and balancing losses over: global | per_rank"},
      {"num_groups", "router expert groups (DeepSeek-V3 group-limited routing; 0: layer file's)"},
      {"group_topk", "groups a token may use (0: off; -1: layer file's)"},
      {"topk_scaling_factor", "routed scaling factor of the gate values (0: layer file's)"},
      {"aux_loss",
       "gshard | gshard_all_choices | importance_load | global | none (\"\": layer file's)"},
      {"expert_bias_update_rate", "aux-loss-free expert bias rate (negative: layer file's)"},
      {"router_trace", "record the MoE layers' routes into this directory"},
      {"router_trace_steps", "steps recorded by router_trace: 1,100,1000 or every:N (default all)"},
      {"router_replay", "force the MoE layers' routes recorded in this directory"},
      {"data", "training text: files and directories, comma-separated (default: fortunes)"},
      {"val_data", "held-out text for the validation loss, as data (default: val_fraction)"},
      {"val_fraction", "fraction of records held out for the validation loss"},
      {"steps", "training steps"},
      {"batch_size", "sequences per step (global)"},
      {"lr", "peak learning rate"},
      {"min_lr", "final learning rate of the cosine decay"},
      {"warmup_steps", "linear warm-up steps"},
      {"weight_decay", "AdamW decoupled weight decay"},
      {"beta1", "AdamW beta1"},
      {"beta2", "AdamW beta2"},
      {"adam_eps", "AdamW epsilon"},
      {"grad_clip", "max global gradient norm (0: off)"},
      {"nonfinite", "a non-finite loss or gradient norm: stop (error, default) | skip the step"},
      {"seed", "seed of initialization, data and sampling"},
      {"out", "run directory"},
      {"log_every", "metrics line every N steps"},
      {"eval_every", "validation loss every N steps (0: at the end)"},
      {"eval_tokens", "held-out tokens per evaluation (0: all)"},
      {"checkpoint_every", "checkpoint every N steps (0: at the end)"},
      {"keep_checkpoints", "checkpoints kept (0: all)"},
      {"sample_tokens", "bytes of text generated at the end"},
      {"temperature", "sampling temperature"},
      {"threads", "compute threads (0: the threading policy)"},
      {"trace_step", "write step N's timeline (every rank) to <out>/trace.json (0: none)"},
      {"ranks", "ranks (threads of this process; under mpirun: the MPI world)"},
      {"ep", "expert-parallel size (0: all ranks)"},
      {"zero_stage", "ZeRO stage of the optimizer: 0, 1, 2 or 3"},
      {"overlap_grad_reduce", "reduce gradient buckets while the backward goes on"},
      {"bucket_mb", "gradient bucket size in MiB (0: one bucket per block)"},
      {"dispatch", "MoE dispatcher: alltoall | alltoallv | allgather"},
      {"overlap_degree", "a2a-FFN overlap degree D of the MoE blocks (1: none)"},
      {"adaptive_r", "Tutel's adaptive r: default | auto | R | R0,R1,... (one per step, in turn)"},
      {"a2a_algo", "MoE token all-to-all: flat | 2dh (hierarchical)"},
      {"a2a_ranks_per_node", "ranks per node of the 2dh all-to-all (0: the machine's)"},
      {"smart_schedule", "FasterMoE's smart schedule: off | auto | group size g"},
      {"shadow_experts", "FasterMoE's shadow experts: none | auto | E1,E2,..."},
      {"tp", "tensor-parallel size (divides ranks, num_heads, hidden_dim, vocab_size)"},
      {"sequence_parallel", "shard norms and the residual stream along the sequence over tp"},
      {"tp_comm_overlap", "sequence-parallel all-gather/reduce-scatter as rings under the GEMMs"},
      {"arrangement", "experts beside tp: auto | deepspeed | megatron"},
      {"etp", "expert tensor-parallel size (megatron arrangement)"},
      {"cp", "context-parallel size: each sequence split over cp ranks"},
      {"cp_algo", "context-parallel attention: ring | ulysses"},
      {"attention_core",
       "auto | softmax (keeps [seq, seq] probabilities) | flash (log-sum-exp, no [seq, seq]); "
       "auto: flash with cp > 1"},
      {"memory_budget_mib",
       "refuse a layout whose per-rank memory estimate exceeds this (0: none)"},
      {"microbatches", "micro-batches per step (gradient accumulation; divides batch_size)"},
      {"recompute", "activation recomputation: none | full (per block) | selective (attention)"},
      {"precision", "fp32 | bf16 (bfloat16 GEMM operands and saved activations, fp32 master)"},
      {"pp", "pipeline stages (divides ranks / tp)"},
      {"pipeline_schedule", "pipeline schedule: fthenb | 1f1b | interleaved | zb-h1"},
      {"virtual_stages", "model chunks per pipeline stage (interleaved schedule)"},
      {"pipeline_split", "blocks per virtual stage, e.g. 1,3 (empty: even)"},
  };
  std::vector<ConfigKey> keys;
  TrainConfig c;
  VisitFields(c, [&](const char* key, auto& field) {
    auto it = kHelp.find(key);
    SY_CHECK(it != kHelp.end(), "no help for config key '{}'", key);
    using T = std::decay_t<decltype(field)>;
    const std::string k = key;
    const char* type = std::is_same_v<T, std::vector<int64_t>> ? "LIST"
                       : std::is_same_v<T, bool>               ? "BOOL"
                       : std::is_integral_v<T>                 ? "INT"
                       : std::is_floating_point_v<T>           ? "FLOAT"
                       : k == "data" || k == "val_data" || k == "out" || k == "moe_layer_config"
                           ? "PATH"
                           : "NAME";
    keys.push_back({key, it->second, type});
  });
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
  return model.moe_every > 0 ? model.num_layers / model.moe_every : 0;
}

int64_t BlockExperts(const TrainConfig& c, int64_t block) {
  if (c.experts_per_block.empty() || c.model.moe_every <= 0) return c.num_experts;
  const auto ordinal = static_cast<size_t>(block / c.model.moe_every);
  SY_CHECK(ordinal < c.experts_per_block.size(), "block {} has no experts_per_block entry", block);
  return c.experts_per_block[ordinal];
}

moe::LayerConfig MoeBlockLayerConfig(const TrainConfig& c, int64_t block) {
  moe::LayerConfig layer = MoeLayerConfig(c);
  layer.num_experts = BlockExperts(c, block);
  moe::ValidateConfig(layer);
  return layer;
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
  j["model_dim"] = c.model.model_dim;
  j["hidden_dim"] = c.expert_hidden_dim > 0 ? c.expert_hidden_dim : c.model.hidden_dim;
  j["num_experts"] = c.num_experts;
  j["top_k"] = c.top_k;
  j["capacity_factor"] = c.capacity_factor;
  j["aux_loss_coef"] = c.aux_loss_coef;
  j["z_loss_coef"] = c.z_loss_coef;
  j["activation"] = std::string(kernels::ActivationName(c.model.activation));
  j["seed"] = c.seed;
  if (c.check_finite) j["check_finite"] = true;  // false keeps the file's value
  if (c.num_groups > 0) j["num_groups"] = c.num_groups;
  if (c.group_topk >= 0) j["group_topk"] = c.group_topk;
  if (c.topk_scaling_factor > 0) j["topk_scaling_factor"] = c.topk_scaling_factor;
  if (!c.aux_loss.empty()) j["aux_loss"] = c.aux_loss;
  if (c.expert_bias_update_rate >= 0) j["expert_bias_update_rate"] = c.expert_bias_update_rate;
  return moe::LayerConfigFromJson(j.dump());
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
  static const std::vector<std::string> kKeys = {
      "vocab_size",        "seq_len",    "model_dim",   "num_layers",
      "num_heads",         "hidden_dim", "norm",        "activation",
      "tied_head",         "moe_every",  "num_experts", "top_k",
      "expert_hidden_dim", "seed",       "batch_size",  "experts_per_block"};
  return kKeys;
}

bool IsLayoutKey(std::string_view key) {
  return key == "ranks" || key == "ep" || key == "zero_stage" || key == "overlap_grad_reduce" ||
         key == "bucket_mb" || key == "dispatch" || key == "overlap_degree" || key == "threads" ||
         key == "tp" || key == "sequence_parallel" || key == "tp_comm_overlap" ||
         key == "arrangement" || key == "etp" || key == "pp" || key == "pipeline_schedule" ||
         key == "virtual_stages" || key == "pipeline_split" || key == "cp" || key == "cp_algo" ||
         key == "attention_core" || key == "memory_budget_mib" || key == "adaptive_r" ||
         key == "a2a_algo" || key == "a2a_ranks_per_node" || key == "smart_schedule" ||
         key == "shadow_experts" || key == "trace_step";
}

namespace {

// The MoE layer keys that are also TrainConfig keys: layer.json key -> TrainConfig key.
// (hidden_dim is the experts' hidden size, TrainConfig's expert_hidden_dim or, when that is 0,
// hidden_dim.)
constexpr std::pair<const char*, const char*> kSharedMoeKeys[] = {
    {"model_dim", "model_dim"},
    {"hidden_dim", "expert_hidden_dim"},
    {"num_experts", "num_experts"},
    {"top_k", "top_k"},
    {"capacity_factor", "capacity_factor"},
    {"aux_loss_coef", "aux_loss_coef"},
    {"z_loss_coef", "z_loss_coef"},
    {"activation", "activation"},
    {"seed", "seed"},
    {"check_finite", "check_finite"},
};

// Takes the moe_layer_config file's values for the shared keys no source set explicitly;
// collects the keys whose explicit values disagree with the file's.
void ApplyMoeLayerFile(ResolvedTrainConfig& r) {
  TrainConfig& c = r.config;
  if (c.moe_layer_config.empty()) return;
  const json file = ParseJsonStrict(ReadTextFile(c.moe_layer_config), c.moe_layer_config);
  SY_REQUIRE(file.is_object(), InvalidArgument, "{}: expected a JSON object", c.moe_layer_config);
  std::vector<std::string> conflicts;
  for (const auto& [layer_key, train_key] : kSharedMoeKeys) {
    if (!file.contains(layer_key)) continue;
    const json& theirs = file.at(layer_key);
    const json all = json::parse(TrainConfigToJson(c));
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
  ApplyMoeLayerFile(r);
  return r;
}

}  // namespace switchyard::train
