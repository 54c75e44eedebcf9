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
//   z-loss              z = mean_t (logsumexp_e logits[t, e])^2 on the noise-free logits (ST-MoE).
// P are the aux probabilities: the softmax over all E experts (score functions softmax and
// softmax_after_topk), or the sigmoid scores normalized to sum 1 per token (Megatron-Core).
#pragma once

#include <span>
#include <vector>

#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"

namespace switchyard::moe {

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
  std::vector<double> probs;       // [E] sum_t P[t, e] (gshard, gshard_all_choices)
  std::vector<double> choices;     // [E] counted choices per expert (1st, or all k)
  std::vector<double> importance;  // [E] importance_load: sum_t Pc[t, e]
  std::vector<double> load;        // [E] importance_load: sum_t Phi((Pc[t, e] - thr_t) / sigma)

  // [num_tokens, z, probs, choices, importance, load] (empty vectors take no room).
  std::vector<double> ToVector() const;
  // Inverse of ToVector for the same config; throws InvalidArgument on a size mismatch.
  static GateLossSums FromVector(const LayerConfig& config, std::span<const double> values);
};

GateLossSums ComputeGateLossSums(const LayerConfig& config, const GateResult& gate);
GateLosses GateLossesFromSums(const LayerConfig& config, const GateLossSums& sums);
// As GateLossesBackward, for the losses of the batch whose sums are `batch` (gate is this rank's
// part of it).
void GateLossesBackward(const LayerConfig& config, const GateResult& gate, float aux_coef,
                        float z_coef, const Tensor& d_logits, const GateLossSums& batch);

}  // namespace switchyard::moe
