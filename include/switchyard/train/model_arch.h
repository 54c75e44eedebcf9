// The architecture choices of a TransformerLm (train/model.h) that the Hugging Face families need
// (docs/models.md): each an enum spelled in config.json and on the command line by the names of
// its ChoiceTraits (config_choice.h), a row of config_keys.def's "model architecture" block.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "switchyard/train/config_choice.h"

namespace switchyard::train {

// 'position_embedding': GPT-2's learned table "pos_embed.weight" [seq_len, model_dim] added to
// the token embedding, or rotary embeddings of q and k in every block (train/rope.h).
enum class PositionEmbedding : uint8_t { kLearned, kRope };
// 'mlp': the dense MLPs (and the experts): "gelu" is the two-matrix MLP fc2(act(fc1 x)) with the
// 'activation' key (gelu by default); "swiglu" is down(silu(gate x) * up x) (train/swiglu.h).
enum class MlpKind : uint8_t { kGelu, kSwiGlu };
// 'attention_bias': biases on q, k, v and the output projection (GPT-2, the default), none, or
// on q, k and v only (Qwen2).
enum class AttentionBias : uint8_t { kAll, kNone, kQkv };
// 'arch': the family whose defaults a run starts from (ResolveTrainConfig; docs/models.md).
enum class Arch : uint8_t { kGpt, kMixtral, kQwen2Moe, kOlmoe };

template <>
struct ChoiceTraits<PositionEmbedding> {
  static constexpr std::array kValues = {PositionEmbedding::kLearned, PositionEmbedding::kRope};
  static std::string_view Name(PositionEmbedding v) {
    return v == PositionEmbedding::kLearned ? "learned" : "rope";
  }
};
template <>
struct ChoiceTraits<MlpKind> {
  static constexpr std::array kValues = {MlpKind::kGelu, MlpKind::kSwiGlu};
  static std::string_view Name(MlpKind v) { return v == MlpKind::kGelu ? "gelu" : "swiglu"; }
};
template <>
struct ChoiceTraits<AttentionBias> {
  static constexpr std::array kValues = {AttentionBias::kAll, AttentionBias::kNone,
                                         AttentionBias::kQkv};
  static std::string_view Name(AttentionBias v) {
    return v == AttentionBias::kNone ? "none" : v == AttentionBias::kQkv ? "qkv" : "all";
  }
};
template <>
struct ChoiceTraits<Arch> {
  static constexpr std::array kValues = {Arch::kGpt, Arch::kMixtral, Arch::kQwen2Moe, Arch::kOlmoe};
  static std::string_view Name(Arch v) {
    switch (v) {
      case Arch::kGpt: return "gpt";
      case Arch::kMixtral: return "mixtral";
      case Arch::kQwen2Moe: return "qwen2_moe";
      case Arch::kOlmoe: return "olmoe";
    }
    return "gpt";
  }
};

// The architecture enums that are plain fields of ModelConfig (spelled by their ChoiceTraits in
// the config's JSON forms).
template <typename T>
inline constexpr bool kIsModelChoice =
    std::is_same_v<T, PositionEmbedding> || std::is_same_v<T, MlpKind> ||
    std::is_same_v<T, AttentionBias>;

}  // namespace switchyard::train
