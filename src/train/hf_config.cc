// config.json of the Hugging Face families: defaults, strict reading, writing, parameter tables.
#include "switchyard/train/hf_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/json.h"

namespace switchyard::train::hf {
namespace {

using Json = nlohmann::json;

struct FamilyInfo {
  Family family;
  std::string_view model_type;
  std::string_view architecture;
};
constexpr std::array<FamilyInfo, 5> kFamilies = {{
    {Family::kMixtral, "mixtral", "MixtralForCausalLM"},
    {Family::kQwen2Moe, "qwen2_moe", "Qwen2MoeForCausalLM"},
    {Family::kOlmoe, "olmoe", "OlmoeForCausalLM"},
    {Family::kLlama, "llama", "LlamaForCausalLM"},
    {Family::kQwen2, "qwen2", "Qwen2ForCausalLM"},
}};

// The defaults of the families' PretrainedConfig classes (what a key left out of config.json
// means to Hugging Face).
ModelConfig Defaults(Family f) {
  ModelConfig c;
  c.family = f;
  c.architectures = {std::string(FamilyArchitecture(f))};
  switch (f) {
    case Family::kMixtral:
      c.vocab_size = 32000, c.hidden_size = 4096, c.intermediate_size = 14336;
      c.num_hidden_layers = 32, c.num_attention_heads = 32, c.num_key_value_heads = 8;
      c.max_position_embeddings = 4096 * 32, c.rms_norm_eps = 1e-5, c.rope_theta = 1e6;
      c.num_experts = 8, c.num_experts_per_tok = 2, c.norm_topk_prob = true;
      c.router_aux_loss_coef = 0.001, c.bos_token_id = 1, c.eos_token_id = 2;
      break;
    case Family::kQwen2Moe:
      c.vocab_size = 151936, c.hidden_size = 2048, c.intermediate_size = 5632;
      c.num_hidden_layers = 24, c.num_attention_heads = 16, c.num_key_value_heads = 16;
      c.max_position_embeddings = 32768, c.rms_norm_eps = 1e-6, c.rope_theta = 10000;
      c.qkv_bias = true, c.num_experts = 60, c.num_experts_per_tok = 4;
      c.moe_intermediate_size = 1408, c.shared_expert_intermediate_size = 5632;
      c.router_aux_loss_coef = 0.001;
      break;
    case Family::kOlmoe:
      c.vocab_size = 50304, c.hidden_size = 2048, c.intermediate_size = 2048;
      c.num_hidden_layers = 16, c.num_attention_heads = 16, c.num_key_value_heads = 0;
      c.max_position_embeddings = 4096, c.rms_norm_eps = 1e-5, c.rope_theta = 10000;
      c.qk_norm = true, c.num_experts = 64, c.num_experts_per_tok = 8;
      c.router_aux_loss_coef = 0.01, c.pad_token_id = 1, c.eos_token_id = 50279;
      break;
    case Family::kLlama:
      c.vocab_size = 32000, c.hidden_size = 4096, c.intermediate_size = 11008;
      c.num_hidden_layers = 32, c.num_attention_heads = 32, c.num_key_value_heads = 0;
      c.max_position_embeddings = 2048, c.rms_norm_eps = 1e-6, c.rope_theta = 10000;
      c.bos_token_id = 1, c.eos_token_id = 2;
      break;
    case Family::kQwen2:
      c.vocab_size = 151936, c.hidden_size = 4096, c.intermediate_size = 22016;
      c.num_hidden_layers = 32, c.num_attention_heads = 32, c.num_key_value_heads = 32;
      c.max_position_embeddings = 32768, c.rms_norm_eps = 1e-6, c.rope_theta = 10000;
      c.qkv_bias = true;
      break;
  }
  return c;
}

// Reads keys of one config.json, each with the file and key in its errors.
class Reader {
 public:
  Reader(const Json& j, std::string_view what) : j_(j), what_(what) {}

  // The value of `key`, or null when it is absent or JSON null.
  const Json* Get(std::string_view key) const {
    auto it = j_.find(std::string(key));
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  [[noreturn]] void Fail(std::string_view key, const std::string& message) const {
    throw InvalidArgument(fmt::format("{}: key '{}': {}", what_, key, message));
  }
  void Int(std::string_view key, int64_t min, int64_t* out) const {
    const Json* v = Get(key);
    if (v == nullptr) return;
    if (!v->is_number_integer()) Fail(key, fmt::format("expected an integer, got {}", v->dump()));
    const int64_t x = v->get<int64_t>();
    if (x < min || x > (int64_t{1} << 40)) {
      Fail(key, fmt::format("expected an integer in [{}, 2^40], got {}", min, x));
    }
    *out = x;
  }
  void OptionalInt(std::string_view key, std::optional<int64_t>* out) const {
    auto it = j_.find(std::string(key));
    if (it == j_.end()) return;
    if (it->is_null()) {
      out->reset();
      return;
    }
    int64_t x = 0;
    Int(key, 0, &x);
    *out = x;
  }
  void Double(std::string_view key, double min, bool exclusive, double* out) const {
    const Json* v = Get(key);
    if (v == nullptr) return;
    if (!v->is_number()) Fail(key, fmt::format("expected a number, got {}", v->dump()));
    const double x = v->get<double>();
    if (exclusive ? !(x > min) : !(x >= min)) {
      Fail(key, fmt::format("expected a number {} {}, got {}", exclusive ? ">" : ">=", min, x));
    }
    *out = x;
  }
  void Bool(std::string_view key, bool* out) const {
    const Json* v = Get(key);
    if (v == nullptr) return;
    if (!v->is_boolean()) Fail(key, fmt::format("expected true or false, got {}", v->dump()));
    *out = v->get<bool>();
  }
  // A key whose non-default value asks for what switchyard does not compute.
  void Unsupported(std::string_view key, bool set, std::string_view feature) const {
    if (set) {
      Fail(key, fmt::format("{} is not supported by switchyard (docs/models.md, \"Not supported\")",
                            feature));
    }
  }
  bool IsTrue(std::string_view key) const {
    const Json* v = Get(key);
    return v != nullptr && v->is_boolean() && v->get<bool>();
  }
  bool NonZero(std::string_view key) const {
    const Json* v = Get(key);
    return v != nullptr && (!v->is_number() || v->get<double>() != 0.0);
  }

 private:
  const Json& j_;
  std::string_view what_;
};

Family ParseFamily(const Json& j, std::string_view what) {
  auto it = j.find("model_type");
  SY_REQUIRE(
      it != j.end() && it->is_string(), InvalidArgument,
      "{}: key 'model_type': expected one of mixtral, qwen2_moe, olmoe, llama, qwen2, got {}", what,
      it == j.end() ? "no such key" : it->dump());
  const std::string& name = it->get_ref<const std::string&>();
  for (const FamilyInfo& f : kFamilies) {
    if (f.model_type == name) return f.family;
  }
  std::string hint;
  if (name.rfind("deepseek", 0) == 0)
    hint = " (DeepSeek's multi-head latent attention is not supported)";
  throw InvalidArgument(fmt::format(
      "{}: key 'model_type': unknown family '{}'{}: expected one of mixtral, qwen2_moe, olmoe, "
      "llama, qwen2",
      what, name, hint));
}

void ReadKeys(const Reader& r, ModelConfig& c) {
  const bool qwen = c.family == Family::kQwen2Moe || c.family == Family::kQwen2;
  r.Int("vocab_size", 1, &c.vocab_size);
  r.Int("hidden_size", 1, &c.hidden_size);
  r.Int("intermediate_size", 1, &c.intermediate_size);
  r.Int("num_hidden_layers", 1, &c.num_hidden_layers);
  r.Int("num_attention_heads", 1, &c.num_attention_heads);
  r.Int("num_key_value_heads", 1, &c.num_key_value_heads);
  r.Int("head_dim", 1, &c.head_dim);
  r.Int("max_position_embeddings", 1, &c.max_position_embeddings);
  r.Double("rope_theta", 0, true, &c.rope_theta);
  r.Double("rms_norm_eps", 0, true, &c.rms_norm_eps);
  r.Double("initializer_range", 0, false, &c.initializer_range);
  r.Bool("tie_word_embeddings", &c.tie_word_embeddings);
  if (qwen) r.Bool("qkv_bias", &c.qkv_bias);
  r.OptionalInt("pad_token_id", &c.pad_token_id);
  r.OptionalInt("bos_token_id", &c.bos_token_id);
  r.OptionalInt("eos_token_id", &c.eos_token_id);
  if (c.is_moe()) {
    r.Int(c.family == Family::kMixtral ? "num_local_experts" : "num_experts", 1, &c.num_experts);
    r.Int("num_experts_per_tok", 1, &c.num_experts_per_tok);
    r.Double("router_aux_loss_coef", 0, false, &c.router_aux_loss_coef);
    r.Bool("output_router_logits", &c.output_router_logits);
    if (c.family != Family::kMixtral) r.Bool("norm_topk_prob", &c.norm_topk_prob);
  }
  if (c.family == Family::kQwen2Moe) {
    r.Int("moe_intermediate_size", 1, &c.moe_intermediate_size);
    r.Int("shared_expert_intermediate_size", 0, &c.shared_expert_intermediate_size);
    r.Int("decoder_sparse_step", 1, &c.decoder_sparse_step);
    if (const Json* v = r.Get("mlp_only_layers")) {
      if (!v->is_array()) r.Fail("mlp_only_layers", "expected a list of layer indices");
      for (const Json& e : *v) {
        if (!e.is_number_integer() || e.get<int64_t>() < 0) {
          r.Fail("mlp_only_layers", fmt::format("expected layer indices >= 0, got {}", e.dump()));
        }
        c.mlp_only_layers.push_back(e.get<int64_t>());
      }
    }
  } else {
    c.moe_intermediate_size = c.is_moe() ? c.intermediate_size : 0;
  }
  // What the families can ask for that switchyard does not compute.
  if (const Json* act = r.Get("hidden_act")) {
    r.Unsupported("hidden_act", !act->is_string() || act->get<std::string>() != "silu",
                  fmt::format("activation {} (only silu)", act->dump()));
  }
  r.Unsupported("rope_scaling", r.Get("rope_scaling") != nullptr, "rope_scaling");
  r.Unsupported("attention_dropout", r.NonZero("attention_dropout"), "attention dropout");
  if (c.family == Family::kMixtral) {
    r.Unsupported("sliding_window", r.Get("sliding_window") != nullptr, "sliding-window attention");
    r.Unsupported("router_jitter_noise", r.NonZero("router_jitter_noise"), "router jitter noise");
  }
  if (qwen) {
    r.Unsupported("use_sliding_window", r.IsTrue("use_sliding_window"), "sliding-window attention");
  }
  if (c.family == Family::kOlmoe) {
    r.Unsupported("clip_qkv", r.Get("clip_qkv") != nullptr, "clip_qkv");
  }
  if (c.family == Family::kOlmoe || c.family == Family::kLlama) {
    r.Unsupported("attention_bias", r.IsTrue("attention_bias"), "attention_bias (o_proj bias)");
  }
  if (c.family == Family::kLlama) r.Unsupported("mlp_bias", r.IsTrue("mlp_bias"), "mlp_bias");
}

void Validate(const Reader& r, ModelConfig& c) {
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    r.Fail("num_key_value_heads", fmt::format("{} must divide num_attention_heads = {}",
                                              c.num_key_value_heads, c.num_attention_heads));
  }
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_attention_heads != 0) {
      r.Fail("num_attention_heads",
             fmt::format("{} must divide hidden_size = {} (or give head_dim)",
                         c.num_attention_heads, c.hidden_size));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) r.Fail("head_dim", fmt::format("{} must be even (RoPE)", c.head_dim));
  if (c.is_moe() && c.num_experts_per_tok > c.num_experts) {
    r.Fail("num_experts_per_tok", fmt::format("{} must be at most the number of experts {}",
                                              c.num_experts_per_tok, c.num_experts));
  }
  for (int64_t l : c.mlp_only_layers) {
    if (l >= c.num_hidden_layers) {
      r.Fail("mlp_only_layers", fmt::format("layer {} does not exist (num_hidden_layers = {})", l,
                                            c.num_hidden_layers));
    }
  }
  if (c.pad_token_id && *c.pad_token_id >= c.vocab_size) {
    r.Fail("pad_token_id",
           fmt::format("{} must be below vocab_size = {}", *c.pad_token_id, c.vocab_size));
  }
}

}  // namespace

std::string_view FamilyName(Family family) {
  return kFamilies[static_cast<size_t>(family)].model_type;
}
std::string_view FamilyArchitecture(Family family) {
  return kFamilies[static_cast<size_t>(family)].architecture;
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (!is_moe()) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

ModelConfig ParseModelConfig(std::string_view json_text, std::string_view what) {
  Json j = ParseJsonStrict(json_text, what);
  SY_REQUIRE(j.is_object(), InvalidArgument, "{}: expected a JSON object", what);
  ModelConfig c = Defaults(ParseFamily(j, what));
  Reader r(j, what);
  if (const Json* a = r.Get("architectures")) {
    if (!a->is_array()) r.Fail("architectures", "expected a list of class names");
    c.architectures.clear();
    for (const Json& e : *a) {
      if (!e.is_string()) r.Fail("architectures", fmt::format("expected names, got {}", e.dump()));
      c.architectures.push_back(e.get<std::string>());
    }
  }
  ReadKeys(r, c);
  Validate(r, c);
  return c;
}

ModelConfig ReadModelConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  return ParseModelConfig(ReadTextFile(path), path);
}

std::string ModelConfigToJson(const ModelConfig& c) {
  Json j = Json::object();
  j["architectures"] = c.architectures;
  j["model_type"] = std::string(FamilyName(c.family));
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rope_theta"] = c.rope_theta;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["initializer_range"] = c.initializer_range;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["rope_scaling"] = nullptr;
  j["attention_dropout"] = 0.0;
  auto opt = [](const std::optional<int64_t>& v) { return v ? Json(*v) : Json(nullptr); };
  j["pad_token_id"] = opt(c.pad_token_id);
  j["bos_token_id"] = opt(c.bos_token_id);
  j["eos_token_id"] = opt(c.eos_token_id);
  if (c.family == Family::kQwen2Moe || c.family == Family::kQwen2) {
    j["qkv_bias"] = c.qkv_bias;
    j["use_sliding_window"] = false;
  }
  if (c.family == Family::kOlmoe || c.family == Family::kLlama) j["attention_bias"] = false;
  if (c.family == Family::kOlmoe) j["clip_qkv"] = nullptr;
  if (c.family == Family::kLlama) j["mlp_bias"] = false;
  if (c.is_moe()) {
    j[c.family == Family::kMixtral ? "num_local_experts" : "num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    j["output_router_logits"] = c.output_router_logits;
    if (c.family != Family::kMixtral) j["norm_topk_prob"] = c.norm_topk_prob;
  }
  if (c.family == Family::kMixtral) {
    j["sliding_window"] = nullptr;
    j["router_jitter_noise"] = 0.0;
  }
  if (c.family == Family::kQwen2Moe) {
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

std::string ExpertTensorName(const ModelConfig& c, int64_t layer, int64_t expert,
                             ExpertMatrix matrix) {
  static constexpr std::array<std::string_view, 3> kMixtral = {"w1", "w3", "w2"};
  static constexpr std::array<std::string_view, 3> kOthers = {"gate_proj", "up_proj", "down_proj"};
  const auto m = static_cast<size_t>(matrix);
  if (c.family == Family::kMixtral) {
    return fmt::format("model.layers.{}.block_sparse_moe.experts.{}.{}.weight", layer, expert,
                       kMixtral[m]);
  }
  return fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", layer, expert, kOthers[m]);
}

std::string RouterTensorName(const ModelConfig& c, int64_t layer) {
  return fmt::format("model.layers.{}.{}.gate.weight", layer,
                     c.family == Family::kMixtral ? "block_sparse_moe" : "mlp");
}

std::vector<TensorSpec> ParameterTable(const ModelConfig& c) {
  std::vector<TensorSpec> t;
  const int64_t m = c.hidden_size, qd = c.num_attention_heads * c.head_dim;
  const int64_t kvd = c.num_key_value_heads * c.head_dim;
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, m}});
  auto mlp = [&](const std::string& p, int64_t inter) {
    t.push_back({p + "gate_proj.weight", {inter, m}});
    t.push_back({p + "up_proj.weight", {inter, m}});
    t.push_back({p + "down_proj.weight", {m, inter}});
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    t.push_back({p + "input_layernorm.weight", {m}});
    for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
      const int64_t rows = proj[0] == 'q' ? qd : kvd;
      t.push_back({p + "self_attn." + proj + ".weight", {rows, m}});
      if (c.qkv_bias) t.push_back({p + "self_attn." + proj + ".bias", {rows}});
    }
    t.push_back({p + "self_attn.o_proj.weight", {m, qd}});
    if (c.qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {qd}});
      t.push_back({p + "self_attn.k_norm.weight", {kvd}});
    }
    t.push_back({p + "post_attention_layernorm.weight", {m}});
    if (!c.IsMoeLayer(l)) {
      mlp(p + "mlp.", c.intermediate_size);
      continue;
    }
    t.push_back({RouterTensorName(c, l), {c.num_experts, m}});
    const int64_t inter = c.moe_intermediate_size;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      t.push_back({ExpertTensorName(c, l, e, ExpertMatrix::kGate), {inter, m}});
      t.push_back({ExpertTensorName(c, l, e, ExpertMatrix::kUp), {inter, m}});
      t.push_back({ExpertTensorName(c, l, e, ExpertMatrix::kDown), {m, inter}});
    }
    if (c.family == Family::kQwen2Moe && c.shared_expert_intermediate_size > 0) {
      mlp(p + "mlp.shared_expert.", c.shared_expert_intermediate_size);
      t.push_back({p + "mlp.shared_expert_gate.weight", {1, m}});
    }
  }
  t.push_back({"model.norm.weight", {m}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {c.vocab_size, m}});
  return t;
}

}  // namespace switchyard::train::hf
