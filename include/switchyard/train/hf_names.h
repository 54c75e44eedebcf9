// The Hugging Face exchange, part 3: the one table between Hugging Face's parameter names and
// switchyard's (docs/models.md, "Exchange"), and the conversions built on it.
//
// Every Hugging Face tensor of a family (ParameterTable, hf_config.h) is one switchyard parameter
// or one expert's slice of one: the routed experts of MoE layer L are stacked by global expert id
// in "blocks.L.moe.experts.fc{1,3,2}.weight" [E, I, M] / [E, M, I] (gate -> fc1, up -> fc3,
// down -> fc2), so Hugging Face's experts.J.* is row J. The rest is a rename:
//   model.embed_tokens.weight                 embed.weight
//   model.layers.L.input_layernorm.weight     blocks.L.norm1.weight
//   model.layers.L.self_attn.X                blocks.L.attn.X   (q/k/v/o_proj.*, q_norm, k_norm)
//   model.layers.L.post_attention_layernorm   blocks.L.norm2.weight
//   model.layers.L.mlp.{gate,up,down}_proj.*  blocks.L.mlp.{gate,up,down}_proj.*  (dense layers)
//   model.layers.L.{block_sparse_moe,mlp}.gate.weight   blocks.L.moe.gate.weight
//   model.layers.L.mlp.shared_expert.*        blocks.L.moe.shared_expert.*        (Qwen2-MoE)
//   model.layers.L.mlp.shared_expert_gate.weight  blocks.L.moe.shared_expert_gate.weight
//   model.norm.weight                         final_norm.weight
//   lm_head.weight                            head.weight   (absent when tie_word_embeddings)
//
// TrainKeysJson gives the switchyard config keys of a Hugging Face config (the model's shape and
// components); what the model cannot compute yet is refused there, naming the key.
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/train/checkpoint_layout.h"
#include "switchyard/train/config.h"
#include "switchyard/train/hf_checkpoint.h"
#include "switchyard/train/hf_config.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train::hf {

// One Hugging Face tensor and where it lives in switchyard's model.
struct NameMapping {
  std::string hf_name;  // "model.layers.0.block_sparse_moe.experts.3.w1.weight"
  std::string sy_name;  // "blocks.0.moe.experts.fc1.weight"
  Shape shape;          // the Hugging Face tensor's shape
  // >= 0: the tensor is row `expert` (global expert id) of the stacked sy_name [E, ...];
  // -1: sy_name is the tensor itself.
  int64_t expert = -1;
  int64_t num_experts = 0;  // E of the stacked tensor (expert >= 0)
};

// The table for `config`, in ParameterTable's order.
std::vector<NameMapping> NameTable(const ModelConfig& config);

// The switchyard config keys (TrainConfigFromJson's JSON object) of the model `config`
// describes: arch, vocab_size, model_dim, num_layers, num_heads, num_kv_heads, hidden_dim,
// expert_hidden_dim, num_experts, top_k, moe_every, norm, norm_eps, position_embedding,
// rope_theta, attention_bias, qk_norm, mlp, mlp_bias, tied_head, hf_router, norm_topk_prob,
// capacity_factor (0: dropless), aux_loss_coef, pad_token_id (-1 when
// the config has none). seq_len is the caller's. InvalidArgument naming
// `what` and the key for what the model does not build: a head_dim other than
// hidden_size / num_attention_heads, Qwen2-MoE's gated shared expert and dense layers among
// MoE layers (mlp_only_layers / decoder_sparse_step), and the dense families (upcycling's).
std::string TrainKeysJson(const ModelConfig& config, const std::string& what);

// The switchyard keys of a dense family's model (llama, qwen2; upcycling's source): the shape
// and component keys of TrainKeysJson, without arch, router and expert keys. InvalidArgument
// naming `what` for an MoE family or a head_dim TrainKeysJson refuses.
std::string DenseTrainKeysJson(const ModelConfig& config, const std::string& what);

// The Hugging Face config of a switchyard run's model (export): the family is the run's `arch`
// (mixtral, qwen2_moe, olmoe); sizes, norms, RoPE, biases, router and coefficient from its keys.
// InvalidArgument naming `what` and the first key whose value a Hugging Face model of that
// family cannot have (TrainKeysJson of the result must give the run's values back): e.g. a
// LayerNorm model, learned positions, biases on the experts, a capacity factor (not dropless).
ModelConfig ModelConfigFromTrain(const TrainConfig& config, const std::string& what);

// The switchyard tensors (full, layout-independent: a checkpoint's `model` map) of the Hugging
// Face directory `reader` opened, read tensor by tensor and converted to float32; experts are
// stacked by global id. Validates the directory against `config` first.
TensorMap ReadSwitchyardTensors(const CheckpointReader& reader, const ModelConfig& config);

// Fills this rank's parameters (values, in place) from the model directory `reader` opened,
// reading only the part of each tensor the rank holds (CheckpointLayout::PartOf): a
// tensor-parallel row shard is one contiguous read, a column shard one read per row, an expert
// of another rank is not read at all (Hugging Face stores each expert as its own tensor), an
// expert's H-shard reads its rows (gate, up) or its columns (down). `config` given: a Hugging
// Face directory (its names through the table; validated against the config first); null:
// switchyard's own model.safetensors (switchyard names, experts stacked [E, ...]).
// InvalidArgument naming the directory and the tensor when one is missing or has another shape.
void LoadRankWeights(const CheckpointReader& reader, const ModelConfig* config,
                     ParameterSet& params, const CheckpointLayout& layout);

// Calls `emit(hf_name, tensor)` for every tensor of the table, in order, taking each from
// `lookup(sy_name)` (a full switchyard tensor; an expert's row is copied out of it).
// InvalidArgument naming the tensor when lookup's shape is not the table's.
void ForEachHfTensor(const ModelConfig& config,
                     const std::function<Tensor(const std::string& sy_name)>& lookup,
                     const std::function<void(const std::string& hf_name, const Tensor&)>& emit);

// `train --init-from PATH`: PATH is a Hugging Face directory (config.json beside model.safetensors
// or its index, no state.json) or a switchyard checkpoint (a checkpoint, checkpoints or run
// directory, ResolveCheckpoint). IsHfDirectory tells which.
bool IsHfDirectory(const std::string& path);
// PATH as --init-from, --upcycle-from and `eval --model` take it: a Hugging Face directory as it
// is, else the checkpoint ResolveCheckpoint finds. A path that is neither is an IoError naming
// every form these flags accept (ResolveCheckpoint's own error names only switchyard's).
std::string ResolveModelPath(const std::string& path);
// The model keys PATH fixes (a JSON object of TrainConfig keys): TrainKeysJson of its config.json,
// or every model-category key of the checkpoint's config.
std::string InitFromModelKeysJson(const std::string& path);
// PATH's weights as full switchyard tensors (a checkpoint's `model` map): ReadSwitchyardTensors
// of the directory, or the checkpoint's model.safetensors (verified by LoadCheckpoint).
TensorMap ReadInitFromWeights(const std::string& path);

}  // namespace switchyard::train::hf
