// The table between Hugging Face's parameter names and switchyard's, and the conversions on it.
#include "switchyard/train/hf_names.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/train/checkpoint.h"

namespace switchyard::train::hf {
namespace {

using Json = nlohmann::json;

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// The switchyard name of a non-expert Hugging Face tensor of layer-local name `rest` (after
// "model.layers.L.").
std::string LayerName(int64_t layer, std::string_view rest) {
  const std::string b = fmt::format("blocks.{}.", layer);
  if (rest == "input_layernorm.weight") return b + "norm1.weight";
  if (rest == "post_attention_layernorm.weight") return b + "norm2.weight";
  if (StartsWith(rest, "self_attn.")) return b + "attn." + std::string(rest.substr(10));
  if (rest == "block_sparse_moe.gate.weight" || rest == "mlp.gate.weight") {
    return b + "moe.gate.weight";
  }
  if (StartsWith(rest, "mlp.shared_expert")) return b + "moe." + std::string(rest.substr(4));
  if (StartsWith(rest, "mlp.")) return b + std::string(rest);
  SY_CHECK(false, "no switchyard name for Hugging Face tensor '{}'", rest);
  return {};
}

const char* StackedExpertName(ExpertMatrix m) {
  switch (m) {
    case ExpertMatrix::kGate: return "fc1.weight";
    case ExpertMatrix::kUp: return "fc3.weight";
    case ExpertMatrix::kDown: return "fc2.weight";
  }
  return "";
}

// The expert mappings of MoE layer `layer`, keyed by Hugging Face name.
void AddExperts(const ModelConfig& c, int64_t layer, std::map<std::string, NameMapping>& out) {
  for (int64_t e = 0; e < c.num_experts; ++e) {
    for (ExpertMatrix m : {ExpertMatrix::kGate, ExpertMatrix::kUp, ExpertMatrix::kDown}) {
      NameMapping n;
      n.hf_name = ExpertTensorName(c, layer, e, m);
      n.sy_name = fmt::format("blocks.{}.moe.experts.{}", layer, StackedExpertName(m));
      n.expert = e;
      n.num_experts = c.num_experts;
      out[n.hf_name] = n;
    }
  }
}

}  // namespace

std::vector<NameMapping> NameTable(const ModelConfig& config) {
  std::map<std::string, NameMapping> experts;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsMoeLayer(l)) AddExperts(config, l, experts);
  }
  std::vector<NameMapping> table;
  for (const TensorSpec& spec : ParameterTable(config)) {
    NameMapping n;
    auto it = experts.find(spec.name);
    if (it != experts.end()) {
      n = it->second;
    } else if (spec.name == "model.embed_tokens.weight") {
      n.sy_name = "embed.weight";
    } else if (spec.name == "model.norm.weight") {
      n.sy_name = "final_norm.weight";
    } else if (spec.name == "lm_head.weight") {
      n.sy_name = "head.weight";
    } else {
      const std::string_view name = spec.name;
      SY_CHECK(StartsWith(name, "model.layers."), "unexpected tensor '{}'", spec.name);
      const std::string_view rest = name.substr(13);
      const size_t dot = rest.find('.');
      const int64_t layer = std::stoll(std::string(rest.substr(0, dot)));
      n.sy_name = LayerName(layer, rest.substr(dot + 1));
    }
    n.hf_name = spec.name;
    n.shape = spec.shape;
    table.push_back(std::move(n));
  }
  return table;
}

namespace {

// The keys of the model's shape and components every family shares (no router, no experts).
Json ShapeKeys(const ModelConfig& c, const std::string& what) {
  SY_REQUIRE(c.head_dim * c.num_attention_heads == c.hidden_size, InvalidArgument,
             "{}: key 'head_dim': {} is not hidden_size / num_attention_heads = {} / {}; "
             "switchyard's model has head_dim = model_dim / num_heads",
             what, c.head_dim, c.hidden_size, c.num_attention_heads);
  return {{"vocab_size", c.vocab_size},
          {"model_dim", c.hidden_size},
          {"num_layers", c.num_hidden_layers},
          {"num_heads", c.num_attention_heads},
          {"num_kv_heads", c.num_key_value_heads},
          {"hidden_dim", c.intermediate_size},
          {"norm", "rmsnorm"},
          {"norm_eps", c.rms_norm_eps},
          {"position_embedding", "rope"},
          {"rope_theta", c.rope_theta},
          {"attention_bias", c.qkv_bias ? "qkv" : "none"},
          {"qk_norm", c.qk_norm},
          {"mlp", "swiglu"},
          {"mlp_bias", false},
          {"tied_head", c.tie_word_embeddings}};
}

}  // namespace

std::string TrainKeysJson(const ModelConfig& c, const std::string& what) {
  SY_REQUIRE(c.is_moe(), InvalidArgument,
             "{}: key 'model_type': {} is a dense family; eval, export and --init-from take "
             "the MoE families (mixtral, qwen2_moe, olmoe); --upcycle-from takes it",
             what, FamilyName(c.family));
  const int64_t expert_hidden =
      c.family == Family::kQwen2Moe ? c.moe_intermediate_size : c.intermediate_size;
  Json j = ShapeKeys(c, what);
  j.update({{"arch", std::string(FamilyName(c.family))},
            {"expert_hidden_dim", expert_hidden},
            {"num_experts", c.num_experts},
            {"top_k", c.num_experts_per_tok},
            {"moe_every", c.decoder_sparse_step},
            {"mlp_only_layers", c.mlp_only_layers},
            {"gated_shared_expert_hidden", c.shared_expert_intermediate_size},
            {"hf_router", true},
            {"norm_topk_prob", c.family == Family::kMixtral || c.norm_topk_prob},
            {"capacity_factor", 0.0},
            {"aux_loss_coef", c.router_aux_loss_coef},
            {"pad_token_id", c.pad_token_id.value_or(-1)}});
  return j.dump();
}

std::string DenseTrainKeysJson(const ModelConfig& c, const std::string& what) {
  SY_REQUIRE(!c.is_moe(), InvalidArgument,
             "{}: key 'model_type': {} is already an MoE family; upcycling takes a dense model "
             "(llama, qwen2)",
             what, FamilyName(c.family));
  return ShapeKeys(c, what).dump();
}

TensorMap ReadSwitchyardTensors(const CheckpointReader& reader, const ModelConfig& config) {
  reader.Validate(config);
  TensorMap out;
  for (const NameMapping& n : NameTable(config)) {
    Tensor t = reader.ReadFloat32(n.hf_name, n.shape);
    if (n.expert < 0) {
      out[n.sy_name] = t;
      continue;
    }
    Tensor& stacked = out[n.sy_name];
    if (!stacked.defined()) {
      Shape shape = {n.num_experts};
      shape.insert(shape.end(), n.shape.begin(), n.shape.end());
      stacked = Tensor::Zeros(shape);
    }
    stacked.Slice(n.expert, n.expert + 1).Reshape(n.shape).CopyFrom(t);
  }
  return out;
}

namespace {

// The box `b` of the full switchyard tensor `sy_name`, read from the directory.
Tensor ReadPart(const CheckpointReader& reader, const std::vector<const NameMapping*>& hf,
                const std::string& sy_name, const CheckpointLayout::Box& b) {
  if (hf.empty()) return reader.ReadBox(sy_name, b.begin, b.end);  // switchyard's own names
  if (hf[0]->expert < 0) return reader.ReadBox(hf[0]->hf_name, b.begin, b.end);
  // Stacked experts: rows [begin[0], end[0]) are Hugging Face tensors of their own.
  Shape shape(b.begin.size());
  for (size_t d = 0; d < shape.size(); ++d) shape[d] = b.end[d] - b.begin[d];
  Tensor out = Tensor::Empty(shape);
  const std::vector<int64_t> begin(b.begin.begin() + 1, b.begin.end());
  const std::vector<int64_t> end(b.end.begin() + 1, b.end.end());
  for (int64_t e = b.begin[0]; e < b.end[0]; ++e) {
    SY_CHECK(e < static_cast<int64_t>(hf.size()) && hf[static_cast<size_t>(e)]->expert == e,
             "expert {} of '{}' not in the name table", e, sy_name);
    const Tensor t = reader.ReadBox(hf[static_cast<size_t>(e)]->hf_name, begin, end);
    out.Slice(e - b.begin[0], e - b.begin[0] + 1).Reshape(t.shape()).CopyFrom(t);
  }
  return out;
}

}  // namespace

void LoadRankWeights(const CheckpointReader& reader, const ModelConfig* config,
                     ParameterSet& params, const CheckpointLayout& layout) {
  std::map<std::string, std::vector<const NameMapping*>> by_sy_name;
  std::vector<NameMapping> table;
  if (config != nullptr) {
    reader.Validate(*config);
    table = NameTable(*config);
    for (const NameMapping& n : table) by_sy_name[n.sy_name].push_back(&n);
  }
  for (Parameter& p : params.all()) {
    const std::optional<CheckpointLayout::Part> part = layout.PartOf(p);
    const auto it = by_sy_name.find(p.name);
    SY_REQUIRE(config == nullptr || it != by_sy_name.end(), InvalidArgument,
               "{}: the model's parameter '{}' has no Hugging Face tensor", reader.dir(), p.name);
    const std::vector<const NameMapping*> hf =
        config != nullptr ? it->second : std::vector<const NameMapping*>{};
    if (config == nullptr) {
      const Shape want = part ? part->full_shape : reader.ShapeOf(p.name);
      SY_REQUIRE(reader.ShapeOf(p.name) == want, InvalidArgument,
                 "{}/{}: tensor '{}': expected shape {} for this model, got {}", reader.dir(),
                 reader.FileOf(p.name), p.name, ShapeToString(want),
                 ShapeToString(reader.ShapeOf(p.name)));
    }
    if (!part) {  // not a box: the full tensor, sliced as a checkpoint is
      Tensor full;
      if (config == nullptr) {
        full = reader.ReadFloat32(p.name, reader.ShapeOf(p.name));
      } else {
        const std::vector<int64_t> zero(hf[0]->shape.size() + (hf[0]->expert >= 0 ? 1 : 0), 0);
        std::vector<int64_t> end = {static_cast<int64_t>(hf.size())};
        if (hf[0]->expert < 0) end.clear();
        end.insert(end.end(), hf[0]->shape.begin(), hf[0]->shape.end());
        full = ReadPart(reader, hf, p.name, {zero, end});
      }
      TensorMap one = {{p.name, full}};
      layout.Slice(params, one, {""});
      p.value.CopyFrom(one.at(p.name));
      continue;
    }
    int64_t offset = 0;
    Tensor flat = p.value.Reshape({p.value.numel()});
    for (const CheckpointLayout::Box& b : part->boxes) {
      const Tensor t = ReadPart(reader, hf, p.name, b);
      SY_CHECK(offset + t.numel() <= flat.numel(), "parameter '{}': parts exceed {}", p.name,
               p.value.ToString());
      flat.Slice(offset, offset + t.numel()).CopyFrom(t.Reshape({t.numel()}));
      offset += t.numel();
    }
    SY_CHECK(offset == flat.numel(), "parameter '{}': parts fill {} of {}", p.name, offset,
             flat.numel());
  }
}

void ForEachHfTensor(const ModelConfig& config,
                     const std::function<Tensor(const std::string& sy_name)>& lookup,
                     const std::function<void(const std::string& hf_name, const Tensor&)>& emit) {
  for (const NameMapping& n : NameTable(config)) {
    Tensor full = lookup(n.sy_name);
    Shape want = n.shape;
    if (n.expert >= 0) want.insert(want.begin(), n.num_experts);
    SY_REQUIRE(full.defined() && full.shape() == want, InvalidArgument,
               "tensor '{}' (Hugging Face '{}'): expected shape {}, got {}", n.sy_name, n.hf_name,
               ShapeToString(want), full.defined() ? ShapeToString(full.shape()) : "none");
    if (n.expert < 0) {
      emit(n.hf_name, full);
    } else {
      emit(n.hf_name, full.Slice(n.expert, n.expert + 1).Reshape(n.shape).Clone());
    }
  }
}

ModelConfig ModelConfigFromTrain(const TrainConfig& t, const std::string& what) {
  Family family = Family::kMixtral;
  const Arch arch = t.arch;
  switch (arch) {
    case Arch::kMixtral: family = Family::kMixtral; break;
    case Arch::kQwen2Moe: family = Family::kQwen2Moe; break;
    case Arch::kOlmoe: family = Family::kOlmoe; break;
    case Arch::kGpt:
      throw InvalidArgument(fmt::format(
          "{}: key 'arch': gpt has no Hugging Face family here; expected mixtral, qwen2_moe or "
          "olmoe",
          what));
  }
  ModelConfig c =
      ParseModelConfig(fmt::format(R"({{"model_type": "{}"}})", FamilyName(family)), what);
  c.vocab_size = t.model.vocab_size;
  c.hidden_size = t.model.model_dim;
  c.num_hidden_layers = t.model.num_layers;
  c.num_attention_heads = t.model.num_heads;
  c.num_key_value_heads = t.model.num_kv_heads > 0 ? t.model.num_kv_heads : t.model.num_heads;
  c.head_dim = t.model.model_dim / t.model.num_heads;
  c.max_position_embeddings = std::max<int64_t>(c.max_position_embeddings, t.model.seq_len);
  c.rope_theta = t.model.rope_theta;
  c.rms_norm_eps = t.model.norm_eps;
  c.initializer_range = t.model.init_std;
  c.tie_word_embeddings = t.model.tied_head;
  c.qkv_bias = t.model.attention_bias == AttentionBias::kQkv;
  c.qk_norm = t.model.qk_norm;
  c.num_experts = t.num_experts;
  c.num_experts_per_tok = t.top_k;
  const int64_t expert_hidden = t.expert_hidden_dim > 0 ? t.expert_hidden_dim : t.model.hidden_dim;
  c.intermediate_size = family == Family::kQwen2Moe ? t.model.hidden_dim : expert_hidden;
  c.moe_intermediate_size = expert_hidden;
  // Qwen2-MoE's gated shared expert and dense layers; the other families have neither, and the
  // key-by-key comparison below refuses a run that has them.
  if (family == Family::kQwen2Moe) {
    c.shared_expert_intermediate_size = t.model.gated_shared_expert_hidden;
    c.mlp_only_layers = t.model.mlp_only_layers;
    c.decoder_sparse_step = std::max<int64_t>(t.model.moe_every, 1);
  }
  c.norm_topk_prob = t.norm_topk_prob;
  c.router_aux_loss_coef = t.aux_loss_coef;
  c.pad_token_id.reset();
  if (t.model.pad_token_id >= 0) c.pad_token_id = t.model.pad_token_id;
  c.bos_token_id.reset();
  c.eos_token_id.reset();
  // Every key the conversion back gives must be the run's.
  const Json mine = Json::parse(TrainConfigToJson(t));
  const Json back = Json::parse(TrainKeysJson(c, what));
  for (const auto& [key, value] : back.items()) {
    if (key == "hidden_dim" && family != Family::kQwen2Moe) continue;  // no dense layers
    if (key == "expert_hidden_dim" && t.expert_hidden_dim == 0) continue;
    if (key == "num_kv_heads" && t.model.num_kv_heads == 0) continue;
    const Json& have = mine.at(key);
    const bool same = have.is_number() && value.is_number()
                          ? have.get<double>() == value.get<double>()
                          : have == value;
    SY_REQUIRE(same, InvalidArgument, "{}: key '{}': {} has no {} equivalent; a {} model has {}",
               what, key, have.dump(), FamilyArchitecture(family), FamilyName(family),
               value.dump());
  }
  return c;
}

bool IsHfDirectory(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir(path);
  return fs::exists(dir / "config.json", ec) && !fs::exists(dir / "state.json", ec) &&
         (fs::exists(dir / kSingleFile, ec) || fs::exists(dir / kIndexFile, ec));
}

std::string ResolveModelPath(const std::string& path) {
  if (IsHfDirectory(path)) return path;
  try {
    return ResolveCheckpoint(path);
  } catch (const IoError& e) {
    throw IoError(
        fmt::format("{}; or a Hugging Face model directory (config.json beside {} or "
                    "{})",
                    e.what(), kSingleFile, kIndexFile));
  }
}

std::string InitFromModelKeysJson(const std::string& path) {
  if (IsHfDirectory(path)) {
    return TrainKeysJson(ReadModelConfig(path), path + "/config.json");
  }
  const Json all = Json::parse(ReadCheckpointConfigJson(ResolveModelPath(path)));
  Json keys = Json::object();
  for (const auto& [key, value] : all.items()) {
    const ConfigKeyInfo* info = FindConfigKey(key);
    if (info != nullptr && info->category == KeyCategory::kModel) keys[key] = value;
  }
  return keys.dump();
}

TensorMap ReadInitFromWeights(const std::string& path) {
  if (IsHfDirectory(path))
    return ReadSwitchyardTensors(CheckpointReader(path), ReadModelConfig(path));
  return LoadCheckpoint(path).model;
}

}  // namespace switchyard::train::hf
