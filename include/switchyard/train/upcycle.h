// Upcycling (Megatron-Core's MoE upcycling, docs/models.md "Upcycling"): `train --upcycle-from
// PATH` starts a new MoE run from a dense model. PATH is a switchyard checkpoint of a dense run
// (moe_every 0; `train` or `train-dense`) or a Hugging Face Llama / Qwen2 directory.
//
// Every tensor the two models share (embeddings, attention, norms, the dense MLPs of blocks that
// stay dense, the head) is copied. The dense MLP of block L becomes the experts of MoE block L:
// with granularity G = hidden_dim / expert_hidden_dim (1: plain upcycling), expert j holds
// chunk j % G of the dense hidden dimension (rows of fc1 / fc3 and their bias, columns of fc2),
// and the router rows of experts [rG, rG + G) are all the new model's freshly initialized row r
// (Megatron's `_process_router_param`), or zero on request. The down projection (fc2's weight) is
// multiplied by G / s and fc2's bias by 1 / s, where s is the sum of a token's k gate values at
// uniform router logits (1 for renormalized routers, k / E for softmax over all experts without
// renormalization): so with a uniform router and k a multiple of G, choosing one copy of each
// chunk per G choices, the MoE block's output equals the dense MLP's, for any activation.
// (Megatron spreads the same factor over fc1 and fc2 as its cube or square root, which keeps the
// output only for homogeneous activations such as squared ReLU.)
//
// Thread-safety: reentrant.
#pragma once

#include <string>

#include "switchyard/core/tensor.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/config.h"

namespace switchyard::train {

// What --upcycle-from PATH fixes of the new run. InvalidArgument naming PATH when it is already
// an MoE model; IoError when it cannot be read.
struct UpcycleSource {
  // The dense model's keys (a JSON object of TrainConfig keys): its shape and components
  // (vocab_size, model_dim, num_layers, heads, hidden_dim, norm, positions, biases, mlp, ...)
  // and gated_shared_expert_hidden 0. The MoE keys (num_experts, top_k, moe_every,
  // expert_hidden_dim, the router) are the new run's own.
  std::string keys_json;
  // A Hugging Face directory's MoE family: "mixtral" for llama, "qwen2_moe" for qwen2 (the run's
  // `arch`); "" for a switchyard checkpoint (the run chooses).
  std::string arch;
};
UpcycleSource ReadUpcycleSource(const std::string& path);

// InvalidArgument naming the key unless `config` can be upcycled from a dense model whose keys
// it has taken: moe_every > 0, hidden_dim divisible by each MoE block's expert hidden size
// (expert_hidden_dim, 0: hidden_dim) and that block's experts by the granularity.
void CheckUpcycleConfig(const TrainConfig& config);

struct UpcycleOptions {
  bool zero_router = false;  // routers all zero (uniform routing) instead of fresh
};

// The new MoE model's full tensors (a checkpoint's `model` map, layout-independent) from the
// dense model's `dense` and the new model's freshly initialized `initial` (its router, and every
// tensor shape). `config` is the new run's. InvalidArgument naming the tensor for a dense tensor
// the MoE model has no place for, a shape that differs, or an MoE block tensor that has no dense
// source (a shared expert, a residual MLP).
TensorMap UpcycleWeights(const TensorMap& dense, TensorMap initial, const TrainConfig& config,
                         const UpcycleOptions& options);

// PATH's dense weights as full switchyard tensors: ReadSwitchyardTensors of a Hugging Face
// directory, or the checkpoint's model.safetensors.
TensorMap ReadUpcycleWeights(const std::string& path);

}  // namespace switchyard::train
