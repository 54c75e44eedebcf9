// The gate of an MoE layer (docs/moe.md, "Gate"): logits = x · Wg^T in float32, a score function,
// top-k, gate values, and optionally noise, GShard random routing and the aux-loss-free expert
// bias.
//
// Every random draw is keyed by the GLOBAL token index through CounterRng, so a token gets the same
// noise on whichever rank and at whichever local row it lives (docs/moe.md lists the streams and
// indices). The global index of local token t is GateOptions::token_index[t], or
// global_token_offset + t when the caller's tokens are contiguous in the global order.
//
// Thread-safety: the functions are reentrant; they share no state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/config.h"

namespace switchyard::moe {

// normalize_gate and renormalize_after_drop divide by max(sum, kGateEps) (torch.finfo(float32).eps,
// as Tutel and DeepSpeed do).
inline constexpr float kGateEps = 1.1920928955078125e-07f;

struct GateOptions {
  int64_t global_token_offset = 0;  // global index of local token 0 (keys the random draws)
  uint64_t step = 0;                // training step: a new step draws new noise (StepSeed)
  // false (evaluation, inference): no noise and no GShard random routing, whatever the config.
  bool training = true;
  // [T] the global index of each local token (distinct, >= 0), for tokens that are not contiguous
  // in the global order (context parallelism holds chunks of every sequence); empty: the identity
  // global_token_offset + t. It replaces the offset where given.
  std::span<const int64_t> token_index = {};
  // [T, k] replay (Megatron-Core's RouterReplay): the experts each token chooses, instead of the
  // top k (group limit, bias, Gumbel noise); the gate values are still those of the scores at
  // these experts (normalized, scaled), so gradients flow as in the run that chose them. Each
  // row holds k distinct experts in [0, E). Empty: the gate chooses.
  std::span<const int32_t> forced_experts = {};
};

// The global index of local token t: token_index[t], or offset + t when token_index is empty.
inline int64_t GlobalTokenIndex(std::span<const int64_t> token_index, int64_t offset, int64_t t) {
  return token_index.empty() ? offset + t : token_index[static_cast<size_t>(t)];
}

// Throws InvalidArgument unless `forced` holds num_tokens x top_k expert ids, each row k distinct
// ids in [0, num_experts) (GateOptions::forced_experts).
void CheckForcedExperts(std::span<const int32_t> forced, int64_t num_tokens, int64_t top_k,
                        int64_t num_experts);

// Throws InvalidArgument unless token_index is empty or holds num_tokens indices >= 0.
void CheckTokenIndex(std::span<const int64_t> token_index, int64_t num_tokens);

// What the gate decided, and what its backward needs. Per-(token, choice) arrays are [T, k]
// row-major (index t * k + j); choice j = 0 is the 1st choice.
struct GateResult {
  int64_t num_tokens = 0;   // T
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // k (already clamped to E)

  Tensor jitter;        // [T, M] multiplicative jitter of the gate input; undefined without jitter
  Tensor logits;        // [T, E] x_gate · Wg^T (no additive noise): used by the z-loss
  Tensor noisy_logits;  // [T, E] logits + Tutel noise; shares `logits` without additive noise
  // [T, E] the score function on noisy_logits: softmax (also for softmax_after_topk, where it feeds
  // the aux loss and batch-prioritized routing) or sigmoid.
  Tensor scores;

  std::vector<int32_t> experts;      // [T, k] chosen expert of each choice
  std::vector<float> choice_scores;  // [T, k] s_j: the score of the chosen expert (satk: softmax
                                     //        over the k chosen logits)
  std::vector<float> gates;          // [T, k] g_j: s_j after normalize_gate, times
                                     //        topk_scaling_factor
  std::vector<uint8_t> routed;       // [T, k] 0 where GShard random routing removed the choice
  std::vector<float> priority;       // [T] max_e scores[t, e]: batch-prioritized routing order
  std::vector<float> lse;            // [T] logsumexp_e logits[t, e] (noise-free): the z-loss
  // [T] global token index / sequence_length: the sequence of each token (aux_loss sequence only;
  // empty otherwise).
  std::vector<int64_t> sequence;
};

// Runs the gate.
//   x            [T, M] float32 (the layer converts bfloat16 activations first)
//   gate_weight  [E, M] float32
//   expert_bias  [E] float32 when config.expert_bias, else undefined
// `config` must be valid (ValidateConfig).
GateResult GateForward(const LayerConfig& config, const Tensor& x, const Tensor& gate_weight,
                       const Tensor& expert_bias, const GateOptions& options);

// Backward of g_j = topk_scaling_factor * normalize(s_j): d_gates [T, k] -> d choice_scores
// [T, k].
std::vector<float> GateValuesBackward(const LayerConfig& config, const GateResult& gate,
                                      std::span<const float> d_gates);

struct GateGradients {
  Tensor x;            // [T, M] float32
  Tensor gate_weight;  // [E, M] float32
};

struct GateLossSums;  // losses.h

// Backward of the gate and of its losses:
//   d_choice_scores [T, k]  gradient of the objective with respect to GateResult::choice_scores
//   aux_coef, z_coef        the objective contains aux_coef * l_aux + z_coef * z_loss
//   batch_loss_sums         null: the losses are those of these T tokens; else the losses of a
//                           batch split over ranks, with these sums (see losses.h)
// The discrete choices (top-k, drops) pass no gradient; the expert bias is not trained.
GateGradients GateBackward(const LayerConfig& config, const GateResult& gate, const Tensor& x,
                           const Tensor& gate_weight, std::span<const float> d_choice_scores,
                           float aux_coef, float z_coef,
                           const GateLossSums* batch_loss_sums = nullptr);

// Aux-loss-free balancing (DeepSeek-V3), as Megatron-Core's get_updated_expert_bias:
// expert_bias[e] += rate * sign(mean_load - loads[e]), mean and difference in float32.
//   loads        [E] the (token, choice) pairs each expert kept in the whole step (after capacity
//                drops, Megatron's routing_map; every micro-batch, summed over every rank that
//                holds other tokens: the caller's all-reduce), the same on every rank
//   expert_bias  [E] float32, updated in place
void UpdateExpertBias(std::span<const int64_t> loads, float rate, const Tensor& expert_bias);

// The Philox key of one step: a hash of (seed, step), so steps draw independent noise.
uint64_t StepSeed(uint64_t seed, uint64_t step);

}  // namespace switchyard::moe
