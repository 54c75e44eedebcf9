#include "switchyard/moe/losses.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "switchyard/core/error.h"

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
void AuxProbabilitiesBackward(const LayerConfig& c, const float* logits,
                              const std::vector<double>& p, const std::vector<double>& dp,
                              int64_t t_num, int64_t e_num, float* d_logits) {
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
        s[static_cast<size_t>(e)] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
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

// c_e: fraction of tokens whose 1st choice (or any choice) is e, and the loss scale.
struct GShardTerms {
  std::vector<double> c;
  double scale = 0;  // l_aux = scale * sum_e m_e c_e
};
GShardTerms GShardCounts(const LayerConfig& config, const GateResult& g) {
  GShardTerms r;
  r.c.assign(static_cast<size_t>(g.num_experts), 0.0);
  bool all = config.aux_loss == AuxLoss::kGShardAllChoices;
  int64_t choices = all ? g.top_k : 1;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    for (int64_t j = 0; j < choices; ++j) {
      r.c[static_cast<size_t>(g.experts[static_cast<size_t>(t * g.top_k + j)])] += 1.0;
    }
  }
  double inv_t = g.num_tokens > 0 ? 1.0 / static_cast<double>(g.num_tokens) : 0.0;
  for (double& v : r.c) v *= inv_t;
  r.scale = static_cast<double>(g.num_experts) / static_cast<double>(choices);
  return r;
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

// Tutel's importance + load loss; with grads, the gradient of `coef * loss` is added to d_logits.
double ImportanceLoad(const LayerConfig& config, const GateResult& g, float coef, float* d_logits) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts, k = g.top_k;
  const float* clean = g.logits.data<float>();
  const float* noisy = g.noisy_logits.data<float>();
  std::vector<double> p = AuxProbabilities(config, clean, t_num, e_num);
  const double sigma = static_cast<double>(config.noise_std) / static_cast<double>(e_num);
  std::vector<double> imp(static_cast<size_t>(e_num), 0.0), load(static_cast<size_t>(e_num), 0.0);
  auto threshold = [&](int64_t t) {
    return static_cast<double>(noisy[t * e_num + g.experts[static_cast<size_t>(t * k + k - 1)]]);
  };
  for (int64_t t = 0; t < t_num; ++t) {
    double thr = threshold(t);
    for (int64_t e = 0; e < e_num; ++e) {
      double pe = p[static_cast<size_t>(t * e_num + e)];
      imp[static_cast<size_t>(e)] += pe;
      load[static_cast<size_t>(e)] += NormalCdf((pe - thr) / sigma);
    }
  }
  std::vector<double> d_imp, d_load;
  double loss =
      (Cv2(imp, d_logits ? &d_imp : nullptr) + Cv2(load, d_logits ? &d_load : nullptr)) / 2.0;
  if (!d_logits) return loss;
  std::vector<double> dp(p.size());
  for (int64_t t = 0; t < t_num; ++t) {
    double thr = threshold(t);
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
  AuxProbabilitiesBackward(config, clean, p, dp, t_num, e_num, d_logits);
  return loss;
}

}  // namespace

GateLosses ComputeGateLosses(const LayerConfig& config, const GateResult& g) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  GateLosses out;
  if (t_num == 0) return out;
  // z-loss on the noise-free logits.
  const float* l = g.logits.data<float>();
  double z = 0;
  for (int64_t t = 0; t < t_num; ++t) {
    double mx = -INFINITY;
    for (int64_t e = 0; e < e_num; ++e) mx = std::max(mx, static_cast<double>(l[t * e_num + e]));
    double s = 0;
    for (int64_t e = 0; e < e_num; ++e) s += std::exp(l[t * e_num + e] - mx);
    double lse = mx + std::log(s);
    z += lse * lse;
  }
  out.z_loss = static_cast<float>(z / static_cast<double>(t_num));

  switch (config.aux_loss) {
    case AuxLoss::kGShard:
    case AuxLoss::kGShardAllChoices: {
      std::vector<double> p = AuxProbabilities(config, g.noisy_logits.data<float>(), t_num, e_num);
      GShardTerms terms = GShardCounts(config, g);
      double sum = 0;
      for (int64_t e = 0; e < e_num; ++e) {
        double m = 0;
        for (int64_t t = 0; t < t_num; ++t) m += p[static_cast<size_t>(t * e_num + e)];
        sum += m / static_cast<double>(t_num) * terms.c[static_cast<size_t>(e)];
      }
      out.l_aux = static_cast<float>(terms.scale * sum);
      break;
    }
    case AuxLoss::kImportanceLoad:
      out.l_aux = static_cast<float>(ImportanceLoad(config, g, 0.0f, nullptr));
      break;
    case AuxLoss::kNone: break;
  }
  return out;
}

void GateLossesBackward(const LayerConfig& config, const GateResult& g, float aux_coef,
                        float z_coef, const Tensor& d_logits) {
  const int64_t t_num = g.num_tokens, e_num = g.num_experts;
  ExpectShape("d_logits", d_logits, {t_num, e_num});
  if (t_num == 0) return;
  float* dl = d_logits.data<float>();
  if (z_coef != 0) {
    // dz/dl[t, e] = 2 lse_t softmax(l_t)_e / T.
    const float* l = g.logits.data<float>();
    for (int64_t t = 0; t < t_num; ++t) {
      double mx = -INFINITY;
      for (int64_t e = 0; e < e_num; ++e) mx = std::max(mx, static_cast<double>(l[t * e_num + e]));
      double s = 0;
      for (int64_t e = 0; e < e_num; ++e) s += std::exp(l[t * e_num + e] - mx);
      double lse = mx + std::log(s);
      double f = z_coef * 2.0 * lse / static_cast<double>(t_num);
      for (int64_t e = 0; e < e_num; ++e) {
        dl[t * e_num + e] += static_cast<float>(f * std::exp(l[t * e_num + e] - lse));
      }
    }
  }
  if (aux_coef == 0) return;
  switch (config.aux_loss) {
    case AuxLoss::kGShard:
    case AuxLoss::kGShardAllChoices: {
      const float* nl = g.noisy_logits.data<float>();
      std::vector<double> p = AuxProbabilities(config, nl, t_num, e_num);
      GShardTerms terms = GShardCounts(config, g);
      std::vector<double> dp(p.size());
      for (int64_t t = 0; t < t_num; ++t) {
        for (int64_t e = 0; e < e_num; ++e) {
          dp[static_cast<size_t>(t * e_num + e)] =
              aux_coef * terms.scale * terms.c[static_cast<size_t>(e)] / static_cast<double>(t_num);
        }
      }
      AuxProbabilitiesBackward(config, nl, p, dp, t_num, e_num, dl);
      break;
    }
    case AuxLoss::kImportanceLoad: ImportanceLoad(config, g, aux_coef, dl); break;
    case AuxLoss::kNone: break;
  }
}

}  // namespace switchyard::moe
