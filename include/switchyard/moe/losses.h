// The gate's losses (docs/moe.md, "Losses"), forward and backward.
//
//   gshard              l_aux = E * sum_e m_e * c_e, m_e = mean_t P[t, e], c_e = fraction of
//                       tokens whose 1st choice is e. Gradient through m_e only.
//   gshard_all_choices  l_aux = E / k * sum_e m_e * c_e with c_e counting all k choices
//   (DeepSpeed's
//                       top-k loss E^2/k * mean_e(m_e c_e)); equals gshard for k = 1.
//   importance_load     Tutel's load_importance_loss: (cv^2(Imp) + cv^2(Load)) / 2 with
//                       Imp_e = sum_t Pc[t, e], Load_e = sum_t Phi((Pc[t, e] - thr_t) / sigma),
//                       Pc the aux probabilities of the noise-free logits, thr_t the noisy logit
//                       of token t's k-th choice, sigma = noise_std / E, cv^2(v) =
//                       var(v) / (mean(v)^2 + 1e-10) with the unbiased variance.
//   sequence            Megatron-Core's seq_aux_loss (DeepSeek-V3's sequence-wise balance loss):
//                       the batch's rows form B sequences of S = sequence_length tokens (token t
//                       belongs to sequence GateResult::sequence[t]);
//                       l_aux = 1/B sum_b E / (k S^2) sum_e P_be N_be, P_be = sum_{t in b} P[t, e],
//                       N_be = the number of tokens of b whose top k of P holds e (Megatron's
//                       aux routing map: no expert bias, no group limit). Gradient through P_be.
//   global              Megatron-Core's global_aux_loss (Qiu et al. 2025, arXiv 2501.11873):
//                       l_aux = E / (k T^2) sum_e P_e Nbar_e over the T tokens of the
//                       micro-batch on every rank (P_e = sum_t P[t, e]), Nbar_e the running mean
//                       over the step's micro-batches so far, this one included, of N_e, the
//                       tokens whose top k of P holds e (Megatron's aux routing map). The counts
//                       of earlier micro-batches come from the caller (AuxCountsSoFar). Gradient
//                       through P only.
//   hf_concat           Hugging Face's load_balancing_loss_func (router_load_loss.h):
//                       l_aux = E * sum_e (P_e / N) (C_e / N) over the rows of every MoE layer of
//                       a forward concatenated, C_e the (row, choice) pairs whose top k of P holds
//                       e. One layer alone: its own rows (N = T). Gradient through P only; the
//                       layer's backward takes the concatenation's C and N
//                       (UseConcatenationCounts).
//   z-loss              z = mean_t (logsumexp_e logits[t, e])^2 on the noise-free logits (ST-MoE).
// P are the aux probabilities: the softmax over all E experts (score functions softmax and
// softmax_after_topk), or the sigmoid scores normalized to sum 1 per token (Megatron-Core).
#pragma once

#include <span>
#include <vector>

#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/router_load_loss.h"

namespace switchyard::moe {

// aux_loss global: what the step's earlier micro-batches counted. The caller (the training loop)
// adds up LayerOutput::aux_counts of each micro-batch of the step, starting from zero counts and
// 0 micro-batches at each step; the layers already sum the counts over the ranks of the batch.
struct AuxCountsSoFar {
  std::vector<double> counts;  // [E] sum of N_e over the earlier micro-batches; empty: none
  int64_t micro_batches = 0;   // how many there were
};

struct GateLosses {
  float l_aux = 0;   // per config.aux_loss (0 for none)
  float z_loss = 0;  // always computed (it costs O(T * E)); weighted by z_loss_coef
};

GateLosses ComputeGateLosses(const LayerConfig& config, const GateResult& gate);

// Adds aux_coef * d l_aux / d logits + z_coef * d z / d logits into d_logits [T, E] float32
// (noisy and noise-free logits differ by a constant, so they share one gradient).
void GateLossesBackward(const LayerConfig& config, const GateResult& gate, float aux_coef,
                        float z_coef, const Tensor& d_logits);

// ---- Losses of a batch split over ranks (expert parallelism). ----
// Every loss above is a function of per-expert sums over tokens. A rank computes the sums of its
// own tokens, the ranks add them (an all-reduce of ToVector()), and GateLossesFromSums /
// the GateLossesBackward overload then give the losses of the whole batch and each rank's share
// of their gradient. With the sums of one rank's tokens they equal ComputeGateLosses /
// GateLossesBackward.
struct GateLossSums {
  double num_tokens = 0;
  double z = 0;                    // sum_t lse_t^2 of the noise-free logits
  std::vector<double> probs;       // [E] sum_t P[t, e] (gshard, gshard_all_choices, global)
  std::vector<double> choices;     // [E] counted choices per expert (1st, or all k; global: the
                                   //     aux routing map's, or Nbar after UseRunningMeanCounts)
  std::vector<double> importance;  // [E] importance_load: sum_t Pc[t, e]
  std::vector<double> load;        // [E] importance_load: sum_t Phi((Pc[t, e] - thr_t) / sigma)
  // aux_loss sequence, [B, E] per sequence b of the batch (slot: sequence index mod B):
  std::vector<double> seq_probs;    // sum_{t in b} P[t, e]
  std::vector<double> seq_choices;  // tokens of b with e in their top k of P

  // [num_tokens, z, probs, choices, importance, load, seq_probs, seq_choices] (empty vectors take
  // no room).
  std::vector<double> ToVector() const;
  // Inverse of ToVector for the same config; throws InvalidArgument on a size mismatch.
  static GateLossSums FromVector(const LayerConfig& config, std::span<const double> values);
};

// batch_tokens: the number of tokens of the whole batch these tokens belong to (0: just these).
// aux_loss sequence lays its sums out per sequence of that batch: B = batch_tokens /
// sequence_length slots, sequence s in slot s mod B, so the batch must hold B whole sequences of
// consecutive global token indices (any rank may hold any of their tokens). A batch_tokens that
// is not a multiple of sequence_length throws InvalidArgument naming sequence_length.
GateLossSums ComputeGateLossSums(const LayerConfig& config, const GateResult& gate,
                                 int64_t batch_tokens = 0);
GateLosses GateLossesFromSums(const LayerConfig& config, const GateLossSums& sums);
// aux_loss global: replaces sums->choices (this micro-batch's N over the whole batch) with the
// running mean (prior.counts + N) / (prior.micro_batches + 1). Throws InvalidArgument when
// prior.counts is neither empty nor [E], or prior.micro_batches < 0. Other losses: no change.
void UseRunningMeanCounts(const LayerConfig& config, const AuxCountsSoFar& prior,
                          GateLossSums* sums);
// aux_loss hf_concat: the layer's sums (num_tokens, probs, choices) as a part of the
// concatenation; other losses: empty sums of E experts.
RouterLoadSums ConcatSumsOf(const LayerConfig& config, const GateLossSums& sums);
// aux_loss hf_concat: makes the backward of the layer whose sums are `sums` (this layer's
// batch) differentiate the concatenation's loss, whose sums are `total` (every layer's rows;
// total.num_rows >= sums->num_tokens, InvalidArgument otherwise): the choices become
// total.choices * (T / N)^2, so that the gshard form's gradient E * choices / T^2 is
// E * C / N^2. Other losses: no change.
void UseConcatenationCounts(const LayerConfig& config, const RouterLoadSums& total,
                            GateLossSums* sums);
// As GateLossesBackward, for the losses of the batch whose sums are `batch` (gate is this rank's
// part of it).
void GateLossesBackward(const LayerConfig& config, const GateResult& gate, float aux_coef,
                        float z_coef, const Tensor& d_logits, const GateLossSums& batch);

}  // namespace switchyard::moe
