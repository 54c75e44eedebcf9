// The Hugging Face exchange, part 4: what `switchyard eval` computes (docs/models.md, "eval").
//
// A Hugging Face MoE model's weights are loaded into switchyard's TransformerLm, built from the
// config's keys (TrainKeysJson) in any layout train accepts (tp, sequence parallelism, cp, pp,
// ep / etp, dp; ranks as the world's members), and one batch of tokens runs through it as the
// ForCausalLM classes run it with labels = input_ids:
//   logits [B, T, V]; ce_loss = mean cross-entropy of each token predicting the next
//   (B * (T - 1) tokens: HF ignores only labels of -100, so a label equal to pad_token_id
//   counts); aux_loss = Hugging Face's load-balancing loss over the router logits of ALL MoE
//   layers concatenated (moe/router_load_loss.h); loss = ce_loss + coef * aux_loss.
// With grads, d loss / d parameter for every parameter, by switchyard name (full tensors:
// tensor-parallel shards gathered, experts by global id, every pipeline stage's).
//
// The family's aux loss is computed by wrapping each MoE block: its router logits x · Wg^T are
// recomputed from the block's input and their sums added over the layers and the ranks' tokens;
// in backward coef * d aux / d logits flows into the input and the router weight (the MoE layer's
// own load-balancing loss is switched off, aux_loss_coef 0). The gradient of one layer's logits
// depends on the sums of every layer and rank, so with grads a forward first gathers the sums,
// and a second forward + backward uses them.
//
// Thread-safety: reentrant; EvaluateOnRank is collective over its world.
#pragma once

#include <cstdint>
#include <functional>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/core/tensor.h"
#include "switchyard/train/checkpoint_layout.h"
#include "switchyard/train/config.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train::hf {

struct EvalResult {
  Tensor logits;  // [B, T, V] float32
  double ce_loss = 0;
  double aux_loss = 0;
  double loss = 0;
  TensorMap grads;  // switchyard name -> d loss / d value (with grads only; full tensors)
};

struct EvalOptions {
  double aux_coef = 0;  // router_aux_loss_coef
  bool grads = false;
  int threads = 1;  // compute threads of each rank
};

// Fills the values of this rank's parameters (its tensor-parallel shards, its experts, its
// stage's blocks) in place; `layout` says which parts of the full tensors the rank holds.
using RankWeightLoader = std::function<void(ParameterSet& params, const CheckpointLayout& layout)>;

// One rank of an evaluation over `world` (null: one rank alone, every parallel degree 1).
// `config`: the switchyard keys of the model (TrainKeysJson; seq_len >= T) and the layout keys
// (ranks = world size, tp, sequence_parallel, cp, pp, ep, etp, arrangement); `tokens` int32
// [B, T] in [0, vocab_size), T >= 2, the same on every rank; B must divide by the data-parallel
// size and the sequence split must fit cp / sequence parallelism (InvalidArgument naming the
// key). Collective over `world`; every rank returns the whole result.
EvalResult EvaluateOnRank(const TrainConfig& config, comm::Communicator* world,
                          int ranks_in_process, const RankWeightLoader& load, const Tensor& tokens,
                          const EvalOptions& options);

// One rank alone, from full tensors by switchyard name (every parameter). InvalidArgument naming
// the tokens for a bad shape or id.
EvalResult EvaluateModel(const TrainConfig& config, const TensorMap& weights, const Tensor& tokens,
                         double aux_coef, bool grads, int threads = 1);

// The loader of full tensors: each rank slices its part (CheckpointLayout::Slice).
RankWeightLoader SliceFullWeights(const TensorMap& weights);

}  // namespace switchyard::train::hf
