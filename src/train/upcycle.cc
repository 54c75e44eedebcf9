// Upcycling a dense model into an MoE model (upcycle.h, docs/models.md "Upcycling").
#include "switchyard/train/upcycle.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/moe/gate.h"
#include "switchyard/train/hf_names.h"
#include "switchyard/train/model.h"

namespace switchyard::train {
namespace {

using Json = nlohmann::json;

// The model keys (config_keys.def's SY_MODEL_KEY rows, TrainConfig::model) that a dense
// checkpoint fixes: all of them but the ones that place MoE blocks or initialize.
std::vector<std::string> DenseModelKeys() {
  std::vector<std::string> keys;
#define SY_TRAIN_KEY(...)
#define SY_MODEL_KEY(key, ...) keys.emplace_back(#key);
#include "switchyard/train/config_keys.def"
#undef SY_TRAIN_KEY
#undef SY_MODEL_KEY
  const std::set<std::string> moe_placement = {"moe_every", "mlp_only_layers",
                                               "gated_shared_expert_hidden", "init_std"};
  std::erase_if(keys, [&](const std::string& k) { return moe_placement.count(k) > 0; });
  return keys;
}

// The sum of one token's k gate values when every router logit is equal (zero router): 1 for a
// renormalizing router, k / E for softmax over all E experts without renormalization.
double UniformGateSum(moe::LayerConfig lc) {
  lc.model_dim = 1;
  const Tensor x = Tensor::Zeros({1, 1});
  const Tensor w = Tensor::Zeros({lc.num_experts, 1});
  const Tensor bias = lc.expert_bias ? Tensor::Zeros({lc.num_experts}) : Tensor();
  const moe::GateResult g = moe::GateForward(lc, x, w, bias, {.training = false});
  double sum = 0;
  for (int64_t j = 0; j < g.top_k; ++j) sum += g.gates[static_cast<size_t>(j)];
  SY_CHECK(sum > 0, "gate values at uniform logits sum to {}", sum);
  return sum;
}

// How one dense MLP tensor becomes the stacked experts' tensor.
enum class Split { kRows, kColumns, kBias };
struct ExpertSource {
  const char* dense;   // under "blocks.L.mlp."
  const char* expert;  // under "blocks.L.moe.experts."
  Split split;
};
constexpr ExpertSource kExpertSources[] = {
    {"fc1.weight", "fc1.weight", Split::kRows},           // gelu MLP
    {"fc1.bias", "fc1.bias", Split::kRows},               //
    {"fc2.weight", "fc2.weight", Split::kColumns},        //
    {"fc2.bias", "fc2.bias", Split::kBias},               //
    {"gate_proj.weight", "fc1.weight", Split::kRows},     // SwiGLU MLP
    {"gate_proj.bias", "fc1.bias", Split::kRows},         //
    {"up_proj.weight", "fc3.weight", Split::kRows},       //
    {"down_proj.weight", "fc2.weight", Split::kColumns},  //
    {"down_proj.bias", "fc2.bias", Split::kBias},
};

// Fills the stacked `dst` ([E, Ie, ...] rows, [E, M, Ie] columns, [E, M] bias) from the dense
// `src` ([I, ...], [M, I], [M]): expert j takes chunk j % G; `scale` multiplies it.
void FillExperts(const std::string& name, const Tensor& src, Tensor& dst, Split split,
                 int64_t granularity, float scale) {
  const int64_t e_num = dst.size(0);
  const Shape& s = src.shape();
  Shape want;
  if (split == Split::kRows) {
    want = s;
    want[0] = s[0] / granularity;
  } else if (split == Split::kColumns) {
    want = {s[0], s[1] / granularity};
  } else {
    want = s;
  }
  want.insert(want.begin(), e_num);
  SY_REQUIRE(dst.shape() == want, InvalidArgument,
             "{}: the dense tensor {} split in {} gives experts of shape {}, the MoE model has {}",
             name, ShapeToString(s), granularity, ShapeToString(want), ShapeToString(dst.shape()));
  const int64_t per_expert = dst.numel() / e_num;
  for (int64_t j = 0; j < e_num; ++j) {
    const int64_t g = j % granularity;
    float* out = dst.data<float>() + j * per_expert;
    const float* in = src.data<float>();
    if (split == Split::kRows) {
      const int64_t row = src.numel() / s[0];
      const int64_t rows = s[0] / granularity;
      std::copy_n(in + g * rows * row, rows * row, out);
    } else if (split == Split::kColumns) {
      const int64_t cols = s[1] / granularity;
      for (int64_t m = 0; m < s[0]; ++m) {
        for (int64_t c = 0; c < cols; ++c) out[m * cols + c] = in[m * s[1] + g * cols + c] * scale;
      }
      continue;
    } else {
      std::copy_n(in, per_expert, out);
    }
    for (int64_t i = 0; i < per_expert; ++i) out[i] *= scale;
  }
}

// Turns the dense MLP of MoE block `block` into its experts and sets its router; marks the dense
// tensors it used.
void UpcycleBlock(const TensorMap& dense, TensorMap& out, const TrainConfig& config, int64_t block,
                  const UpcycleOptions& options, std::set<std::string>& used) {
  const std::string mlp = fmt::format("blocks.{}.mlp.", block);
  const std::string moe = fmt::format("blocks.{}.moe.", block);
  const moe::LayerConfig lc = MoeBlockLayerConfig(config, block);
  const int64_t granularity = config.model.hidden_dim / lc.hidden_dim;
  const double gate_sum = UniformGateSum(lc);
  std::set<std::string> filled;
  for (const ExpertSource& e : kExpertSources) {
    auto it = dense.find(mlp + e.dense);
    if (it == dense.end()) continue;
    const std::string target = moe + "experts." + e.expert;
    auto dst = out.find(target);
    SY_REQUIRE(dst != out.end(), InvalidArgument,
               "upcycling: the dense tensor '{}' has no place in the MoE model (no '{}')",
               it->first, target);
    const float scale = e.split == Split::kColumns ? static_cast<float>(granularity / gate_sum)
                        : e.split == Split::kBias  ? static_cast<float>(1.0 / gate_sum)
                                                   : 1.0f;
    Tensor t = dst->second.Clone();
    FillExperts(it->first, it->second.To(DType::kFloat32), t, e.split, granularity, scale);
    dst->second = t;
    used.insert(it->first);
    filled.insert(target);
  }
  // The router: Megatron's group rows (experts [rG, rG + G) share fresh row r), or zero.
  const std::string gate = moe + "gate.weight";
  auto router = out.find(gate);
  SY_CHECK(router != out.end(), "MoE block {} has no router '{}'", block, gate);
  Tensor w = Tensor::Zeros(router->second.shape());
  if (!options.zero_router) {
    const Tensor fresh = router->second.To(DType::kFloat32);
    const int64_t row = w.size(1);
    for (int64_t j = 0; j < w.size(0); ++j) {
      std::copy_n(fresh.data<float>() + (j / granularity) * row, row, w.data<float>() + j * row);
    }
  }
  router->second = w;
  for (const auto& [name, t] : out) {
    if (!name.starts_with(moe)) continue;
    const std::string rest = name.substr(moe.size());
    if (rest == "gate.weight" || rest == "gate.expert_bias") continue;
    SY_REQUIRE(filled.count(name) > 0, InvalidArgument,
               "upcycling: the MoE model's tensor '{}' {} has no dense source (upcycling makes "
               "routed experts from the dense MLP; leave out shared experts, residual MLPs and "
               "MLP biases without an expert counterpart)",
               name, ShapeToString(t.shape()));
  }
}

}  // namespace

UpcycleSource ReadUpcycleSource(const std::string& path) {
  UpcycleSource s;
  if (hf::IsHfDirectory(path)) {
    const hf::ModelConfig c = hf::ReadModelConfig(path);
    Json keys = Json::parse(hf::DenseTrainKeysJson(c, path + "/config.json"));
    keys["gated_shared_expert_hidden"] = 0;
    s.keys_json = keys.dump();
    s.arch = c.family == hf::Family::kQwen2 ? "qwen2_moe" : "mixtral";
    return s;
  }
  const Json all = Json::parse(ReadCheckpointConfigJson(hf::ResolveModelPath(path)));
  const int64_t moe_every = all.value("moe_every", int64_t{0});
  SY_REQUIRE(moe_every == 0, InvalidArgument,
             "--upcycle-from {}: key 'moe_every': the checkpoint is already an MoE model "
             "(moe_every {}); upcycling takes a dense model (moe_every 0, e.g. a train-dense run)",
             path, moe_every);
  Json keys = Json::object();
  for (const std::string& key : DenseModelKeys()) {
    if (all.contains(key)) keys[key] = all.at(key);
  }
  keys["gated_shared_expert_hidden"] = 0;
  s.keys_json = keys.dump();
  return s;
}

void CheckUpcycleConfig(const TrainConfig& config) {
  SY_REQUIRE(config.model.moe_every > 0, InvalidArgument,
             "--upcycle-from: key 'moe_every': 0 makes a dense model; set moe_every > 0 for the "
             "MoE blocks the dense MLPs become");
  const int64_t hidden = config.model.hidden_dim;
  for (int64_t b = 0; b < config.model.num_layers; ++b) {
    if (!IsMoeBlock(config.model, b)) continue;
    const int64_t expert_hidden = config.expert_hidden_dim > 0 ? config.expert_hidden_dim : hidden;
    SY_REQUIRE(hidden % expert_hidden == 0, InvalidArgument,
               "--upcycle-from: key 'expert_hidden_dim': {} must divide the dense hidden_dim {} "
               "(granular upcycling splits the dense MLP into hidden_dim / expert_hidden_dim "
               "experts' worth)",
               expert_hidden, hidden);
    const int64_t granularity = hidden / expert_hidden;
    const int64_t experts = BlockExperts(config, b);
    SY_REQUIRE(experts % granularity == 0, InvalidArgument,
               "--upcycle-from: key 'num_experts': block {} has {} experts, which the granularity "
               "hidden_dim / expert_hidden_dim = {} / {} = {} must divide",
               b, experts, hidden, expert_hidden, granularity);
  }
}

TensorMap UpcycleWeights(const TensorMap& dense, TensorMap initial, const TrainConfig& config,
                         const UpcycleOptions& options) {
  CheckUpcycleConfig(config);
  TensorMap out = std::move(initial);
  std::set<std::string> used;
  std::vector<std::string> moe_prefixes;
  for (int64_t b = 0; b < config.model.num_layers; ++b) {
    if (!IsMoeBlock(config.model, b)) continue;
    UpcycleBlock(dense, out, config, b, options, used);
    moe_prefixes.push_back(fmt::format("blocks.{}.moe.", b));
  }
  for (const auto& [name, t] : dense) {
    if (used.count(name) > 0) continue;
    auto it = out.find(name);
    SY_REQUIRE(it != out.end(), InvalidArgument,
               "upcycling: the dense tensor '{}' {} has no place in the MoE model", name,
               ShapeToString(t.shape()));
    SY_REQUIRE(it->second.shape() == t.shape(), InvalidArgument,
               "upcycling: tensor '{}': the dense model has shape {}, the MoE model {}", name,
               ShapeToString(t.shape()), ShapeToString(it->second.shape()));
    it->second = t.To(DType::kFloat32);
    used.insert(name);
  }
  for (const auto& [name, t] : out) {
    const bool in_moe = std::any_of(moe_prefixes.begin(), moe_prefixes.end(),
                                    [&](const std::string& p) { return name.starts_with(p); });
    SY_REQUIRE(in_moe || dense.count(name) > 0, InvalidArgument,
               "upcycling: the MoE model's tensor '{}' {} is not in the dense model", name,
               ShapeToString(t.shape()));
  }
  return out;
}

TensorMap ReadUpcycleWeights(const std::string& path) {
  if (hf::IsHfDirectory(path)) {
    return hf::ReadSwitchyardTensors(hf::CheckpointReader(path), hf::ReadModelConfig(path));
  }
  return LoadCheckpoint(path).model;
}

}  // namespace switchyard::train
