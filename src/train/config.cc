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
#include "switchyard/parallel/pipeline.h"
#include "switchyard/parallel/schedule.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/distributed.h"

namespace switchyard::train {

using nlohmann::json;

namespace {

// Calls fn(key, field) for every option, in a fixed order (the JSON key order).
template <typename Config, typename Fn>
void VisitFields(Config& c, Fn&& fn) {
  fn("vocab_size", c.model.vocab_size);
  fn("seq_len", c.model.seq_len);
  fn("model_dim", c.model.model_dim);
  fn("num_layers", c.model.num_layers);
  fn("num_heads", c.model.num_heads);
  fn("hidden_dim", c.model.hidden_dim);
  fn("norm", c.model.norm);
  fn("activation", c.model.activation);
  fn("tied_head", c.model.tied_head);
  fn("moe_every", c.model.moe_every);
  fn("init_std", c.model.init_std);
  fn("num_experts", c.num_experts);
  fn("experts_per_block", c.experts_per_block);
  fn("top_k", c.top_k);
  fn("capacity_factor", c.capacity_factor);
  fn("expert_hidden_dim", c.expert_hidden_dim);
  fn("aux_loss_coef", c.aux_loss_coef);
  fn("z_loss_coef", c.z_loss_coef);
  fn("moe_layer_config", c.moe_layer_config);
  fn("check_finite", c.check_finite);
  fn("routing_scope", c.routing_scope);
  fn("data", c.data);
  fn("val_data", c.val_data);
  fn("val_fraction", c.val_fraction);
  fn("steps", c.steps);
  fn("batch_size", c.batch_size);
  fn("lr", c.lr);
  fn("min_lr", c.min_lr);
  fn("warmup_steps", c.warmup_steps);
  fn("weight_decay", c.weight_decay);
  fn("beta1", c.beta1);
  fn("beta2", c.beta2);
  fn("adam_eps", c.adam_eps);
  fn("grad_clip", c.grad_clip);
  fn("nonfinite", c.nonfinite);
  fn("seed", c.seed);
  fn("out", c.out);
  fn("log_every", c.log_every);
  fn("eval_every", c.eval_every);
  fn("eval_tokens", c.eval_tokens);
  fn("checkpoint_every", c.checkpoint_every);
  fn("keep_checkpoints", c.keep_checkpoints);
  fn("sample_tokens", c.sample_tokens);
  fn("temperature", c.temperature);
  fn("threads", c.threads);
  fn("trace_step", c.trace_step);
  fn("ranks", c.ranks);
  fn("ep", c.ep);
  fn("zero_stage", c.zero_stage);
  fn("overlap_grad_reduce", c.overlap_grad_reduce);
  fn("bucket_mb", c.bucket_mb);
  fn("dispatch", c.dispatch);
  fn("overlap_degree", c.overlap_degree);
  fn("adaptive_r", c.adaptive_r);
  fn("a2a_algo", c.a2a_algo);
  fn("a2a_ranks_per_node", c.a2a_ranks_per_node);
  fn("smart_schedule", c.smart_schedule);
  fn("shadow_experts", c.shadow_experts);
  fn("tp", c.tp);
  fn("sequence_parallel", c.sequence_parallel);
  fn("tp_comm_overlap", c.tp_comm_overlap);
  fn("arrangement", c.arrangement);
  fn("etp", c.etp);
  fn("cp", c.cp);
  fn("cp_algo", c.cp_algo);
  fn("attention_core", c.attention_core);
  fn("memory_budget_mib", c.memory_budget_mib);
  fn("microbatches", c.microbatches);
  fn("recompute", c.model.recompute);
  fn("precision", c.model.precision);
  fn("pp", c.pp);
  fn("pipeline_schedule", c.pipeline_schedule);
  fn("virtual_stages", c.virtual_stages);
  fn("pipeline_split", c.pipeline_split);
}

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
  return moe::LayerConfigFromJson(j.dump());
}

namespace {

// The range of every integer key, checked on the full 64-bit value before anything narrows it
// (the layout sizes become `int`: a value such as 2^32 + 1 would wrap to 1). Keys not listed
// here are checked by ValidateModelConfig or below.
struct IntRange {
  const char* key;
  int64_t lo, hi;
};
constexpr int64_t kMaxRanks = 4096;  // as `switchyard layer`
constexpr int64_t kMaxThreads = 256;
constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
constexpr IntRange kIntRanges[] = {
    {"num_experts", 1, int64_t{1} << 20},
    {"top_k", 1, int64_t{1} << 20},
    {"expert_hidden_dim", 0, int64_t{1} << 24},
    {"steps", 0, kAny},
    {"batch_size", 1, kAny},
    {"warmup_steps", 0, kAny},
    {"log_every", 1, kAny},
    {"eval_every", 0, kAny},
    {"eval_tokens", 0, kAny},
    {"checkpoint_every", 0, kAny},
    {"keep_checkpoints", 0, kAny},
    {"sample_tokens", 0, kAny},
    {"threads", 0, kMaxThreads},
    {"trace_step", 0, kAny},
    {"ranks", 1, kMaxRanks},
    {"ep", 0, kMaxRanks},
    {"zero_stage", 0, 3},
    {"overlap_degree", 1, 1024},
    {"a2a_ranks_per_node", 0, kMaxRanks},
    {"tp", 1, kMaxRanks},
    {"etp", 1, kMaxRanks},
    {"cp", 1, kMaxRanks},
    {"microbatches", 1, int64_t{1} << 20},
    {"pp", 1, kMaxRanks},
    {"virtual_stages", 1, kMaxRanks},
};

// The range of every float key: finite, in [lo, hi] (hi exclusive when `open_hi`).
struct FloatRange {
  const char* key;
  double lo, hi;
  bool open_hi = false;
  const char* unit = "";
};
constexpr double kHuge = 1e30;
constexpr FloatRange kFloatRanges[] = {
    // |cf| beyond the experts of a block changes nothing; 1e6 keeps every size derived from it
    // in range.
    {"capacity_factor", -1e6, 1e6},
    {"aux_loss_coef", 0, kHuge},
    {"z_loss_coef", 0, kHuge},
    {"val_fraction", 0, 0.5},
    {"lr", 0, kHuge},
    {"min_lr", 0, kHuge},
    {"weight_decay", 0, kHuge},
    {"beta1", 0, 1, true},
    {"beta2", 0, 1, true},
    {"adam_eps", 0, kHuge},
    {"grad_clip", 0, kHuge},
    {"temperature", 0, kHuge},
    {"bucket_mb", 0, double{1 << 20}, false, " MiB"},
    {"memory_budget_mib", 0, double{1 << 30}, false, " MiB"},
};

void CheckRanges(const TrainConfig& config) {
  TrainConfig c = config;
  VisitFields(c, [](const char* key, const auto& v) {
    using T = std::decay_t<decltype(v)>;
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool> && std::is_signed_v<T>) {
      for (const IntRange& r : kIntRanges) {
        if (std::string_view(r.key) != key) continue;
        const auto x = static_cast<int64_t>(v);
        if (r.hi == kAny) {
          SY_REQUIRE(x >= r.lo, InvalidArgument, "config: '{}' must be >= {}, got {}", key, r.lo,
                     x);
        } else {
          SY_REQUIRE(x >= r.lo && x <= r.hi, InvalidArgument,
                     "config: '{}' must be in [{}, {}], got {}", key, r.lo, r.hi, x);
        }
      }
    } else if constexpr (std::is_floating_point_v<T>) {
      for (const FloatRange& r : kFloatRanges) {
        if (std::string_view(r.key) != key) continue;
        const auto x = static_cast<double>(v);
        const bool ok = std::isfinite(x) && x >= r.lo && (r.open_hi ? x < r.hi : x <= r.hi);
        if (r.hi == kHuge) {
          SY_REQUIRE(ok, InvalidArgument, "config: '{}' must be a finite number >= {}, got {}", key,
                     r.lo, x);
        } else {
          SY_REQUIRE(ok, InvalidArgument,
                     "config: '{}' must be a finite number in [{}, {}{}{}, got {}", key, r.lo, r.hi,
                     r.open_hi ? ")" : "]", r.unit, x);
        }
      }
    }
  });
  // Counts of lists: each entry as a key of its own.
  for (int64_t e : config.experts_per_block) {
    SY_REQUIRE(e >= 1 && e <= (int64_t{1} << 20), InvalidArgument,
               "config: 'experts_per_block': expected counts in [1, {}], got {}", int64_t{1} << 20,
               e);
  }
  for (int64_t b : config.pipeline_split) {
    SY_REQUIRE(b >= 1 && b <= config.model.num_layers, InvalidArgument,
               "config: 'pipeline_split': every virtual stage needs >= 1 block and at most "
               "'num_layers' {}, got {}",
               config.model.num_layers, b);
  }
}

// The MoE routing a context-parallel run cannot do: drop_policy random draws each dropped
// token's fate in global token order over the whole batch, which needs every rank's tokens
// contiguous in that order; cp ranks hold interleaved (zigzag) parts of each sequence.
void CheckContextParallelRouting(const TrainConfig& c) {
  if (c.cp <= 1 || NumMoeBlocks(c.model) == 0 || c.routing_scope != "global") return;
  const moe::LayerConfig layer = MoeLayerConfig(c);
  SY_REQUIRE(layer.drop_policy != moe::DropPolicy::kRandom || layer.dropless, InvalidArgument,
             "config: 'cp' {} with drop_policy random (from {}) is not supported: random drops "
             "with 'routing_scope' global need each rank's tokens contiguous in the batch, and "
             "context parallelism interleaves them; use another drop_policy, 'routing_scope' "
             "per_rank or 'cp' 1",
             c.cp,
             c.moe_layer_config.empty() ? std::string("the MoE layer defaults")
                                        : fmt::format("'moe_layer_config' {}", c.moe_layer_config));
}

}  // namespace

void ValidateTrainConfig(const TrainConfig& c) {
  ValidateModelConfig(c.model);
  CheckRanges(c);
  if (!c.experts_per_block.empty()) {
    const int64_t blocks = NumMoeBlocks(c.model);
    SY_REQUIRE(static_cast<int64_t>(c.experts_per_block.size()) == blocks, InvalidArgument,
               "config: 'experts_per_block' has {} entries, expected one per MoE block: {} "
               "(num_layers {} / moe_every {})",
               c.experts_per_block.size(), blocks, c.model.num_layers, c.model.moe_every);
  }
  SY_REQUIRE(c.temperature > 0, InvalidArgument, "config: 'temperature' must be > 0, got {}",
             c.temperature);
  SY_REQUIRE(c.out.empty() == false, InvalidArgument, "config: 'out' must not be empty");
  SY_REQUIRE(!c.tp_comm_overlap || c.sequence_parallel, InvalidArgument,
             "config: 'tp_comm_overlap' overlaps the sequence-parallel collectives: it needs "
             "'sequence_parallel' true");
  SY_REQUIRE(c.arrangement == "auto" || c.arrangement == "deepspeed" || c.arrangement == "megatron",
             InvalidArgument,
             "config: 'arrangement' must be \"auto\", \"deepspeed\" or \"megatron\", got \"{}\"",
             c.arrangement);
  if (c.tp > 1) {
    SY_REQUIRE(c.ranks % c.tp == 0, InvalidArgument,
               "config: 'tp' {} must divide 'ranks' {} (data-parallel size ranks / tp)", c.tp,
               c.ranks);
    for (const auto& [key, v] : {std::pair<const char*, int64_t>{"num_heads", c.model.num_heads},
                                 {"hidden_dim", c.model.hidden_dim},
                                 {"vocab_size", c.model.vocab_size}}) {
      SY_REQUIRE(v % c.tp == 0, InvalidArgument,
                 "config: '{}' {} does not divide by 'tp' {} (each tensor-parallel rank holds an "
                 "equal part)",
                 key, v, c.tp);
    }
  }
  SY_REQUIRE(c.cp_algo == "ring" || c.cp_algo == "ulysses", InvalidArgument,
             "config: 'cp_algo' must be \"ring\" or \"ulysses\", got \"{}\"", c.cp_algo);
  SY_REQUIRE(
      c.attention_core == "auto" || c.attention_core == "softmax" || c.attention_core == "flash",
      InvalidArgument,
      "config: 'attention_core' must be \"auto\", \"softmax\" or \"flash\", got \"{}\"",
      c.attention_core);
  if (c.cp > 1) {
    SY_REQUIRE(c.attention_core != "softmax", InvalidArgument,
               "config: 'attention_core' softmax keeps the whole [seq_len, seq_len] "
               "probabilities on one rank, which 'cp' {} splits: use \"auto\" or \"flash\"",
               c.cp);
    SY_REQUIRE(c.model.seq_len % (2 * c.cp) == 0, InvalidArgument,
               "config: 'seq_len' {} does not split over 'cp' {} ranks: the load-balanced "
               "(zigzag) split needs a multiple of 2 x cp = {}",
               c.model.seq_len, c.cp, 2 * c.cp);
    SY_REQUIRE(c.cp_algo != "ulysses" || c.model.num_heads % (c.cp * c.tp) == 0, InvalidArgument,
               "config: 'cp_algo' ulysses splits each tensor-parallel rank's heads over the cp "
               "ranks: 'num_heads' {} does not divide by 'tp' {} x 'cp' {} = {}",
               c.model.num_heads, c.tp, c.cp, c.tp * c.cp);
  }
  SY_REQUIRE(c.model.precision == Precision::kFloat32 || (c.tp == 1 && c.cp == 1), InvalidArgument,
             "config: 'precision' bf16 is not supported with 'tp' {} / 'cp' {} yet (tensor- and "
             "context-parallel layers compute in float32): use 'precision' fp32",
             c.tp, c.cp);
  SY_REQUIRE(c.model.recompute != Recompute::kSelective || c.cp == 1, InvalidArgument,
             "config: 'recompute' selective with 'cp' {}: the context-parallel attention core "
             "already recomputes its probabilities in backward; use 'recompute' none or full",
             c.cp);
  SY_REQUIRE(c.batch_size % c.microbatches == 0, InvalidArgument,
             "config: 'batch_size' {} does not divide into 'microbatches' {} equal micro-batches",
             c.batch_size, c.microbatches);
  SY_REQUIRE(c.ranks % (c.tp * c.pp) == 0, InvalidArgument,
             "config: {} must divide 'ranks' {} (data-parallel size ranks / (tp x pp))",
             c.tp == 1   ? fmt::format("'pp' {}", c.pp)
             : c.pp == 1 ? fmt::format("'tp' {}", c.tp)
                         : fmt::format("'tp' {} x 'pp' {}", c.tp, c.pp),
             c.ranks);
  SY_REQUIRE(c.ranks % (c.tp * c.pp * c.cp) == 0, InvalidArgument,
             "config: 'cp' {} x 'tp' {} x 'pp' {} must divide 'ranks' {} (data-parallel size "
             "ranks / (tp x pp x cp))",
             c.cp, c.tp, c.pp, c.ranks);
  SY_REQUIRE(c.virtual_stages == 1 || c.pipeline_schedule == "interleaved", InvalidArgument,
             "config: 'virtual_stages' {} needs 'pipeline_schedule' interleaved (got \"{}\")",
             c.virtual_stages, c.pipeline_schedule);
  SY_REQUIRE(c.pp * c.virtual_stages <= c.model.num_layers, InvalidArgument,
             "config: 'pp' {} x 'virtual_stages' {} stages need at least as many blocks, "
             "'num_layers' is {}",
             c.pp, c.virtual_stages, c.model.num_layers);
  if (!c.pipeline_split.empty()) {
    int64_t sum = 0;
    for (int64_t b : c.pipeline_split) {
      SY_REQUIRE(b >= 1, InvalidArgument,
                 "config: 'pipeline_split': every virtual stage needs >= 1 block, got {}", b);
      sum += b;
    }
    SY_REQUIRE(static_cast<int64_t>(c.pipeline_split.size()) == c.pp * c.virtual_stages &&
                   sum == c.model.num_layers,
               InvalidArgument,
               "config: 'pipeline_split' has {} counts summing to {}: expected pp x "
               "virtual_stages = {} counts summing to num_layers {}",
               c.pipeline_split.size(), sum, c.pp * c.virtual_stages, c.model.num_layers);
  }
  SY_REQUIRE(c.nonfinite == "stop" || c.nonfinite == "skip", InvalidArgument,
             "config: 'nonfinite' must be \"stop\" or \"skip\", got \"{}\"", c.nonfinite);
  // Sizes derived from these must fit: the data counters (step * batch_size + row) and the
  // tokens of a step.
  CheckedMul(c.steps + 1, c.batch_size, "config: 'steps' x 'batch_size' (data counter)");
  CheckedMul(c.batch_size, c.model.seq_len, "config: 'batch_size' x 'seq_len' (tokens per step)");
  SY_REQUIRE(c.dispatch == "alltoall" || c.dispatch == "alltoallv" || c.dispatch == "allgather",
             InvalidArgument,
             "config: 'dispatch' must be \"alltoall\", \"alltoallv\" or \"allgather\", got \"{}\"",
             c.dispatch);
  SY_REQUIRE(c.routing_scope == "global" || c.routing_scope == "per_rank", InvalidArgument,
             "config: 'routing_scope' must be \"global\" or \"per_rank\", got \"{}\"",
             c.routing_scope);
  SY_REQUIRE(c.a2a_algo == "flat" || c.a2a_algo == "2dh", InvalidArgument,
             "config: 'a2a_algo' must be \"flat\" or \"2dh\", got \"{}\"", c.a2a_algo);
  (void)AdaptiveRAtStep(c.adaptive_r, 0);  // parses every entry
  try {
    (void)parallel::SmartGroupFromString(c.smart_schedule);
    (void)parallel::ShadowFromString(c.shadow_experts);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(
        fmt::format("config: 'smart_schedule' \"{}\" / 'shadow_experts' "
                    "\"{}\": {}",
                    c.smart_schedule, c.shadow_experts, e.what()));
  }
  // Checked whether or not a pipeline runs (pp 1), so that a misspelling never passes.
  try {
    (void)parallel::ScheduleKindFromName(c.pipeline_schedule);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("config: 'pipeline_schedule': {}", e.what()));
  }
  CheckContextParallelRouting(c);
}

namespace {

// Why `key` cannot act in the run `c` describes ("" when it can).
std::string WhyKeyCannotAct(std::string_view key, const TrainConfig& c,
                            const TrainRunContext& run) {
  if (run.dense && key == "trace_step") {
    return "it records the ranks of a distributed run: use `switchyard train --ranks 1` "
           "(train-dense has no communication layer to trace)";
  }
  if (run.dense && IsLayoutKey(key) && key != "threads" && key != "attention_core" &&
      key != "memory_budget_mib") {
    return "train-dense runs one rank without the communication layer: use `switchyard train` "
           "for a parallel layout";
  }
  if ((key == "pipeline_schedule" || key == "virtual_stages" || key == "pipeline_split") &&
      c.pp == 1) {
    return "it shapes a pipeline, and 'pp' is 1";
  }
  if (key == "pp" && c.pp > 1 && c.microbatches == 1) {
    return "with 'microbatches' 1 the stages run one after another (no pipelining): set "
           "'microbatches' to at least 'pp'";
  }
  if (key == "cp_algo" && c.cp == 1)
    return "it is the attention of context parallelism, and 'cp' is 1";
  if (key == "a2a_ranks_per_node" && c.a2a_algo != "2dh") {
    return fmt::format("it sizes the nodes of the 2dh all-to-all, and 'a2a_algo' is \"{}\"",
                       c.a2a_algo);
  }
  if (key == "moe_every" && c.model.moe_every > c.model.num_layers) {
    return fmt::format("no block of 'num_layers' {} is an MoE block (the model is dense)",
                       c.model.num_layers);
  }
  if (key == "trace_step" && c.trace_step > c.steps) {
    return fmt::format("the run ends at step {} ('steps')", c.steps);
  }
  const bool moe_exchange = key == "overlap_degree" || key == "shadow_experts" ||
                            key == "smart_schedule" || key == "a2a_algo";
  if (moe_exchange && NumMoeBlocks(c.model) == 0) return "the model has no MoE blocks";
  if (moe_exchange && (run.dense || TrainExpertParallelSize(c, static_cast<int>(c.ranks)) == 1)) {
    return "the MoE blocks exchange no tokens with an expert-parallel size of 1";
  }
  if (key == "a2a_algo" && run.ranks_are_threads && c.a2a_ranks_per_node == 0) {
    return "the ranks are threads of one process (one node), where 2dh is the flat exchange plus "
           "copies: set 'a2a_ranks_per_node' to emulate nodes";
  }
  return "";
}

}  // namespace

std::vector<std::string> ValidateTrainConfig(const ResolvedTrainConfig& resolved,
                                             const TrainRunContext& run) {
  SY_REQUIRE(!run.resume_flag_empty, InvalidArgument,
             "--resume is empty: give a checkpoint, checkpoints or run directory, or leave the "
             "flag out for a fresh run");
  const TrainConfig& c = resolved.config;
  const json mine = json::parse(TrainConfigToJson(c));
  const json defaults = json::parse(TrainConfigToJson(TrainConfig{}));
  for (const auto& [key, source] : resolved.explicit_keys) {
    if (!source.starts_with("--")) continue;  // the checkpoint's or the MoE layer file's
    const bool flag = !source.starts_with("--config ");
    const json& value = mine.at(key);
    SY_REQUIRE(!(flag && value.is_string() && value.get<std::string>().empty()), InvalidArgument,
               "{} is empty: leave the flag out for the default", source);
  }
  ValidateTrainConfig(c);
  // Ranks as threads each start their compute threads in this one process.
  SY_REQUIRE(run.dense || !run.ranks_are_threads || c.threads * c.ranks <= kMaxRanks,
             InvalidArgument,
             "config: 'threads' {} x 'ranks' {} = {} compute threads in this process: at most {}",
             c.threads, c.ranks, c.threads * c.ranks, kMaxRanks);
  std::vector<std::string> notices;
  for (const auto& [key, source] : resolved.explicit_keys) {
    if (!source.starts_with("--")) continue;
    const std::string why = WhyKeyCannotAct(key, c, run);
    if (why.empty()) continue;
    const json& value = mine.at(key);
    const bool harmless =
        value == defaults.at(key) || (run.dense && (key == "ranks" || key == "ep") && value == 1);
    SY_REQUIRE(harmless, InvalidArgument, "config: '{}' {} ({}) cannot act: {}", key, value.dump(),
               source, why);
    if (!source.starts_with("--config ")) {
      notices.push_back(
          fmt::format("note: '{}' {} ({}) has no effect: {}", key, value.dump(), source, why));
    }
  }
  return notices;
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
