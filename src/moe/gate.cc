#include "switchyard/moe/gate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "moe/activation.h"
#include "switchyard/core/error.h"
#include "switchyard/core/rng.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/moe/losses.h"

namespace switchyard::moe {
namespace {

using kernels::Trans;

bool HasTutelNoise(const LayerConfig& c, bool training) {
  return training && c.noise == NoiseKind::kTutelNormal && c.noise_std > 0;
}
bool HasJitter(const LayerConfig& c, bool training) {
  return training && c.noise == NoiseKind::kJitter && c.jitter_eps > 0;
}
bool HasGumbel(const LayerConfig& c, bool training, int64_t k) {
  return training && c.noise == NoiseKind::kGumbelSecond && k >= 2;
}

// Multiplicative jitter U(1 - eps, 1 + eps) for element (g, m): lane m % 4 of the Philox draw
// g * ceil(M / 4) + m / 4 of the jitter stream.
Tensor JitterFactors(const LayerConfig& c, uint64_t key, const GateOptions& o, int64_t num_tokens) {
  int64_t m_dim = c.model_dim;
  Tensor j = Tensor::Empty({num_tokens, m_dim});
  float* p = j.data<float>();
  CounterRng rng(key, kStreamGateJitter);
  int64_t quads = (m_dim + 3) / 4;
  float lo = 1.0f - c.jitter_eps, span = 2.0f * c.jitter_eps;
  for (int64_t t = 0; t < num_tokens; ++t) {
    auto g = static_cast<uint64_t>(GlobalTokenIndex(o.token_index, o.global_token_offset, t));
    for (int64_t q = 0; q < quads; ++q) {
      auto bits = rng.Bits(g * static_cast<uint64_t>(quads) + static_cast<uint64_t>(q));
      for (int64_t l = 0; l < 4 && q * 4 + l < m_dim; ++l) {
        p[t * m_dim + q * 4 + l] = lo + span * BitsToOpenUnit(bits[static_cast<size_t>(l)]);
      }
    }
  }
  return j;
}

// Group-limited top-k (Megatron-Core's group_limited_topk): the E experts form num_groups
// contiguous groups of E / num_groups; a group scores the sum of its top_k / group_topk largest
// values of `select`; the k choices are the top k of `select` among the experts of the
// group_topk best groups (ties: lower index, for groups and experts alike).
void GroupLimitedTopK(const LayerConfig& c, const float* select, int64_t t_num, int64_t k,
                      int32_t* experts) {
  const int64_t e_num = c.num_experts, groups = c.num_groups, per_group = e_num / groups;
  const int64_t per_group_k = k / c.group_topk;
  std::vector<int32_t> idx(static_cast<size_t>(std::max(per_group_k, c.group_topk)));
  std::vector<float> val(static_cast<size_t>(std::max({per_group_k, c.group_topk, k})));
  std::vector<float> group_score(static_cast<size_t>(groups));
  std::vector<float> masked(static_cast<size_t>(e_num));
  for (int64_t t = 0; t < t_num; ++t) {
    const float* row = select + t * e_num;
    for (int64_t g = 0; g < groups; ++g) {
      kernels::TopK(row + g * per_group, 1, per_group, per_group_k, idx.data(), val.data());
      float sum = 0;
      for (int64_t j = 0; j < per_group_k; ++j) sum += val[static_cast<size_t>(j)];
      group_score[static_cast<size_t>(g)] = sum;
    }
    kernels::TopK(group_score.data(), 1, groups, c.group_topk, idx.data(), val.data());
    std::fill(masked.begin(), masked.end(), -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < c.group_topk; ++j) {
      const int64_t g = idx[static_cast<size_t>(j)];
      std::copy(row + g * per_group, row + (g + 1) * per_group, masked.begin() + g * per_group);
    }
    kernels::TopK(masked.data(), 1, e_num, k, experts + t * k, val.data());
  }
}

}  // namespace

void CheckTokenIndex(std::span<const int64_t> token_index, int64_t num_tokens) {
  if (token_index.empty()) return;
  SY_REQUIRE(static_cast<int64_t>(token_index.size()) == num_tokens, InvalidArgument,
             "token_index: expected {} entries (one per token), got {}", num_tokens,
             token_index.size());
  for (size_t t = 0; t < token_index.size(); ++t) {
    SY_REQUIRE(token_index[t] >= 0, InvalidArgument,
               "token_index: entry {} is {}, expected a global token index >= 0", t,
               token_index[t]);
  }
}

uint64_t StepSeed(uint64_t seed, uint64_t step) {
  auto r = Philox4x32({static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0x5eedu, 0},
                      {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  return (static_cast<uint64_t>(r[1]) << 32) | r[0];
}

void CheckForcedExperts(std::span<const int32_t> forced, int64_t num_tokens, int64_t top_k,
                        int64_t num_experts) {
  SY_REQUIRE(static_cast<int64_t>(forced.size()) == num_tokens * top_k, InvalidArgument,
             "forced_experts: expected [{}, {}] (tokens, top_k) = {} expert ids, got {}",
             num_tokens, top_k, num_tokens * top_k, forced.size());
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = forced[static_cast<size_t>(t * top_k + j)];
      SY_REQUIRE(e >= 0 && e < num_experts, InvalidArgument,
                 "forced_experts: token {} choice {} is expert {}, expected one in [0, {})", t, j,
                 e, num_experts);
      for (int64_t i = 0; i < j; ++i) {
        SY_REQUIRE(forced[static_cast<size_t>(t * top_k + i)] != e, InvalidArgument,
                   "forced_experts: token {} chooses expert {} twice (choices {} and {})", t, e, i,
                   j);
      }
    }
  }
}

namespace {

// The global index of local token t (keys every random draw of the gate).
uint64_t GlobalIndex(const GateOptions& o, int64_t t) {
  return static_cast<uint64_t>(GlobalTokenIndex(o.token_index, o.global_token_offset, t));
}

// The gate input (x, or x times the jitter), the logits [T, E] and the noisy logits (the logits
// plus Tutel's normal noise, or the logits themselves), float32.
void GateLogits(const LayerConfig& c, const Tensor& x, const Tensor& gate_weight, uint64_t key,
                const GateOptions& options, GateResult* r) {
  const int64_t m_dim = c.model_dim, e_num = c.num_experts, t_num = x.size(0);
  Tensor gate_input = x;
  if (HasJitter(c, options.training)) {
    r->jitter = JitterFactors(c, key, options, t_num);
    gate_input = Tensor::Empty({t_num, m_dim});
    const float* xp = x.data<float>();
    const float* jp = r->jitter.data<float>();
    float* gp = gate_input.data<float>();
    for (int64_t i = 0; i < t_num * m_dim; ++i) gp[i] = xp[i] * jp[i];
  }
  r->logits = Tensor::Empty({t_num, e_num});
  kernels::Gemm(Trans::kNo, Trans::kYes, t_num, e_num, m_dim, 1.0f, gate_input.data<float>(), m_dim,
                gate_weight.data<float>(), m_dim, 0.0f, r->logits.data<float>(), e_num);
  r->noisy_logits = r->logits;
  if (HasTutelNoise(c, options.training)) {
    r->noisy_logits = r->logits.Clone();
    float* nl = r->noisy_logits.data<float>();
    CounterRng rng(key, kStreamGateNoise);
    float scale = c.noise_std / static_cast<float>(e_num);
    for (int64_t t = 0; t < t_num; ++t) {
      const uint64_t g = GlobalIndex(options, t);
      for (int64_t e = 0; e < e_num; ++e) {
        nl[t * e_num + e] +=
            scale * rng.Normal(g * static_cast<uint64_t>(e_num) + static_cast<uint64_t>(e));
      }
    }
  }
}

// Scores, and the log-sum-exp of the noise-free logits for the z-loss (a by-product of the
// softmax when there is no additive noise).
void GateScores(const LayerConfig& c, GateResult* r) {
  const int64_t t_num = r->num_tokens, e_num = r->num_experts;
  const float* nl = r->noisy_logits.data<float>();
  r->scores = Tensor::Empty({t_num, e_num});
  float* sc = r->scores.data<float>();
  r->lse.resize(static_cast<size_t>(t_num));
  const bool noisy = !r->noisy_logits.SharesStorageWith(r->logits);
  if (c.score_function == ScoreFunction::kSigmoid) {
    for (int64_t i = 0; i < t_num * e_num; ++i) sc[i] = 1.0f / (1.0f + std::exp(-nl[i]));
    SoftmaxLseRows(r->logits.data<float>(), nullptr, r->lse.data(), t_num, e_num);
  } else if (!noisy) {
    SoftmaxLseRows(nl, sc, r->lse.data(), t_num, e_num);
  } else {
    std::vector<float> noisy_lse(static_cast<size_t>(t_num));
    SoftmaxLseRows(nl, sc, noisy_lse.data(), t_num, e_num);
    SoftmaxLseRows(r->logits.data<float>(), nullptr, r->lse.data(), t_num, e_num);
  }
}

// The second to k-th choices of GShard's Gumbel routing: the top-(k-1) of logits + Gumbel noise
// with the first choice (`first`, per token) masked out.
void GumbelChoices(uint64_t key, const GateOptions& options, const std::vector<int32_t>& first,
                   GateResult* r) {
  const int64_t t_num = r->num_tokens, e_num = r->num_experts, k = r->top_k;
  const float* nl = r->noisy_logits.data<float>();
  CounterRng rng(key, kStreamGumbel);
  std::vector<float> row(static_cast<size_t>(e_num));
  std::vector<int32_t> idx(static_cast<size_t>(k - 1));
  std::vector<float> val(static_cast<size_t>(k - 1));
  for (int64_t t = 0; t < t_num; ++t) {
    const uint64_t g = GlobalIndex(options, t);
    for (int64_t e = 0; e < e_num; ++e) {
      row[static_cast<size_t>(e)] =
          nl[t * e_num + e] +
          rng.Gumbel(g * static_cast<uint64_t>(e_num) + static_cast<uint64_t>(e));
    }
    row[static_cast<size_t>(first[static_cast<size_t>(t)])] =
        -std::numeric_limits<float>::infinity();
    kernels::TopK(row.data(), 1, e_num, k - 1, idx.data(), val.data());
    r->experts[static_cast<size_t>(t * k)] = first[static_cast<size_t>(t)];
    for (int64_t j = 1; j < k; ++j) {
      r->experts[static_cast<size_t>(t * k + j)] = idx[static_cast<size_t>(j - 1)];
    }
  }
}

// Selection: top-k of scores (softmax, sigmoid) or of logits (softmax_after_topk), plus the
// expert bias, which affects the choice only.
void SelectExperts(const LayerConfig& c, const Tensor& expert_bias, uint64_t key,
                   const GateOptions& options, GateResult* r) {
  const int64_t t_num = r->num_tokens, e_num = r->num_experts, k = r->top_k;
  const bool satk = c.score_function == ScoreFunction::kSoftmaxAfterTopK;
  const float* select_src = satk ? r->noisy_logits.data<float>() : r->scores.data<float>();
  std::vector<float> select;
  if (c.expert_bias) {
    select.assign(select_src, select_src + t_num * e_num);
    const float* b = expert_bias.data<float>();
    for (int64_t t = 0; t < t_num; ++t) {
      for (int64_t e = 0; e < e_num; ++e) select[static_cast<size_t>(t * e_num + e)] += b[e];
    }
    select_src = select.data();
  }
  const size_t tk = static_cast<size_t>(t_num * k);
  r->experts.resize(tk);
  std::vector<float> topv(tk);
  if (!options.forced_experts.empty()) {
    CheckForcedExperts(options.forced_experts, t_num, k, e_num);
    r->experts.assign(options.forced_experts.begin(), options.forced_experts.end());
  } else if (HasGumbel(c, options.training, k)) {
    // 1st choice as usual; the others are the top-(k-1) of logits + Gumbel, 1st masked out.
    std::vector<int32_t> first(static_cast<size_t>(t_num));
    std::vector<float> firstv(static_cast<size_t>(t_num));
    if (t_num > 0) kernels::TopK(select_src, t_num, e_num, 1, first.data(), firstv.data());
    GumbelChoices(key, options, first, r);
  } else if (GroupLimited(c)) {
    GroupLimitedTopK(c, select_src, t_num, k, r->experts.data());
  } else if (t_num > 0) {
    kernels::TopK(select_src, t_num, e_num, k, r->experts.data(), topv.data());
  }
}

// Gate values: the chosen experts' scores (softmax_after_topk: the softmax over the k chosen
// logits), normalized over the k choices when the config says so.
void GateValues(const LayerConfig& c, GateResult* r) {
  const int64_t t_num = r->num_tokens, e_num = r->num_experts, k = r->top_k;
  const bool satk = c.score_function == ScoreFunction::kSoftmaxAfterTopK;
  const float* nl = r->noisy_logits.data<float>();
  const float* sc = r->scores.data<float>();
  r->choice_scores.resize(static_cast<size_t>(t_num * k));
  for (int64_t t = 0; t < t_num; ++t) {
    float* s = r->choice_scores.data() + t * k;
    const int32_t* ex = r->experts.data() + t * k;
    if (satk) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < k; ++j) mx = std::max(mx, nl[t * e_num + ex[j]]);
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        s[j] = std::exp(nl[t * e_num + ex[j]] - mx);
        sum += s[j];
      }
      for (int64_t j = 0; j < k; ++j) s[j] /= sum;
    } else {
      for (int64_t j = 0; j < k; ++j) s[j] = sc[t * e_num + ex[j]];
    }
  }
  r->gates = r->choice_scores;
  if (c.normalize_gate && k > 1 && !satk) {
    for (int64_t t = 0; t < t_num; ++t) {
      float* g = r->gates.data() + t * k;
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += g[j];
      float denom = std::max(sum, kGateEps);
      for (int64_t j = 0; j < k; ++j) g[j] /= denom;
    }
  }
}

// What routing needs besides the choices: GShard's random routing of the 2nd choice, the routed
// scaling, the sequence of each token (sequence-wise aux loss) and each token's priority (its
// largest score).
void RoutingExtras(const LayerConfig& c, uint64_t key, const GateOptions& options, GateResult* r) {
  const int64_t t_num = r->num_tokens, e_num = r->num_experts, k = r->top_k;
  // GShard random routing: keep the 2nd choice only if 2 * g_2 > U(0, 1).
  r->routed.assign(static_cast<size_t>(t_num * k), 1);
  if (c.random_routing && options.training && k >= 2) {
    CounterRng rng(key, kStreamRandomRouting);
    for (int64_t t = 0; t < t_num; ++t) {
      float u = rng.Uniform(GlobalIndex(options, t));
      if (!(2.0f * r->gates[static_cast<size_t>(t * k + 1)] > u)) {
        r->routed[static_cast<size_t>(t * k + 1)] = 0;
      }
    }
  }
  // DeepSeek-V3's routed scaling, after normalization (as Megatron-Core applies it).
  if (c.topk_scaling_factor != 1.0f) {
    for (float& g : r->gates) g *= c.topk_scaling_factor;
  }
  if (c.aux_loss == AuxLoss::kSequence) {
    r->sequence.resize(static_cast<size_t>(t_num));
    for (int64_t t = 0; t < t_num; ++t) {
      r->sequence[static_cast<size_t>(t)] =
          static_cast<int64_t>(GlobalIndex(options, t)) / c.sequence_length;
    }
  }
  const float* sc = r->scores.data<float>();
  r->priority.resize(static_cast<size_t>(t_num));
  for (int64_t t = 0; t < t_num; ++t) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < e_num; ++e) mx = std::max(mx, sc[t * e_num + e]);
    r->priority[static_cast<size_t>(t)] = mx;
  }
}

}  // namespace

GateResult GateForward(const LayerConfig& c, const Tensor& x, const Tensor& gate_weight,
                       const Tensor& expert_bias, const GateOptions& options) {
  const int64_t m_dim = c.model_dim, e_num = c.num_experts;
  ExpectDType("x", x, DType::kFloat32);
  ExpectShape("x", x, {kAnySize, m_dim});
  ExpectDType("gate.weight", gate_weight, DType::kFloat32);
  ExpectShape("gate.weight", gate_weight, {e_num, m_dim});
  if (c.expert_bias) {
    ExpectDType("gate.expert_bias", expert_bias, DType::kFloat32);
    ExpectShape("gate.expert_bias", expert_bias, {e_num});
  }
  const int64_t t_num = x.size(0);
  CheckTokenIndex(options.token_index, t_num);
  const uint64_t key = StepSeed(c.seed, options.step);

  GateResult r;
  r.num_tokens = t_num;
  r.num_experts = e_num;
  r.top_k = EffectiveTopK(c);
  GateLogits(c, x, gate_weight, key, options, &r);
  GateScores(c, &r);
  SelectExperts(c, expert_bias, key, options, &r);
  GateValues(c, &r);
  RoutingExtras(c, key, options, &r);
  return r;
}

std::vector<float> GateValuesBackward(const LayerConfig& c, const GateResult& gate,
                                      std::span<const float> d_gates) {
  const int64_t k = gate.top_k;
  SY_CHECK(static_cast<int64_t>(d_gates.size()) == gate.num_tokens * k);
  std::vector<float> ds(d_gates.begin(), d_gates.end());
  // g_j = f * n_j with f = topk_scaling_factor: d n_j = f * d g_j.
  if (c.topk_scaling_factor != 1.0f) {
    for (float& d : ds) d *= c.topk_scaling_factor;
  }
  const bool satk = c.score_function == ScoreFunction::kSoftmaxAfterTopK;
  if (!(c.normalize_gate && k > 1 && !satk)) return ds;
  std::vector<float> scaled;
  std::span<const float> dn = d_gates;
  if (c.topk_scaling_factor != 1.0f) {
    scaled = ds;
    dn = scaled;
  }
  for (int64_t t = 0; t < gate.num_tokens; ++t) {
    const float* s = gate.choice_scores.data() + t * k;
    const float* dg = dn.data() + t * k;
    float* out = ds.data() + t * k;
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += s[j];
    if (sum > kGateEps) {
      // n_j = s_j / S: ds_j = (dn_j - sum_i dn_i n_i) / S.
      float dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += dg[j] * (s[j] / sum);
      for (int64_t j = 0; j < k; ++j) out[j] = (dg[j] - dot) / sum;
    } else {
      for (int64_t j = 0; j < k; ++j) out[j] = dg[j] / kGateEps;
    }
  }
  return ds;
}

GateGradients GateBackward(const LayerConfig& c, const GateResult& gate, const Tensor& x,
                           const Tensor& gate_weight, std::span<const float> d_choice_scores,
                           float aux_coef, float z_coef, const GateLossSums* batch_loss_sums) {
  const int64_t t_num = gate.num_tokens, e_num = gate.num_experts, k = gate.top_k;
  const int64_t m_dim = c.model_dim;
  SY_CHECK(static_cast<int64_t>(d_choice_scores.size()) == t_num * k);
  Tensor d_logits = Tensor::Zeros({t_num, e_num});
  float* dl = d_logits.data<float>();
  const float* sc = gate.scores.data<float>();

  if (c.score_function == ScoreFunction::kSoftmaxAfterTopK) {
    // s = softmax over the chosen logits: dl_j = s_j (ds_j - sum_i ds_i s_i).
    for (int64_t t = 0; t < t_num; ++t) {
      const float* s = gate.choice_scores.data() + t * k;
      const float* ds = d_choice_scores.data() + t * k;
      const int32_t* ex = gate.experts.data() + t * k;
      float dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += ds[j] * s[j];
      for (int64_t j = 0; j < k; ++j) dl[t * e_num + ex[j]] += s[j] * (ds[j] - dot);
    }
  } else {
    std::vector<float> d_scores(static_cast<size_t>(t_num * e_num), 0.0f);
    for (int64_t t = 0; t < t_num; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        d_scores[static_cast<size_t>(t * e_num + gate.experts[static_cast<size_t>(t * k + j)])] +=
            d_choice_scores[static_cast<size_t>(t * k + j)];
      }
    }
    if (c.score_function == ScoreFunction::kSoftmax) {
      std::vector<float> tmp(static_cast<size_t>(t_num * e_num));
      kernels::SoftmaxRowsBackward(sc, d_scores.data(), tmp.data(), t_num, e_num);
      for (size_t i = 0; i < tmp.size(); ++i) dl[i] += tmp[i];
    } else {
      for (int64_t i = 0; i < t_num * e_num; ++i) {
        dl[i] += d_scores[static_cast<size_t>(i)] * sc[i] * (1.0f - sc[i]);
      }
    }
  }
  if (batch_loss_sums != nullptr) {
    GateLossesBackward(c, gate, aux_coef, z_coef, d_logits, *batch_loss_sums);
  } else {
    GateLossesBackward(c, gate, aux_coef, z_coef, d_logits);
  }

  GateGradients g;
  g.gate_weight = Tensor::Empty({e_num, m_dim});
  Tensor gate_input = x;
  if (gate.jitter.defined()) {
    gate_input = Tensor::Empty({t_num, m_dim});
    const float* xp = x.data<float>();
    const float* jp = gate.jitter.data<float>();
    float* gp = gate_input.data<float>();
    for (int64_t i = 0; i < t_num * m_dim; ++i) gp[i] = xp[i] * jp[i];
  }
  // dWg [E, M] = d_logits^T [E, T] · x_gate [T, M]
  kernels::Gemm(Trans::kYes, Trans::kNo, e_num, m_dim, t_num, 1.0f, dl, e_num,
                gate_input.data<float>(), m_dim, 0.0f, g.gate_weight.data<float>(), m_dim);
  // dx [T, M] = d_logits [T, E] · Wg [E, M] (times the jitter)
  g.x = Tensor::Empty({t_num, m_dim});
  kernels::Gemm(Trans::kNo, Trans::kNo, t_num, m_dim, e_num, 1.0f, dl, e_num,
                gate_weight.data<float>(), m_dim, 0.0f, g.x.data<float>(), m_dim);
  if (gate.jitter.defined()) {
    float* dx = g.x.data<float>();
    const float* jp = gate.jitter.data<float>();
    for (int64_t i = 0; i < t_num * m_dim; ++i) dx[i] *= jp[i];
  }
  return g;
}

void UpdateExpertBias(std::span<const int64_t> loads, float rate, const Tensor& expert_bias) {
  const auto e_num = static_cast<int64_t>(loads.size());
  ExpectDType("gate.expert_bias", expert_bias, DType::kFloat32);
  ExpectShape("gate.expert_bias", expert_bias, {e_num});
  if (e_num == 0) return;
  // Megatron-Core's get_updated_expert_bias in float32: the counts are a float32 tensor, so the
  // mean is float32(sum) / E rounded once and compared with each float32 count. The sum is exact
  // in double and then rounded as a float32 sum of integers below 2^24 would be.
  double sum = 0;
  for (int64_t l : loads) sum += static_cast<double>(l);
  const float mean = static_cast<float>(sum) / static_cast<float>(e_num);
  float* b = expert_bias.data<float>();
  for (int64_t e = 0; e < e_num; ++e) {
    const float offset = mean - static_cast<float>(loads[static_cast<size_t>(e)]);
    const float sign = offset > 0 ? 1.0f : (offset < 0 ? -1.0f : 0.0f);
    b[e] += sign * rate;
  }
}

}  // namespace switchyard::moe
