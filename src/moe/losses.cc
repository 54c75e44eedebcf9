#include "switchyard/moe/losses.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/ops.h"

namespace switchyard::moe {
namespace {

constexpr double kCvEps = 1e-10;  // Tutel's cv^2 denominator guard

// Aux probabilities P [T, E] (double) from logits: softmax, or sigmoid normalized per token.
std::vector<double> AuxProbabilities(const LayerConfig& c, const float* logits, int64_t t_num,
                                     int64_t e_num) {
  std::vector<double> p(static_cast<size_t>(t_num * e_num));
  for (int64_t t = 0; t < t_num; ++t) {
    const float* l = logits + t * e_num;
    double* pr = p.data() + t * e_num;
    double sum = 0;
    if (c.score_function == ScoreFunction::kSigmoid) {
      for (int64_t e = 0; e < e_num; ++e) {
        pr[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
        sum += pr[e];
      }
    } else {
      double mx = -INFINITY;
      for (int64_t e = 0; e < e_num; ++e) mx = std::max(mx, static_cast<double>(l[e]));
      for (int64_t e = 0; e < e_num; ++e) {
        pr[e] = std::exp(static_cast<double>(l[e]) - mx);
        sum += pr[e];
      }
    }
    for (int64_t e = 0; e < e_num; ++e) pr[e] /= sum;
  }
  return p;
}

// dP [T, E] -> adds into d_logits through AuxProbabilities.
// `sigmoid` may hold sigmoid(logits) (the gate's scores) to save recomputing it.
void AuxProbabilitiesBackward(const LayerConfig& c, const float* logits,
                              const std::vector<double>& p, const std::vector<double>& dp,
                              int64_t t_num, int64_t e_num, float* d_logits,
                              const float* sigmoid = nullptr) {
  for (int64_t t = 0; t < t_num; ++t) {
    const double* pr = p.data() + t * e_num;
    const double* dpr = dp.data() + t * e_num;
    double dot = 0;
    for (int64_t e = 0; e < e_num; ++e) dot += dpr[e] * pr[e];
    if (c.score_function == ScoreFunction::kSigmoid) {
      // P_e = s_e / S: ds_e = (dP_e - dot) / S; dl_e = ds_e s_e (1 - s_e).
      const float* l = logits + t * e_num;
      std::vector<double> s(static_cast<size_t>(e_num));
      double sum = 0;
      for (int64_t e = 0; e < e_num; ++e) {
        s[static_cast<size_t>(e)] = sigmoid != nullptr
                                        ? static_cast<double>(sigmoid[t * e_num + e])
                                        : 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
        sum += s[static_cast<size_t>(e)];
      }
      for (int64_t e = 0; e < e_num; ++e) {
        double se = s[static_cast<size_t>(e)];
        d_logits[t * e_num + e] += static_cast<float>((dpr[e] - dot) / sum * se * (1.0 - se));
      }
    } else {
      for (int64_t e = 0; e < e_num; ++e) {
        d_logits[t * e_num + e] += static_cast<float>(pr[e] * (dpr[e] - dot));
      }
    }
  }
}

// The aux probabilities of the noisy logits from the gate's scores, which already hold their
// softmax (softmax, softmax_after_topk) or sigmoid: no exponential recomputed.
std::vector<double> AuxProbabilitiesOfScores(const LayerConfig& c, const GateResult& g) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  const float* sc = g.scores.data<float>();
  std::vector<double> p(static_cast<size_t>(t_num * e_num));
  for (int64_t t = 0; t < t_num; ++t) {
    double sum = 1.0;
    if (c.score_function == ScoreFunction::kSigmoid) {
      sum = 0;
      for (int64_t e = 0; e < e_num; ++e) sum += sc[t * e_num + e];
    }
    for (int64_t e = 0; e < e_num; ++e) {
      p[static_cast<size_t>(t * e_num + e)] = static_cast<double>(sc[t * e_num + e]) / sum;
    }
  }
  return p;
}

// True when the gate added no noise to its logits (noisy_logits is logits).
bool NoiseFree(const GateResult& g) {
  return g.num_tokens == 0 || g.noisy_logits.SharesStorageWith(g.logits);
}

// The choices each token counts: all k (gshard_all_choices, global, hf_concat) or the 1st.
int64_t CountedChoices(const LayerConfig& config, int64_t top_k) {
  const bool all = config.aux_loss == AuxLoss::kGShardAllChoices ||
                   config.aux_loss == AuxLoss::kGlobal || config.aux_loss == AuxLoss::kHfConcat;
  return all ? top_k : 1;
}

// Megatron's aux routing map counted per expert: the top k of each token's scores (the top k of
// P: P is the scores, or the sigmoid scores scaled by a positive factor per token), without the
// expert bias, the group limit or drops. Adds into counts [E].
void AuxMapCounts(const GateResult& g, double* counts) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts, k = g.top_k;
  if (t_num == 0) return;
  std::vector<int32_t> top(static_cast<size_t>(t_num * k));
  std::vector<float> val(static_cast<size_t>(t_num * k));
  kernels::TopK(g.scores.data<float>(), t_num, e_num, k, top.data(), val.data());
  for (int32_t e : top) counts[e] += 1.0;
}

// Counted choices per expert (1st choice, all k, or the aux routing map's) and the loss scale:
// l_aux = scale * sum_e m_e * c_e with c_e = choices_e / T.
// hf_concat: Hugging Face's E (its f_e counts all k choices without dividing by k).
double GShardScale(const LayerConfig& config, int64_t num_experts, int64_t top_k) {
  if (config.aux_loss == AuxLoss::kHfConcat) return static_cast<double>(num_experts);
  return static_cast<double>(num_experts) / static_cast<double>(CountedChoices(config, top_k));
}
std::vector<double> GShardChoices(const LayerConfig& config, const GateResult& g) {
  std::vector<double> c(static_cast<size_t>(g.num_experts), 0.0);
  if (config.aux_loss == AuxLoss::kGlobal || config.aux_loss == AuxLoss::kHfConcat) {
    AuxMapCounts(g, c.data());
    return c;
  }
  const int64_t choices = CountedChoices(config, g.top_k);
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    for (int64_t j = 0; j < choices; ++j) {
      c[static_cast<size_t>(g.experts[static_cast<size_t>(t * g.top_k + j)])] += 1.0;
    }
  }
  return c;
}

double NormalCdf(double z) { return 0.5 * std::erfc(-z * std::numbers::sqrt2 / 2); }
double NormalPdf(double z) { return std::exp(-0.5 * z * z) / std::sqrt(2 * std::numbers::pi); }

// cv^2(v) = var(v) / (mean(v)^2 + eps) with the unbiased variance, and its gradient.
double Cv2(const std::vector<double>& v, std::vector<double>* grad) {
  auto n = static_cast<double>(v.size());
  double mean = 0;
  for (double x : v) mean += x;
  mean /= n;
  double var = 0;
  for (double x : v) var += (x - mean) * (x - mean);
  var /= n - 1;
  double den = mean * mean + kCvEps;
  if (grad) {
    grad->resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      (*grad)[i] = 2 * (v[i] - mean) / (n - 1) / den - var * 2 * mean / n / (den * den);
    }
  }
  return var / den;
}

// Tutel's importance + load loss: the threshold of token t is its k-th choice's noisy logit.
double ImportanceThreshold(const GateResult& g, int64_t t) {
  const int64_t e_num = g.num_experts, k = g.top_k;
  return static_cast<double>(
      g.noisy_logits.data<float>()[t * e_num + g.experts[static_cast<size_t>(t * k + k - 1)]]);
}

// Imp_e and Load_e of this rank's tokens (added into imp and load).
void ImportanceLoadSums(const LayerConfig& config, const GateResult& g, std::vector<double>* imp,
                        std::vector<double>* load) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  std::vector<double> p = NoiseFree(g)
                              ? AuxProbabilitiesOfScores(config, g)
                              : AuxProbabilities(config, g.logits.data<float>(), t_num, e_num);
  const double sigma = static_cast<double>(config.noise_std) / static_cast<double>(e_num);
  imp->assign(static_cast<size_t>(e_num), 0.0);
  load->assign(static_cast<size_t>(e_num), 0.0);
  for (int64_t t = 0; t < t_num; ++t) {
    double thr = ImportanceThreshold(g, t);
    for (int64_t e = 0; e < e_num; ++e) {
      double pe = p[static_cast<size_t>(t * e_num + e)];
      (*imp)[static_cast<size_t>(e)] += pe;
      (*load)[static_cast<size_t>(e)] += NormalCdf((pe - thr) / sigma);
    }
  }
}

// Adds the gradient of coef * loss into d_logits, for the loss of the batch with sums imp, load.
void ImportanceLoadBackward(const LayerConfig& config, const GateResult& g,
                            const std::vector<double>& imp, const std::vector<double>& load,
                            float coef, float* d_logits) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts, k = g.top_k;
  const float* clean = g.logits.data<float>();
  const bool noise_free = NoiseFree(g);
  std::vector<double> p = noise_free ? AuxProbabilitiesOfScores(config, g)
                                     : AuxProbabilities(config, clean, t_num, e_num);
  const double sigma = static_cast<double>(config.noise_std) / static_cast<double>(e_num);
  std::vector<double> d_imp, d_load;
  Cv2(imp, &d_imp);
  Cv2(load, &d_load);
  std::vector<double> dp(p.size());
  for (int64_t t = 0; t < t_num; ++t) {
    double thr = ImportanceThreshold(g, t);
    double d_thr = 0;
    for (int64_t e = 0; e < e_num; ++e) {
      size_t i = static_cast<size_t>(t * e_num + e);
      double dens = NormalPdf((p[i] - thr) / sigma) / sigma;
      double dl = 0.5 * coef * d_load[static_cast<size_t>(e)] * dens;
      dp[i] = 0.5 * coef * d_imp[static_cast<size_t>(e)] + dl;
      d_thr -= dl;
    }
    d_logits[t * e_num + g.experts[static_cast<size_t>(t * k + k - 1)]] +=
        static_cast<float>(d_thr);
  }
  AuxProbabilitiesBackward(config, clean, p, dp, t_num, e_num, d_logits,
                           noise_free ? g.scores.data<float>() : nullptr);
}

// lse_t of the noise-free logits.
double LogSumExp(const float* l, int64_t e_num) {
  double mx = -INFINITY;
  for (int64_t e = 0; e < e_num; ++e) mx = std::max(mx, static_cast<double>(l[e]));
  double s = 0;
  for (int64_t e = 0; e < e_num; ++e) s += std::exp(l[e] - mx);
  return mx + std::log(s);
}

// The losses of the form scale * sum_e (P_e / T) (choices_e / T): gshard, gshard_all_choices,
// global and hf_concat (whose choices are the aux routing map's).
bool IsGShard(const LayerConfig& config) {
  return config.aux_loss == AuxLoss::kGShard || config.aux_loss == AuxLoss::kGShardAllChoices ||
         config.aux_loss == AuxLoss::kGlobal || config.aux_loss == AuxLoss::kHfConcat;
}

// The number of sequences of a batch of batch_tokens tokens (aux_loss sequence).
int64_t NumSequences(const LayerConfig& config, int64_t batch_tokens) {
  SY_REQUIRE(batch_tokens % config.sequence_length == 0, InvalidArgument,
             "sequence_length: aux_loss sequence needs whole sequences of sequence_length = {} "
             "rows (rows are batch-major), but the batch has {} tokens",
             config.sequence_length, batch_tokens);
  return batch_tokens / config.sequence_length;
}

// Per-sequence sums [B, E] of this rank's tokens: P (when probs is not null) and the counts of
// Megatron's aux routing map, the top k of each token's aux probabilities.
void SequenceSums(const LayerConfig& config, const GateResult& g, int64_t num_sequences,
                  std::vector<double>* probs, std::vector<double>* choices) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts, k = g.top_k;
  const auto size = static_cast<size_t>(num_sequences * e_num);
  SY_CHECK(static_cast<int64_t>(g.sequence.size()) == t_num);
  choices->assign(size, 0.0);
  if (probs != nullptr) probs->assign(size, 0.0);
  if (t_num == 0) return;
  // The top k of P is the top k of the scores (P is the scores, or the sigmoid scores scaled by a
  // positive factor per token).
  std::vector<int32_t> top(static_cast<size_t>(t_num * k));
  std::vector<float> val(static_cast<size_t>(t_num * k));
  kernels::TopK(g.scores.data<float>(), t_num, e_num, k, top.data(), val.data());
  std::vector<double> p;
  if (probs != nullptr) p = AuxProbabilitiesOfScores(config, g);
  for (int64_t t = 0; t < t_num; ++t) {
    const int64_t b = g.sequence[static_cast<size_t>(t)] % num_sequences;
    for (int64_t j = 0; j < k; ++j) {
      (*choices)[static_cast<size_t>(b * e_num + top[static_cast<size_t>(t * k + j)])] += 1.0;
    }
    if (probs == nullptr) continue;
    for (int64_t e = 0; e < e_num; ++e) {
      (*probs)[static_cast<size_t>(b * e_num + e)] += p[static_cast<size_t>(t * e_num + e)];
    }
  }
}

// Adds aux_coef * d l_aux / d logits of the sequence loss of the batch with sums `batch`:
// d l / d P[t, e] = E / (k S^2 B) * N_{b(t) e}.
void SequenceLossBackward(const LayerConfig& config, const GateResult& g, const GateLossSums& batch,
                          float aux_coef, float* d_logits) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  const size_t b_num = batch.seq_choices.size() / static_cast<size_t>(e_num);
  SY_REQUIRE(b_num > 0 && batch.seq_choices.size() == b_num * static_cast<size_t>(e_num),
             InvalidArgument,
             "GateLossesBackward: the batch sums hold {} per-sequence counts, expected a "
             "positive multiple of {} experts",
             batch.seq_choices.size(), e_num);
  SY_CHECK(static_cast<int64_t>(g.sequence.size()) == t_num);
  const auto seq = static_cast<double>(config.sequence_length);
  const double scale = aux_coef * static_cast<double>(e_num) /
                       (static_cast<double>(g.top_k) * seq * seq * static_cast<double>(b_num));
  std::vector<double> p = AuxProbabilitiesOfScores(config, g);
  std::vector<double> dp(p.size());
  for (int64_t t = 0; t < t_num; ++t) {
    const auto b =
        static_cast<size_t>(g.sequence[static_cast<size_t>(t)] % static_cast<int64_t>(b_num));
    for (int64_t e = 0; e < e_num; ++e) {
      dp[static_cast<size_t>(t * e_num + e)] =
          scale * batch.seq_choices[b * static_cast<size_t>(e_num) + static_cast<size_t>(e)];
    }
  }
  AuxProbabilitiesBackward(config, g.noisy_logits.data<float>(), p, dp, t_num, e_num, d_logits,
                           g.scores.data<float>());
}

}  // namespace

std::vector<double> GateLossSums::ToVector() const {
  std::vector<double> v{num_tokens, z};
  for (const auto* part : {&probs, &choices, &importance, &load, &seq_probs, &seq_choices}) {
    v.insert(v.end(), part->begin(), part->end());
  }
  return v;
}

GateLossSums GateLossSums::FromVector(const LayerConfig& config, std::span<const double> values) {
  const auto e_num = static_cast<size_t>(config.num_experts);
  GateLossSums s;
  size_t expected = 2 + (IsGShard(config) ? 2 * e_num : 0) +
                    (config.aux_loss == AuxLoss::kImportanceLoad ? 2 * e_num : 0);
  const bool sequence = config.aux_loss == AuxLoss::kSequence;
  if (sequence && values.size() > 2 && (values.size() - 2) % (2 * e_num) == 0) {
    expected = values.size();  // [B, E] twice, for any number of sequences B
  }
  SY_REQUIRE(
      values.size() == expected, InvalidArgument,
      "GateLossSums::FromVector: expected {} values for aux_loss '{}' and {} experts, got {}",
      expected, AuxLossName(config.aux_loss), e_num, values.size());
  s.num_tokens = values[0];
  s.z = values[1];
  size_t at = 2;
  auto take = [&](std::vector<double>* dst) {
    dst->assign(values.begin() + static_cast<std::ptrdiff_t>(at),
                values.begin() + static_cast<std::ptrdiff_t>(at + e_num));
    at += e_num;
  };
  if (IsGShard(config)) {
    take(&s.probs);
    take(&s.choices);
  }
  if (config.aux_loss == AuxLoss::kImportanceLoad) {
    take(&s.importance);
    take(&s.load);
  }
  if (sequence) {
    const size_t half = (values.size() - 2) / 2;
    s.seq_probs.assign(values.begin() + 2, values.begin() + static_cast<std::ptrdiff_t>(2 + half));
    s.seq_choices.assign(values.begin() + static_cast<std::ptrdiff_t>(2 + half), values.end());
  }
  return s;
}

GateLossSums ComputeGateLossSums(const LayerConfig& config, const GateResult& g,
                                 int64_t batch_tokens) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  GateLossSums s;
  s.num_tokens = static_cast<double>(t_num);
  const float* l = g.logits.defined() ? g.logits.data<float>() : nullptr;
  const bool have_lse = static_cast<int64_t>(g.lse.size()) == t_num;
  for (int64_t t = 0; t < t_num; ++t) {
    double lse = have_lse ? static_cast<double>(g.lse[static_cast<size_t>(t)])
                          : LogSumExp(l + t * e_num, e_num);
    s.z += lse * lse;
  }
  if (IsGShard(config)) {
    s.probs.assign(static_cast<size_t>(e_num), 0.0);
    if (t_num > 0) {
      std::vector<double> p = AuxProbabilitiesOfScores(config, g);
      for (int64_t e = 0; e < e_num; ++e) {
        double m = 0;
        for (int64_t t = 0; t < t_num; ++t) m += p[static_cast<size_t>(t * e_num + e)];
        s.probs[static_cast<size_t>(e)] = m;
      }
    }
    s.choices = GShardChoices(config, g);
  } else if (config.aux_loss == AuxLoss::kImportanceLoad) {
    ImportanceLoadSums(config, g, &s.importance, &s.load);
  } else if (config.aux_loss == AuxLoss::kSequence) {
    const int64_t b_num = NumSequences(config, batch_tokens > 0 ? batch_tokens : t_num);
    SequenceSums(config, g, b_num, &s.seq_probs, &s.seq_choices);
  }
  return s;
}

GateLosses GateLossesFromSums(const LayerConfig& config, const GateLossSums& s) {
  GateLosses out;
  if (s.num_tokens <= 0) return out;
  const int64_t e_num = config.num_experts;
  out.z_loss = static_cast<float>(s.z / s.num_tokens);
  if (IsGShard(config)) {
    const double scale = GShardScale(config, e_num, EffectiveTopK(config));
    double inv_t = 1.0 / s.num_tokens;
    double sum = 0;
    for (int64_t e = 0; e < e_num; ++e) {
      sum += s.probs[static_cast<size_t>(e)] / s.num_tokens *
             (s.choices[static_cast<size_t>(e)] * inv_t);
    }
    out.l_aux = static_cast<float>(scale * sum);
  } else if (config.aux_loss == AuxLoss::kImportanceLoad) {
    out.l_aux = static_cast<float>((Cv2(s.importance, nullptr) + Cv2(s.load, nullptr)) / 2.0);
  } else if (config.aux_loss == AuxLoss::kSequence && !s.seq_probs.empty()) {
    // 1/B sum_b E / (k S^2) sum_e P_be N_be.
    const auto b_num = static_cast<double>(s.seq_probs.size() / static_cast<size_t>(e_num));
    const auto seq = static_cast<double>(config.sequence_length);
    double sum = 0;
    for (size_t i = 0; i < s.seq_probs.size(); ++i) sum += s.seq_probs[i] * s.seq_choices[i];
    out.l_aux =
        static_cast<float>(sum * static_cast<double>(e_num) /
                           (static_cast<double>(EffectiveTopK(config)) * seq * seq * b_num));
  }
  return out;
}

void UseRunningMeanCounts(const LayerConfig& config, const AuxCountsSoFar& prior,
                          GateLossSums* sums) {
  const auto e_num = static_cast<size_t>(config.num_experts);
  SY_REQUIRE(prior.counts.empty() || prior.counts.size() == e_num, InvalidArgument,
             "aux_counts_so_far: expected the counts of {} experts (or none), got {}", e_num,
             prior.counts.size());
  SY_REQUIRE(prior.micro_batches >= 0, InvalidArgument,
             "aux_counts_so_far: expected micro_batches >= 0, got {}", prior.micro_batches);
  if (config.aux_loss != AuxLoss::kGlobal) return;
  SY_CHECK(sums->choices.size() == e_num);
  const auto n = static_cast<double>(prior.micro_batches + 1);
  for (size_t e = 0; e < e_num; ++e) {
    const double before = prior.counts.empty() ? 0.0 : prior.counts[e];
    sums->choices[e] = (before + sums->choices[e]) / n;
  }
}

RouterLoadSums ConcatSumsOf(const LayerConfig& config, const GateLossSums& sums) {
  RouterLoadSums r(config.num_experts, EffectiveTopK(config));
  if (config.aux_loss != AuxLoss::kHfConcat) return r;
  SY_CHECK(sums.probs.size() == r.probs.size() && sums.choices.size() == r.choices.size());
  r.num_rows = sums.num_tokens;
  r.probs = sums.probs;
  r.choices = sums.choices;
  return r;
}

void UseConcatenationCounts(const LayerConfig& config, const RouterLoadSums& total,
                            GateLossSums* sums) {
  if (config.aux_loss != AuxLoss::kHfConcat) return;
  const auto e_num = static_cast<size_t>(config.num_experts);
  SY_REQUIRE(total.choices.size() == e_num && total.num_rows >= sums->num_tokens, InvalidArgument,
             "hf_concat totals: expected the counts of {} experts over at least this layer's {} "
             "rows, got {} counts over {} rows",
             e_num, sums->num_tokens, total.choices.size(), total.num_rows);
  SY_CHECK(sums->choices.size() == e_num);
  if (sums->num_tokens <= 0) return;
  // The gshard form's gradient is scale * choices_e / T^2 per row; the concatenation's is
  // E * C_e / N^2.
  const double r = sums->num_tokens / total.num_rows;
  for (size_t e = 0; e < e_num; ++e) sums->choices[e] = total.choices[e] * r * r;
}

GateLosses ComputeGateLosses(const LayerConfig& config, const GateResult& g) {
  return GateLossesFromSums(config, ComputeGateLossSums(config, g));
}

void GateLossesBackward(const LayerConfig& config, const GateResult& g, float aux_coef,
                        float z_coef, const Tensor& d_logits) {
  GateLossSums own;
  own.num_tokens = static_cast<double>(g.num_tokens);
  if (aux_coef != 0 && g.num_tokens > 0) {
    if (IsGShard(config)) {
      own.choices = GShardChoices(config, g);
    } else if (config.aux_loss == AuxLoss::kImportanceLoad) {
      ImportanceLoadSums(config, g, &own.importance, &own.load);
    } else if (config.aux_loss == AuxLoss::kSequence) {
      SequenceSums(config, g, NumSequences(config, g.num_tokens), nullptr, &own.seq_choices);
    }
  }
  GateLossesBackward(config, g, aux_coef, z_coef, d_logits, own);
}

void GateLossesBackward(const LayerConfig& config, const GateResult& g, float aux_coef,
                        float z_coef, const Tensor& d_logits, const GateLossSums& batch) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  ExpectShape("d_logits", d_logits, {t_num, e_num});
  if (t_num == 0 || batch.num_tokens <= 0) return;
  float* dl = d_logits.data<float>();
  if (z_coef != 0) {
    // dz/dl[t, e] = 2 lse_t softmax(l_t)_e / T.
    // softmax(logits) is the gate's scores when they are the softmax of noise-free logits.
    const float* l = g.logits.data<float>();
    const bool have_lse = static_cast<int64_t>(g.lse.size()) == t_num;
    const float* softmax = NoiseFree(g) && config.score_function != ScoreFunction::kSigmoid
                               ? g.scores.data<float>()
                               : nullptr;
    for (int64_t t = 0; t < t_num; ++t) {
      double lse = have_lse ? static_cast<double>(g.lse[static_cast<size_t>(t)])
                            : LogSumExp(l + t * e_num, e_num);
      double f = z_coef * 2.0 * lse / batch.num_tokens;
      for (int64_t e = 0; e < e_num; ++e) {
        double pe = softmax ? static_cast<double>(softmax[t * e_num + e])
                            : std::exp(l[t * e_num + e] - lse);
        dl[t * e_num + e] += static_cast<float>(f * pe);
      }
    }
  }
  if (aux_coef == 0) return;
  if (IsGShard(config)) {
    SY_REQUIRE(batch.choices.size() == static_cast<size_t>(e_num), InvalidArgument,
               "GateLossesBackward: the batch sums hold {} expert counts, expected {}",
               batch.choices.size(), e_num);
    const float* nl = g.noisy_logits.data<float>();
    std::vector<double> p = AuxProbabilitiesOfScores(config, g);
    const double scale = GShardScale(config, g.num_experts, g.top_k);
    const double inv_t = 1.0 / batch.num_tokens;
    std::vector<double> dp(p.size());
    for (int64_t t = 0; t < t_num; ++t) {
      for (int64_t e = 0; e < e_num; ++e) {
        dp[static_cast<size_t>(t * e_num + e)] =
            aux_coef * scale * (batch.choices[static_cast<size_t>(e)] * inv_t) / batch.num_tokens;
      }
    }
    AuxProbabilitiesBackward(config, nl, p, dp, t_num, e_num, dl, g.scores.data<float>());
  } else if (config.aux_loss == AuxLoss::kImportanceLoad) {
    SY_REQUIRE(batch.importance.size() == static_cast<size_t>(e_num) &&
                   batch.load.size() == static_cast<size_t>(e_num),
               InvalidArgument,
               "GateLossesBackward: the batch sums hold no importance/load of {} "
               "experts",
               e_num);
    ImportanceLoadBackward(config, g, batch.importance, batch.load, aux_coef, dl);
  } else if (config.aux_loss == AuxLoss::kSequence) {
    SequenceLossBackward(config, g, batch, aux_coef, dl);
  }
}

}  // namespace switchyard::moe
