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
        // A value the field cannot hold would be truncated silently (threads is an int).
        const int64_t x =
            v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX ? INT64_MAX : v.get<int64_t>();
        if (x < std::numeric_limits<T>::min() || x > std::numeric_limits<T>::max()) {
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
    value = std::string(text);
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

void ValidateTrainConfig(const TrainConfig& c) {
  ValidateModelConfig(c.model);
  auto at_least = [](const char* key, double v, double lo) {
    SY_REQUIRE(v >= lo && std::isfinite(v), InvalidArgument, "config: '{}' must be >= {}, got {}",
               key, lo, v);
  };
  at_least("steps", static_cast<double>(c.steps), 0);
  at_least("batch_size", static_cast<double>(c.batch_size), 1);
  at_least("lr", c.lr, 0);
  at_least("min_lr", c.min_lr, 0);
  at_least("warmup_steps", static_cast<double>(c.warmup_steps), 0);
  at_least("weight_decay", c.weight_decay, 0);
  at_least("grad_clip", c.grad_clip, 0);
  at_least("bucket_mb", c.bucket_mb, 0);
  at_least("log_every", static_cast<double>(c.log_every), 1);
  at_least("eval_every", static_cast<double>(c.eval_every), 0);
  at_least("eval_tokens", static_cast<double>(c.eval_tokens), 0);
  at_least("checkpoint_every", static_cast<double>(c.checkpoint_every), 0);
  at_least("keep_checkpoints", static_cast<double>(c.keep_checkpoints), 0);
  at_least("sample_tokens", static_cast<double>(c.sample_tokens), 0);
  at_least("threads", c.threads, 0);
  at_least("num_experts", static_cast<double>(c.num_experts), 1);
  if (!c.experts_per_block.empty()) {
    const int64_t blocks = NumMoeBlocks(c.model);
    SY_REQUIRE(static_cast<int64_t>(c.experts_per_block.size()) == blocks, InvalidArgument,
               "config: 'experts_per_block' has {} entries, expected one per MoE block: {} "
               "(num_layers {} / moe_every {})",
               c.experts_per_block.size(), blocks, c.model.num_layers, c.model.moe_every);
    for (int64_t e : c.experts_per_block) {
      SY_REQUIRE(e >= 1, InvalidArgument,
                 "config: 'experts_per_block': expected counts >= 1, got {}", e);
    }
  }
  at_least("top_k", static_cast<double>(c.top_k), 1);
  at_least("expert_hidden_dim", static_cast<double>(c.expert_hidden_dim), 0);
  at_least("aux_loss_coef", c.aux_loss_coef, 0);
  at_least("z_loss_coef", c.z_loss_coef, 0);
  SY_REQUIRE(c.temperature > 0, InvalidArgument, "config: 'temperature' must be > 0, got {}",
             c.temperature);
  SY_REQUIRE(c.out.empty() == false, InvalidArgument, "config: 'out' must not be empty");
  at_least("ranks", static_cast<double>(c.ranks), 1);
  at_least("ep", static_cast<double>(c.ep), 0);
  at_least("overlap_degree", static_cast<double>(c.overlap_degree), 1);
  at_least("tp", static_cast<double>(c.tp), 1);
  at_least("etp", static_cast<double>(c.etp), 1);
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
  at_least("microbatches", static_cast<double>(c.microbatches), 1);
  at_least("cp", static_cast<double>(c.cp), 1);
  SY_REQUIRE(c.cp_algo == "ring" || c.cp_algo == "ulysses", InvalidArgument,
             "config: 'cp_algo' must be \"ring\" or \"ulysses\", got \"{}\"", c.cp_algo);
  SY_REQUIRE(
      c.attention_core == "auto" || c.attention_core == "softmax" || c.attention_core == "flash",
      InvalidArgument,
      "config: 'attention_core' must be \"auto\", \"softmax\" or \"flash\", got \"{}\"",
      c.attention_core);
  SY_REQUIRE(std::isfinite(c.memory_budget_mib) && c.memory_budget_mib >= 0, InvalidArgument,
             "config: 'memory_budget_mib' must be a number >= 0 (0: no budget), got {}",
             c.memory_budget_mib);
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
  at_least("pp", static_cast<double>(c.pp), 1);
  at_least("virtual_stages", static_cast<double>(c.virtual_stages), 1);
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
  SY_REQUIRE(c.zero_stage >= 0 && c.zero_stage <= 3, InvalidArgument,
             "config: 'zero_stage' must be 0, 1, 2 or 3, got {}", c.zero_stage);
  SY_REQUIRE(c.nonfinite == "stop" || c.nonfinite == "skip", InvalidArgument,
             "config: 'nonfinite' must be \"stop\" or \"skip\", got \"{}\"", c.nonfinite);
  SY_REQUIRE(c.val_fraction >= 0 && c.val_fraction <= 0.5, InvalidArgument,
             "config: 'val_fraction' must be in [0, 0.5], got {}", c.val_fraction);
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
  at_least("a2a_ranks_per_node", static_cast<double>(c.a2a_ranks_per_node), 0);
  at_least("trace_step", static_cast<double>(c.trace_step), 0);
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
