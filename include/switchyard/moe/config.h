// Options of one MoE layer (docs/moe.md). Keys of layer.json are the field names below.
// Defaults follow Tutel; `preset` = "deepspeed" switches every convention to DeepSpeed's at once
// (see PresetConfig). docs/moe.md lists every key with its meaning.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "switchyard/kernels/ops.h"

namespace switchyard::moe {

enum class ScoreFunction : uint8_t {
  kSoftmax,          // softmax over all E, then top-k (GShard/Tutel/DeepSpeed)
  kSigmoid,          // sigmoid per expert, then top-k (DeepSeek-V3 / Megatron-Core)
  kSoftmaxAfterTopK  // top-k on logits, softmax over the k chosen (Mixtral / Megatron-Core)
};
enum class NoiseKind : uint8_t {
  kNone,
  kTutelNormal,  // logits += noise_std * N(0,1) / E
  kJitter,       // gate input *= U(1 - eps, 1 + eps) elementwise
  kGumbelSecond  // choices 2..k = top-(k-1) of (logits + Gumbel) with the 1st masked out
};
enum class CapacityFormula : uint8_t {
  kTutel,     // C = k * floor(cf * ceil(T / E)) (cf > 0); cf <= 0: docs/moe.md
  kDeepSpeed  // C = ceil(T / E * cf * k) in float32, then min_capacity
};
enum class DropPolicy : uint8_t {
  kPosition,  // the first C in slot order survive
  kProbs,     // the C with the highest scores survive
  kRandom     // random priority per token (keyed by global token index)
};
enum class SlotOrder : uint8_t {
  kChoiceMajor,  // all 1st choices in token order, then all 2nd choices, ... (GShard/Tutel)
  kTokenOrder    // token by token over all k choices together (DeepSpeed k > 2)
};
enum class AuxLoss : uint8_t {
  kGShard,            // E * sum_e m_e * c_e, c_e from 1st choices
  kGShardAllChoices,  // E / k * sum_e m_e * c_e, c_e from all k choices (DeepSpeed k > 2)
  kImportanceLoad,    // (cv^2(importance) + cv^2(load)) / 2 (Shazeer 2017, as Tutel computes it)
  kNone,
  // Megatron-Core's seq_aux_loss (DeepSeek-V3's sequence-wise loss): per sequence of
  // sequence_length rows, E / (k S^2) * sum_e P_e * N_e, averaged over the sequences
  kSequence,
  // Megatron-Core's global_aux_loss: E / (k T^2) * sum_e P_e * Nbar_e over the micro-batch's
  // tokens on every rank, Nbar the running mean of the counts over the step's micro-batches
  // (ForwardOptions::aux_counts_so_far, losses.h)
  kGlobal,
  // Hugging Face's load_balancing_loss_func: E * sum_e f_e * P_e over the router rows of every
  // MoE layer of a forward concatenated (f_e: the top k of P counted per expert, / N). A layer
  // alone computes its own rows' value; the caller gives Backward the concatenation's sums
  // (layer.h, router_load_loss.h).
  kHfConcat
};

struct LayerConfig {
  // ---- sizes ----
  int64_t model_dim = 0;    // M
  int64_t hidden_dim = 0;   // H
  int64_t num_experts = 0;  // E (global)
  int64_t top_k = 2;        // k; k > E is clamped to E (see EffectiveTopK)

  // ---- gate ----
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool normalize_gate = true;  // g_j /= max(sum_j g_j, eps) (k > 1)
  // Group-limited routing (DeepSeek-V3, Megatron-Core moe_router_num_groups/group_topk): experts
  // in num_groups contiguous groups; only the group_topk best groups (a group scores the sum of
  // its top top_k / group_topk selection values) are eligible. group_topk = 0: off.
  int64_t num_groups = 1;
  int64_t group_topk = 0;
  float topk_scaling_factor = 1.0f;  // g_j *= factor after normalization (DeepSeek-V3)
  // Noise and random routing apply to training calls only (ForwardOptions::training, layer.h).
  NoiseKind noise = NoiseKind::kNone;
  float noise_std = 1.0f;       // kTutelNormal (and the sigma of the importance_load loss)
  float jitter_eps = 1e-2f;     // kJitter
  bool random_routing = false;  // GShard: keep 2nd choice only if 2 * g_2 > U(0,1)
  bool expert_bias = false;     // aux-loss-free balancing (DeepSeek-V3): bias for choice only
  float expert_bias_update_rate = 1e-3f;

  // ---- capacity and slots ----
  float capacity_factor = 1.0f;  // > 0, == 0 (no drops), < 0 (capped)
  int64_t min_capacity = 0;
  int64_t alignment = 1;            // capacity rounded up to a multiple
  std::optional<int64_t> capacity;  // explicit capacity overrides every formula
  CapacityFormula capacity_formula = CapacityFormula::kTutel;
  DropPolicy drop_policy = DropPolicy::kPosition;
  SlotOrder slot_order = SlotOrder::kChoiceMajor;
  bool batch_prioritized_routing = false;
  bool renormalize_after_drop = false;  // DeepSpeed: renormalize surviving gate values (k > 1)
  bool dropless = false;                // MegaBlocks/Megatron: no capacity, grouped GEMM

  // ---- dispatch / combine ----
  bool prescore = false;  // scale tokens by g before dispatch (combine is a plain sum)

  // ---- experts ----
  kernels::Activation activation = kernels::Activation::kGelu;
  bool gated = false;  // SwiGLU-style: act(x W1^T) * (x W3^T), needs experts.fc3.weight
  bool fc_bias = true;

  // ---- losses ----
  AuxLoss aux_loss = AuxLoss::kGShard;
  float aux_loss_coef = 0.01f;
  float z_loss_coef = 0.0f;
  // aux_loss sequence: rows are batch-major, sequence_length consecutive global token indices per
  // sequence (0: unset; required by aux_loss sequence).
  int64_t sequence_length = 0;

  // ---- variants (docs/moe.md; moe/variants.h) ----
  bool residual_moe = false;         // PR-MoE: out = moe * c0 + mlp * c1
  int64_t shared_expert_hidden = 0;  // > 0: DeepSeek shared expert MLP of that hidden size

  // ---- misc ----
  uint64_t seed = 0;             // keys every random draw (with the global token index)
  bool check_finite = false;     // reject NaN/Inf in inputs
  std::string preset = "tutel";  // "tutel" | "deepspeed"
};

// k actually used: min(top_k, num_experts) (k > E is clamped to E).
inline int64_t EffectiveTopK(const LayerConfig& config) {
  return config.top_k < config.num_experts ? config.top_k : config.num_experts;
}

// True when group-limited routing is on (group_topk > 0).
inline bool GroupLimited(const LayerConfig& config) { return config.group_topk > 0; }

// Checks the options against each other; throws InvalidArgument naming the field and what was
// expected (e.g. "top_k: expected >= 1, got 0").
void ValidateConfig(const LayerConfig& config);

// The defaults of a preset for a given top_k (DeepSpeed's conventions depend on k):
//   "tutel":     the LayerConfig defaults above.
//   "deepspeed": capacity_formula deepspeed, min_capacity 4, renormalize_after_drop;
//                k = 1: drop_policy random (DeepSpeed's random token selection);
//                k = 2: choice-major slots, drop by position;
//                k > 2: drop_policy probs, slot_order token_order, aux_loss gshard_all_choices.
// Throws InvalidArgument for another name.
LayerConfig PresetConfig(std::string_view preset, int64_t top_k);

// Parses layer.json. The preset (key "preset", default "tutel") supplies the defaults and every
// other key overrides them. An unknown key, a value of the wrong type or out of range, or an
// unknown enum name throws InvalidArgument with one line naming the key and what was expected,
// e.g. "layer.json: key 'top_k': expected an integer >= 1, got 0". The result is validated
// (ValidateConfig), so model_dim, hidden_dim and num_experts are required. The key "training" is
// refused (it belongs to the call; LayerFileFromJson reads it).
LayerConfig LayerConfigFromJson(std::string_view json_text);

// A layer file as a program that runs single calls reads it (the `layer` command): the layer's
// options and, optionally, "training": true | false, the mode of the calls made with it (not a
// layer option: see ForwardOptions::training in layer.h). LayerConfigFromJson refuses that key.
struct LayerFile {
  LayerConfig config;
  std::optional<bool> training;  // the file's "training" key, if it has one
};
LayerFile LayerFileFromJson(std::string_view json_text);

// The configuration as a JSON object with every key (enums by name), parseable by
// LayerConfigFromJson; with `training` given, the object also has that key (a LayerFile).
std::string ToJson(const LayerConfig& config, std::optional<bool> training = std::nullopt);

// Names used in layer.json for the enums.
std::string_view ScoreFunctionName(ScoreFunction v);
std::string_view NoiseKindName(NoiseKind v);
std::string_view CapacityFormulaName(CapacityFormula v);
std::string_view DropPolicyName(DropPolicy v);
std::string_view SlotOrderName(SlotOrder v);
std::string_view AuxLossName(AuxLoss v);

}  // namespace switchyard::moe
