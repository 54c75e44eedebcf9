// The Hugging Face model format, part 1: a model directory's config.json for the families
// switchyard exchanges (docs/models.md): the MoE families Mixtral (`mixtral`), Qwen2-MoE
// (`qwen2_moe`) and OLMoE (`olmoe`), and the dense Llama (`llama`) and Qwen2 (`qwen2`) that
// upcycling starts from. HfModelConfig holds every key Hugging Face's modeling code of those
// families reads; a key left out of config.json takes the family's default (the defaults of the
// family's PretrainedConfig class). The parameter names and shapes of each family are
// HfParameterTable.
//
// Errors name the file and the key: an unknown `model_type` (and what is accepted), a value of
// the wrong type or range, num_key_value_heads not dividing num_attention_heads, and a feature the
// families have that switchyard does not compute (sliding-window attention, rope_scaling,
// clip_qkv, router jitter, an activation other than silu, Llama's attention_bias / mlp_bias) are
// InvalidArgument. Keys not read (transformers_version, torch_dtype, use_cache, ...) are ignored,
// as Hugging Face ignores them.
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/tensor.h"

namespace switchyard::train::hf {

enum class Family : uint8_t { kMixtral, kQwen2Moe, kOlmoe, kLlama, kQwen2 };

// "mixtral", "qwen2_moe", "olmoe", "llama", "qwen2" (config.json's model_type).
std::string_view FamilyName(Family family);
// The class Hugging Face instantiates ("MixtralForCausalLM", ...): config.json's architectures.
std::string_view FamilyArchitecture(Family family);

struct ModelConfig {
  Family family = Family::kMixtral;
  std::vector<std::string> architectures;  // as read (defaults to {FamilyArchitecture})

  // ---- shapes ----
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // M
  int64_t intermediate_size = 0;  // dense MLP (Mixtral, OLMoE: each expert's) hidden size
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // divides num_attention_heads
  int64_t head_dim = 0;             // hidden_size / num_attention_heads unless given
  int64_t max_position_embeddings = 0;

  // ---- numerics ----
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // biases on q/k/v projections (Qwen2, Qwen2-MoE)
  bool qk_norm = false;   // RMSNorm over the projected q and k (OLMoE)

  // ---- MoE (num_experts = 0 for the dense families) ----
  int64_t num_experts = 0;                      // num_local_experts (Mixtral) / num_experts
  int64_t num_experts_per_tok = 0;              // k
  int64_t moe_intermediate_size = 0;            // each routed expert's hidden size
  int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE's sigmoid-gated shared expert (0: none)
  bool norm_topk_prob = false;      // renormalize the k gate values (Mixtral: always true)
  double router_aux_loss_coef = 0;  // weight of the load-balancing loss in `loss`
  bool output_router_logits = false;
  int64_t decoder_sparse_step = 1;       // Qwen2-MoE: layer i is MoE when (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and i is not listed here

  // ---- tokens ----
  std::optional<int64_t> pad_token_id;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> eos_token_id;

  bool is_moe() const { return num_experts > 0; }
  // Whether decoder layer `layer` has the sparse MoE block (else the dense SwiGLU MLP).
  bool IsMoeLayer(int64_t layer) const;
};

// Parses config.json's text; `what` names the file in errors ("DIR/config.json").
ModelConfig ParseModelConfig(std::string_view json_text, std::string_view what);
// Reads DIR/config.json (IoError if it cannot be read).
ModelConfig ReadModelConfig(const std::string& dir);
// config.json for `config`: architectures, model_type and every key ParseModelConfig reads
// (ParseModelConfig(ModelConfigToJson(c)) == c), 2-space indented as save_pretrained writes.
std::string ModelConfigToJson(const ModelConfig& config);

// One tensor of a family's checkpoint.
struct TensorSpec {
  std::string name;  // Hugging Face's state_dict name ("model.layers.0.self_attn.q_proj.weight")
  Shape shape;
};

// Every parameter of the model in Hugging Face's names and shapes, in model order (embedding,
// then per layer: input_layernorm, self_attn.{q,k,v}_proj (+ bias), o_proj, q_norm/k_norm,
// post_attention_layernorm, the MLP or MoE block; model.norm, lm_head unless tied). lm_head is
// absent when tie_word_embeddings.
std::vector<TensorSpec> ParameterTable(const ModelConfig& config);

// The three matrices of one SwiGLU expert: gate (switchyard's fc1) [I, M], up (fc3) [I, M],
// down (fc2) [M, I].
enum class ExpertMatrix : uint8_t { kGate, kUp, kDown };
// The name of routed expert `expert`'s matrix in MoE layer `layer`:
//   mixtral    model.layers.L.block_sparse_moe.experts.J.{w1,w3,w2}.weight
//   qwen2_moe, olmoe  model.layers.L.mlp.experts.J.{gate,up,down}_proj.weight
std::string ExpertTensorName(const ModelConfig& config, int64_t layer, int64_t expert,
                             ExpertMatrix matrix);
// The router's weight [E, M] of MoE layer `layer` (block_sparse_moe.gate.weight / mlp.gate.weight).
std::string RouterTensorName(const ModelConfig& config, int64_t layer);

}  // namespace switchyard::train::hf
