#include "moe/reference_moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>

#include "switchyard/core/rng.h"
#include "switchyard/moe/gate.h"

namespace switchyard::moe::testing {
namespace {

constexpr double kEps = 1.1920928955078125e-07;  // torch.finfo(float32).eps

double Act(kernels::Activation a, double x) {
  switch (a) {
    case kernels::Activation::kRelu: return x > 0 ? x : 0;
    case kernels::Activation::kGelu: return 0.5 * x * (1 + std::erf(x / std::numbers::sqrt2));
    case kernels::Activation::kSilu: return x / (1 + std::exp(-x));
    case kernels::Activation::kIdentity: return x;
  }
  return x;
}

// One FFN (expert, residual MLP or shared expert) on one row: docs/moe.md, "Dispatch, experts,
// combine".
std::vector<double> Ffn(const LayerConfig& c, const RefParams& p, const std::string& prefix,
                        int64_t index, int64_t hidden, const std::vector<double>& in) {
  const int64_t m = c.model_dim;
  const auto& w1 = p.at(prefix + "fc1.weight");
  const auto& w2 = p.at(prefix + "fc2.weight");
  std::vector<double> h(static_cast<size_t>(hidden)), out(static_cast<size_t>(m));
  for (int64_t i = 0; i < hidden; ++i) {
    double a = c.fc_bias ? p.at(prefix + "fc1.bias")[static_cast<size_t>(index * hidden + i)] : 0;
    for (int64_t j = 0; j < m; ++j) {
      a += in[static_cast<size_t>(j)] * w1[static_cast<size_t>((index * hidden + i) * m + j)];
    }
    double v = Act(c.activation, a);
    if (c.gated) {
      const auto& w3 = p.at(prefix + "fc3.weight");
      double b = 0;
      for (int64_t j = 0; j < m; ++j) {
        b += in[static_cast<size_t>(j)] * w3[static_cast<size_t>((index * hidden + i) * m + j)];
      }
      v *= b;
    }
    h[static_cast<size_t>(i)] = v;
  }
  for (int64_t j = 0; j < m; ++j) {
    double a = c.fc_bias ? p.at(prefix + "fc2.bias")[static_cast<size_t>(index * m + j)] : 0;
    for (int64_t i = 0; i < hidden; ++i) {
      a += h[static_cast<size_t>(i)] * w2[static_cast<size_t>((index * m + j) * hidden + i)];
    }
    out[static_cast<size_t>(j)] = a;
  }
  return out;
}

std::vector<double> Softmax(const std::vector<double>& v) {
  double mx = *std::max_element(v.begin(), v.end());
  std::vector<double> out(v.size());
  double s = 0;
  for (size_t i = 0; i < v.size(); ++i) s += out[i] = std::exp(v[i] - mx);
  for (double& o : out) o /= s;
  return out;
}

// Indices of the k largest values, descending; ties to the lower index.
std::vector<int32_t> TopIndices(const std::vector<double>& v, int64_t k) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

double Cv2(const std::vector<double>& v) {
  double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  double var = 0;
  for (double x : v) var += (x - mean) * (x - mean);
  var /= static_cast<double>(v.size()) - 1;
  return var / (mean * mean + 1e-10);
}

}  // namespace

std::vector<double> ToDoubles(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.At(i);
  return v;
}

RefParams ToRefParams(const NamedTensors& tensors) {
  RefParams p;
  for (const auto& [name, t] : tensors) p[name] = ToDoubles(t);
  return p;
}

RefOutput ReferenceForward(const LayerConfig& c, const RefParams& p, const std::vector<double>& x,
                           int64_t T, const RefOptions& o) {
  const int64_t M = c.model_dim, E = c.num_experts, k = std::min(c.top_k, c.num_experts);
  const uint64_t key = StepSeed(c.seed, o.step);
  auto gidx = [&](int64_t t) { return static_cast<uint64_t>(o.global_token_offset + t); };
  const bool satk = c.score_function == ScoreFunction::kSoftmaxAfterTopK;
  RefOutput out;

  // ---- §1.1 gate ----
  std::vector<std::vector<double>> logits(T, std::vector<double>(E));
  std::vector<std::vector<double>> noisy(T, std::vector<double>(E));
  std::vector<std::vector<double>> scores(T, std::vector<double>(E));
  const auto& wg = p.at("gate.weight");
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> xin(x.begin() + t * M, x.begin() + (t + 1) * M);
    if (o.training && c.noise == NoiseKind::kJitter) {
      // Jitter element m of token g: lane m % 4 of draw g * ceil(M / 4) + m / 4.
      CounterRng rng(key, kStreamGateJitter);
      int64_t quads = (M + 3) / 4;
      for (int64_t m = 0; m < M; ++m) {
        auto bits = rng.Bits(gidx(t) * quads + m / 4);
        double u = BitsToOpenUnit(bits[m % 4]);
        xin[m] *= (1.0 - c.jitter_eps) + 2.0 * c.jitter_eps * u;
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      double l = 0;
      for (int64_t m = 0; m < M; ++m) l += xin[m] * wg[e * M + m];
      logits[t][e] = noisy[t][e] = l;
      if (o.training && c.noise == NoiseKind::kTutelNormal) {
        CounterRng rng(key, kStreamGateNoise);
        noisy[t][e] += c.noise_std * rng.Normal(gidx(t) * E + e) / static_cast<double>(E);
      }
    }
    if (c.score_function == ScoreFunction::kSigmoid) {
      for (int64_t e = 0; e < E; ++e) scores[t][e] = 1 / (1 + std::exp(-noisy[t][e]));
    } else {
      scores[t] = Softmax(noisy[t]);
    }
  }
  std::vector<std::vector<int32_t>> chosen(T);
  std::vector<std::vector<double>> s(T), g(T);
  std::vector<std::vector<bool>> routed(T, std::vector<bool>(k, true));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> sel = satk ? noisy[t] : scores[t];
    if (c.expert_bias) {
      for (int64_t e = 0; e < E; ++e) sel[e] += p.at("gate.expert_bias")[e];
    }
    if (o.training && c.noise == NoiseKind::kGumbelSecond && k >= 2) {
      int32_t first = TopIndices(sel, 1)[0];
      std::vector<double> gum(E);
      CounterRng rng(key, kStreamGumbel);
      for (int64_t e = 0; e < E; ++e) gum[e] = noisy[t][e] + rng.Gumbel(gidx(t) * E + e);
      gum[first] = -std::numeric_limits<double>::infinity();
      chosen[t] = {first};
      for (int32_t e : TopIndices(gum, k - 1)) chosen[t].push_back(e);
    } else if (c.group_topk > 0) {
      // Group-limited: groups of E / G contiguous experts, scored by the sum of their top
      // k / group_topk values; the top k among the experts of the group_topk best groups.
      const int64_t per = E / c.num_groups;
      std::vector<double> group_score(c.num_groups, 0.0);
      for (int64_t gi = 0; gi < c.num_groups; ++gi) {
        std::vector<double> part(sel.begin() + gi * per, sel.begin() + (gi + 1) * per);
        for (int32_t e : TopIndices(part, k / c.group_topk)) group_score[gi] += part[e];
      }
      std::vector<double> masked(E, -std::numeric_limits<double>::infinity());
      for (int32_t gi : TopIndices(group_score, c.group_topk)) {
        for (int64_t e = gi * per; e < (gi + 1) * per; ++e) masked[e] = sel[e];
      }
      chosen[t] = TopIndices(masked, k);
    } else {
      chosen[t] = TopIndices(sel, k);
    }
    if (satk) {
      std::vector<double> l;
      for (int32_t e : chosen[t]) l.push_back(noisy[t][e]);
      s[t] = Softmax(l);
    } else {
      for (int32_t e : chosen[t]) s[t].push_back(scores[t][e]);
    }
    g[t] = s[t];
    if (c.normalize_gate && k > 1 && !satk) {
      double sum = std::accumulate(s[t].begin(), s[t].end(), 0.0);
      for (double& v : g[t]) v /= std::max(sum, kEps);
    }
    if (c.random_routing && o.training && k >= 2) {
      CounterRng rng(key, kStreamRandomRouting);
      routed[t][1] = 2 * g[t][1] > rng.Uniform(gidx(t));
    }
    for (double& v : g[t]) v *= c.topk_scaling_factor;
  }

  // ---- §1.2 slots: cumsum of one-hot masks over the (possibly prioritized) token order ----
  std::vector<int64_t> order(T);
  std::iota(order.begin(), order.end(), 0);
  if (c.batch_prioritized_routing) {
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return *std::max_element(scores[a].begin(), scores[a].end()) >
             *std::max_element(scores[b].begin(), scores[b].end());
    });
  }
  std::vector<std::vector<int64_t>> loc(T, std::vector<int64_t>(k, -1));
  std::vector<int64_t> load(E, 0);
  if (c.slot_order == SlotOrder::kChoiceMajor) {
    std::vector<int64_t> before(E, 0);  // per-expert count of earlier choices
    for (int64_t j = 0; j < k; ++j) {
      std::vector<int64_t> cumsum(E, 0);
      for (int64_t t : order) {
        if (!routed[t][j]) continue;
        int32_t e = chosen[t][j];
        cumsum[e] += 1;
        loc[t][j] = cumsum[e] - 1 + before[e];
      }
      for (int64_t e = 0; e < E; ++e) before[e] += cumsum[e];
    }
    load = before;
  } else {
    for (int64_t t : order) {
      for (int64_t j = 0; j < k; ++j) {
        if (!routed[t][j]) continue;
        loc[t][j] = load[chosen[t][j]]++;
      }
    }
  }
  int64_t max_load = *std::max_element(load.begin(), load.end());

  // Capacity.
  int64_t C;
  if (c.dropless) {
    C = max_load;
  } else if (c.capacity) {
    C = *c.capacity;
  } else {
    int64_t ml = o.global_max_load.value_or(max_load);
    auto formula = [&](double cf) -> int64_t {
      if (c.capacity_formula == CapacityFormula::kDeepSpeed) {
        float v = static_cast<float>(static_cast<double>(T) / E) * static_cast<float>(cf * k);
        return static_cast<int64_t>(std::ceil(v));
      }
      int64_t spe = (T + E - 1) / E;
      return k * static_cast<int64_t>(std::floor(cf * spe));
    };
    if (c.capacity_factor > 0) {
      C = formula(c.capacity_factor);
    } else if (c.capacity_factor == 0) {
      C = ml;
    } else {
      C = std::min(ml, formula(-c.capacity_factor));
    }
    C = std::max(C, c.min_capacity);
  }
  if (!c.dropless && C % c.alignment) C += c.alignment - C % c.alignment;
  out.capacity = C;

  // Drops: survivors per expert by policy, then compacted locations.
  std::vector<std::vector<bool>> kept(T, std::vector<bool>(k, false));
  for (int64_t e = 0; e < E; ++e) {
    std::vector<std::pair<int64_t, int64_t>> pairs;  // (t, j) in location order
    for (int64_t l = 0; l < load[e]; ++l) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < k; ++j) {
          if (chosen[t][j] == e && loc[t][j] == l) pairs.emplace_back(t, j);
        }
      }
    }
    auto prio = [&](std::pair<int64_t, int64_t> tj) -> double {
      if (c.drop_policy == DropPolicy::kProbs) return s[tj.first][tj.second];
      CounterRng rng(key, kStreamDropPriority);
      return rng.Uniform(gidx(tj.first));
    };
    std::vector<size_t> rank(pairs.size());
    std::iota(rank.begin(), rank.end(), 0);
    if (c.drop_policy != DropPolicy::kPosition) {
      std::stable_sort(rank.begin(), rank.end(),
                       [&](size_t a, size_t b) { return prio(pairs[a]) > prio(pairs[b]); });
    }
    int64_t n_keep = c.dropless ? load[e] : std::min<int64_t>(load[e], C);
    for (int64_t r = 0; r < n_keep; ++r) kept[pairs[rank[r]].first][pairs[rank[r]].second] = true;
    int64_t next = 0;
    for (auto [t, j] : pairs) loc[t][j] = kept[t][j] ? next++ : -1;
  }

  // Combine weights.
  std::vector<std::vector<double>> w(T, std::vector<double>(k, 0.0));
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      if (kept[t][j]) sum += g[t][j];
    }
    for (int64_t j = 0; j < k; ++j) {
      if (!kept[t][j]) continue;
      w[t][j] = (c.renormalize_after_drop && k > 1) ? g[t][j] / std::max(sum, kEps) : g[t][j];
    }
  }

  // ---- §1.3 einsum form: dispatch mask D[t, e, c] and combine weights W[t, e, c] ----
  auto at = [&](int64_t t, int64_t e, int64_t cc) { return (t * E + e) * C + cc; };
  std::vector<double> D(static_cast<size_t>(T * E * C), 0.0), W(D.size(), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      if (!kept[t][j]) continue;
      D[at(t, chosen[t][j], loc[t][j])] = 1;
      W[at(t, chosen[t][j], loc[t][j])] = w[t][j];
    }
  }
  const auto& in_mask = c.prescore ? W : D;   // expert_in = einsum('tec,tm->ecm')
  const auto& out_mask = c.prescore ? D : W;  // y = einsum('tec,ecm->tm')
  std::vector<double> y(static_cast<size_t>(T * M), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t cc = 0; cc < C; ++cc) {
      std::vector<double> xin(M, 0.0);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t m = 0; m < M; ++m) xin[m] += in_mask[at(t, e, cc)] * x[t * M + m];
      }
      std::vector<double> eo = Ffn(c, p, "experts.", e, c.hidden_dim, xin);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t m = 0; m < M; ++m) y[t * M + m] += out_mask[at(t, e, cc)] * eo[m];
      }
    }
  }

  // ---- §1.5 variants ----
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> xt(x.begin() + t * M, x.begin() + (t + 1) * M);
    if (c.residual_moe) {
      std::vector<double> mlp = Ffn(c, p, "residual_mlp.", 0, c.hidden_dim, xt);
      std::vector<double> cl(2);
      for (int64_t i = 0; i < 2; ++i) {
        cl[i] = c.fc_bias ? p.at("coefficient.bias")[i] : 0;
        for (int64_t m = 0; m < M; ++m) cl[i] += xt[m] * p.at("coefficient.weight")[i * M + m];
      }
      std::vector<double> cf = Softmax(cl);
      for (int64_t m = 0; m < M; ++m) y[t * M + m] = y[t * M + m] * cf[0] + mlp[m] * cf[1];
    }
    if (c.shared_expert_hidden > 0) {
      std::vector<double> sh = Ffn(c, p, "shared_experts.", 0, c.shared_expert_hidden, xt);
      for (int64_t m = 0; m < M; ++m) y[t * M + m] += sh[m];
    }
  }
  out.y = y;

  // ---- §1.4 losses ----
  // Aux probabilities: softmax (softmax, softmax_after_topk) or sigmoid normalized per token.
  auto aux_p = [&](const std::vector<double>& l) {
    if (c.score_function != ScoreFunction::kSigmoid) return Softmax(l);
    std::vector<double> v(l.size());
    double sum = 0;
    for (size_t i = 0; i < l.size(); ++i) sum += v[i] = 1 / (1 + std::exp(-l[i]));
    for (double& q : v) q /= sum;
    return v;
  };
  if (T > 0) {
    if (c.aux_loss == AuxLoss::kGShard || c.aux_loss == AuxLoss::kGShardAllChoices) {
      int64_t choices = c.aux_loss == AuxLoss::kGShard ? 1 : k;
      std::vector<double> me(E, 0.0), ce(E, 0.0);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> pt = aux_p(noisy[t]);
        for (int64_t e = 0; e < E; ++e) me[e] += pt[e] / T;
        for (int64_t j = 0; j < choices; ++j) ce[chosen[t][j]] += 1.0 / T;
      }
      for (int64_t e = 0; e < E; ++e) out.l_aux += me[e] * ce[e];
      out.l_aux *= static_cast<double>(E) / static_cast<double>(choices);
    } else if (c.aux_loss == AuxLoss::kImportanceLoad) {
      std::vector<double> imp(E, 0.0), ld(E, 0.0);
      double sigma = c.noise_std / static_cast<double>(E);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> pc = aux_p(logits[t]);
        double thr = noisy[t][chosen[t][k - 1]];
        for (int64_t e = 0; e < E; ++e) {
          imp[e] += pc[e];
          ld[e] += 0.5 * std::erfc(-(pc[e] - thr) / sigma / std::numbers::sqrt2);
        }
      }
      out.l_aux = (Cv2(imp) + Cv2(ld)) / 2;
    } else if (c.aux_loss == AuxLoss::kSequence) {
      // Rows [b * S, (b + 1) * S) are sequence b; per sequence E / (k S^2) sum_e P_be N_be with
      // N_be counting the tokens whose top k of P holds e; the mean over sequences.
      const int64_t S = c.sequence_length, B = T / S;
      for (int64_t b = 0; b < B; ++b) {
        std::vector<double> pe(E, 0.0), ne(E, 0.0);
        for (int64_t t = b * S; t < (b + 1) * S; ++t) {
          std::vector<double> pt = aux_p(noisy[t]);
          for (int64_t e = 0; e < E; ++e) pe[e] += pt[e];
          for (int32_t e : TopIndices(pt, k)) ne[e] += 1;
        }
        for (int64_t e = 0; e < E; ++e) {
          out.l_aux += static_cast<double>(E) / (k * S * S) * pe[e] * ne[e] / B;
        }
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      double mx = *std::max_element(logits[t].begin(), logits[t].end());
      double sum = 0;
      for (double l : logits[t]) sum += std::exp(l - mx);
      double lse = mx + std::log(sum);
      out.z_loss += lse * lse / T;
    }
  }

  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      out.topk.push_back(chosen[t][j]);
      out.locations.push_back(static_cast<int32_t>(loc[t][j]));
      out.gates.push_back(g[t][j]);
      out.weights.push_back(w[t][j]);
    }
  }
  return out;
}

double ReferenceObjective(const LayerConfig& config, const RefParams& params,
                          const std::vector<double>& x, int64_t num_tokens,
                          const std::vector<double>& dy, const RefOptions& options) {
  RefOutput r = ReferenceForward(config, params, x, num_tokens, options);
  double obj = 0;
  for (size_t i = 0; i < r.y.size(); ++i) obj += r.y[i] * dy[i];
  return obj + config.aux_loss_coef * r.l_aux + config.z_loss_coef * r.z_loss;
}

}  // namespace switchyard::moe::testing
