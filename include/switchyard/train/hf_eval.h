// The Hugging Face exchange, part 4: what `switchyard eval` computes (docs/models.md, "eval").
//
// A Hugging Face MoE model's weights (ReadSwitchyardTensors, hf_names.h) are loaded into
// switchyard's TransformerLm, built from the config's keys (TrainKeysJson), and one batch of
// tokens runs through it as the ForCausalLM classes run it with labels = input_ids:
//   logits [B, T, V]; ce_loss = mean cross-entropy of each token predicting the next
//   (B * (T - 1) tokens); aux_loss = Hugging Face's load-balancing loss over the router logits of
//   ALL MoE layers concatenated (moe/router_load_loss.h); loss = ce_loss + coef * aux_loss.
// With grads, d loss / d parameter for every parameter, by switchyard name (full tensors).
//
// The family's aux loss is computed by wrapping each MoE block: its router logits x · Wg^T are
// recomputed from the block's input, their sums added over the layers, and in backward
// coef * d aux / d logits flows into the input and the router weight (the MoE layer's own
// load-balancing loss is switched off, aux_loss_coef 0).
//
// One rank (the model's layers over one-rank groups).
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>

#include "switchyard/core/safetensors.h"
#include "switchyard/core/tensor.h"
#include "switchyard/train/config.h"

namespace switchyard::train::hf {

struct EvalResult {
  Tensor logits;  // [B, T, V] float32
  double ce_loss = 0;
  double aux_loss = 0;
  double loss = 0;
  TensorMap grads;  // switchyard name -> d loss / d value (with grads only)
};

// `config`: the switchyard keys of the model (TrainKeysJson; seq_len >= T); `weights`: every
// parameter by switchyard name (full tensors); `tokens` int32 [B, T] in [0, vocab_size), T >= 2;
// `aux_coef`: router_aux_loss_coef. InvalidArgument naming the tokens for a bad shape or id.
EvalResult EvaluateModel(const TrainConfig& config, const TensorMap& weights, const Tensor& tokens,
                         double aux_coef, bool grads, int threads = 1);

}  // namespace switchyard::train::hf
