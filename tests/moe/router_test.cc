// The Megatron-Core / DeepSeek-V3 router options (docs/moe.md, "Gate" and "Losses") on their own
// terms: the sequence loss against the batch loss it generalizes, and the loss sums of a batch
// split over ranks (as the parallel layer adds them) against the whole batch. The forward values
// and gradients against the plain reference are in layer_test.cc, the layer.json keys in
// config_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/losses.h"
#include "switchyard/moe/router_stats.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

LayerConfig SmallConfig() {
  LayerConfig c;
  c.model_dim = 6, c.hidden_dim = 5, c.num_experts = 4, c.top_k = 2;
  c.capacity_factor = 0;  // no drops
  c.seed = 3;
  return c;
}

Tensor RandomX(int64_t tokens, int64_t m_dim, uint64_t seed) {
  return Tensor::FromVector(
      switchyard::testing::RandomVector(static_cast<size_t>(tokens * m_dim), seed),
      {tokens, m_dim});
}

// One sequence holding the whole batch: the sequence loss is Megatron's batch aux loss
// E / (k T^2) sum_e P_e N_e, which is our gshard_all_choices (its counts are the top k of P, the
// layer's choices when nothing but the scores decides them).
TEST(SequenceLoss, OneSequenceEqualsTheAllChoicesBatchLoss) {
  for (ScoreFunction sf :
       {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid, ScoreFunction::kSoftmaxAfterTopK}) {
    LayerConfig all = SmallConfig();
    all.score_function = sf;
    all.aux_loss = AuxLoss::kGShardAllChoices;
    LayerConfig seq = all;
    seq.aux_loss = AuxLoss::kSequence;
    seq.sequence_length = 10;
    LayerParams params = InitParams(all, 4);
    Tensor x = RandomX(10, all.model_dim, 5);
    float a = MoeLayer(all).Forward(params, x).l_aux;
    float s = MoeLayer(seq).Forward(params, x).l_aux;
    EXPECT_GT(a, 0.5f);
    EXPECT_NEAR(s, a, 1e-6f * a) << ScoreFunctionName(sf);
  }
}

// B sequences: the mean of the per-sequence losses, each of them the loss of that sequence alone;
// the gradient of the gate weight likewise.
TEST(SequenceLoss, IsTheMeanOfTheSequencesAlone) {
  LayerConfig c = SmallConfig();
  c.aux_loss = AuxLoss::kSequence;
  c.sequence_length = 5;
  c.aux_loss_coef = 1.0f;
  LayerParams params = InitParams(c, 4);
  const int64_t b_num = 3, t_num = b_num * c.sequence_length;
  Tensor x = RandomX(t_num, c.model_dim, 6);
  Tensor dy = Tensor::Zeros({t_num, c.model_dim});  // the aux loss alone
  MoeLayer layer(c);
  LayerOutput out = layer.Forward(params, x);
  LayerGradients g = layer.Backward(params, out, dy);
  double mean = 0;
  std::vector<double> dw(static_cast<size_t>(c.num_experts * c.model_dim), 0.0);
  for (int64_t b = 0; b < b_num; ++b) {
    Tensor xb = x.Slice(b * c.sequence_length, (b + 1) * c.sequence_length).Clone();
    ForwardOptions o;
    o.global_token_offset = b * c.sequence_length;
    LayerOutput ob = layer.Forward(params, xb, o);
    LayerGradients gb = layer.Backward(params, ob, dy.Slice(0, c.sequence_length).Clone());
    mean += ob.l_aux / b_num;
    for (size_t i = 0; i < dw.size(); ++i) {
      dw[i] += gb.params.gate_weight.data<float>()[i] / static_cast<double>(b_num);
    }
  }
  EXPECT_NEAR(out.l_aux, mean, 1e-6);
  for (size_t i = 0; i < dw.size(); ++i) {
    EXPECT_NEAR(g.params.gate_weight.data<float>()[i], dw[i], 1e-6) << "gate.weight " << i;
  }
}

// The parallel layer's way: each rank sums its own tokens per sequence of the batch (tokens of
// one sequence on several ranks, as context parallelism holds them), the ranks add the sums, and
// every rank gets the batch's loss and its share of the gradient.
TEST(SequenceLoss, SumsSplitOverRanksEqualTheWholeBatch) {
  LayerConfig c = SmallConfig();
  c.aux_loss = AuxLoss::kSequence;
  c.sequence_length = 4;
  c.num_experts = 8, c.num_groups = 4, c.group_topk = 2;  // choices differ from the aux top k
  const int64_t t_num = 12, base = 40;  // sequences 10, 11, 12 of the global order
  Tensor x = RandomX(t_num, c.model_dim, 7);
  LayerParams params = InitParams(c, 8);
  std::vector<int64_t> all(t_num);
  std::iota(all.begin(), all.end(), base);
  GateResult whole = GateForward(c, x, params.gate_weight, {}, {0, 0, true, all});
  GateLosses want = ComputeGateLosses(c, whole);
  Tensor want_dl = Tensor::Zeros({t_num, c.num_experts});
  GateLossesBackward(c, whole, 1.0f, 0.0f, want_dl);

  // Two ranks, each holding every other token.
  std::vector<std::vector<int64_t>> rows(2), index(2);
  for (int64_t t = 0; t < t_num; ++t) {
    rows[static_cast<size_t>(t % 2)].push_back(t);
    index[static_cast<size_t>(t % 2)].push_back(base + t);
  }
  std::vector<GateResult> part(2);
  std::vector<double> summed;
  for (size_t r = 0; r < 2; ++r) {
    Tensor xr = Tensor::Empty({static_cast<int64_t>(rows[r].size()), c.model_dim});
    for (size_t i = 0; i < rows[r].size(); ++i) {
      std::copy_n(x.data<float>() + rows[r][i] * c.model_dim, c.model_dim,
                  xr.data<float>() + static_cast<int64_t>(i) * c.model_dim);
    }
    part[r] = GateForward(c, xr, params.gate_weight, {}, {0, 0, true, index[r]});
    std::vector<double> v = ComputeGateLossSums(c, part[r], t_num).ToVector();
    if (summed.empty()) summed.assign(v.size(), 0.0);
    ASSERT_EQ(v.size(), summed.size());
    for (size_t i = 0; i < v.size(); ++i) summed[i] += v[i];
  }
  GateLossSums batch = GateLossSums::FromVector(c, summed);
  EXPECT_NEAR(GateLossesFromSums(c, batch).l_aux, want.l_aux, 1e-6);
  for (size_t r = 0; r < 2; ++r) {
    Tensor dl = Tensor::Zeros({static_cast<int64_t>(rows[r].size()), c.num_experts});
    GateLossesBackward(c, part[r], 1.0f, 0.0f, dl, batch);
    for (size_t i = 0; i < rows[r].size(); ++i) {
      for (int64_t e = 0; e < c.num_experts; ++e) {
        EXPECT_NEAR(dl.data<float>()[static_cast<int64_t>(i) * c.num_experts + e],
                    want_dl.data<float>()[rows[r][i] * c.num_experts + e], 1e-7)
            << "rank " << r << " token " << rows[r][i] << " expert " << e;
      }
    }
  }
  EXPECT_THROW(ComputeGateLossSums(c, part[0], 10), InvalidArgument);  // not whole sequences
}

TEST(SequenceLoss, RowsNotWholeSequencesAreAnErrorNamingTheKey) {
  LayerConfig c = SmallConfig();
  c.aux_loss = AuxLoss::kSequence;
  c.sequence_length = 4;
  LayerParams params = InitParams(c, 4);
  try {
    MoeLayer(c).Forward(params, RandomX(6, c.model_dim, 1));
    FAIL() << "6 rows of sequences of 4 were accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sequence_length"), std::string::npos) << e.what();
  }
}

// ---- aux_loss global (Megatron-Core's global_aux_loss) ----

// The plain reference: P from x Wg^T in double (softmax, or the sigmoid normalized per token),
// N_e the tokens whose top k of P holds e, and l = E / (k T^2) sum_e P_e Nbar_e with Nbar =
// (prior + N) / (micro_batches + 1). Returns l; `counts` gets N.
double GlobalLossReference(const LayerConfig& c, const Tensor& x, const std::vector<double>& w,
                           const std::vector<double>& prior, int64_t micro_batches,
                           std::vector<double>* counts = nullptr) {
  const int64_t t_num = x.size(0), e_num = c.num_experts, m_dim = c.model_dim, k = c.top_k;
  std::vector<double> p_sum(static_cast<size_t>(e_num), 0.0), n(static_cast<size_t>(e_num), 0.0);
  for (int64_t t = 0; t < t_num; ++t) {
    std::vector<double> p(static_cast<size_t>(e_num));
    double sum = 0, mx = -1e300;
    for (int64_t e = 0; e < e_num; ++e) {
      double l = 0;
      for (int64_t m = 0; m < m_dim; ++m) {
        l += static_cast<double>(x.data<float>()[t * m_dim + m]) *
             w[static_cast<size_t>(e * m_dim + m)];
      }
      p[static_cast<size_t>(e)] = l;
      mx = std::max(mx, l);
    }
    for (double& v : p) {
      v = c.score_function == ScoreFunction::kSigmoid ? 1.0 / (1.0 + std::exp(-v))
                                                      : std::exp(v - mx);
      sum += v;
    }
    for (double& v : p) v /= sum;
    std::vector<int64_t> order(static_cast<size_t>(e_num));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)];
    });
    for (int64_t j = 0; j < k; ++j) n[static_cast<size_t>(order[static_cast<size_t>(j)])] += 1;
    for (int64_t e = 0; e < e_num; ++e) p_sum[static_cast<size_t>(e)] += p[static_cast<size_t>(e)];
  }
  if (counts != nullptr) *counts = n;
  double l = 0;
  for (int64_t e = 0; e < e_num; ++e) {
    const auto i = static_cast<size_t>(e);
    const double nbar =
        ((prior.empty() ? 0.0 : prior[i]) + n[i]) / static_cast<double>(micro_batches + 1);
    l += p_sum[i] * nbar;
  }
  const auto t = static_cast<double>(t_num);
  return l * static_cast<double>(e_num) / (static_cast<double>(k) * t * t);
}

std::vector<double> Doubles(const Tensor& t) {
  return std::vector<double>(t.data<float>(), t.data<float>() + t.numel());
}

// Three micro-batches of one step, each fed the counts the layer returned for the ones before:
// every micro-batch's loss is the reference with the running mean of the counts, the returned
// counts are the reference's, and the gate gradient equals the reference's central differences
// (the counts pass no gradient). Group-limited routing makes the layer's choices differ from the
// aux routing map, so the counts are not the choices.
TEST(GlobalLoss, RunningMeanOverMicroBatchesAgainstAReferenceWithFiniteDifferences) {
  for (ScoreFunction sf : {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid}) {
    LayerConfig c = SmallConfig();
    c.num_experts = 8, c.num_groups = 4, c.group_topk = 2;
    c.score_function = sf;
    c.aux_loss = AuxLoss::kGlobal;
    c.aux_loss_coef = 1.0f;
    c.z_loss_coef = 0.0f;
    const LayerParams params = InitParams(c, 11);
    const MoeLayer layer(c);
    AuxCountsSoFar so_far;
    std::vector<double> ref_prior;
    for (int64_t mb = 0; mb < 3; ++mb) {
      const Tensor x = RandomX(9, c.model_dim, 20 + static_cast<uint64_t>(mb));
      ForwardOptions o;
      o.aux_counts_so_far = &so_far;
      const LayerOutput out = layer.Forward(params, x, o);
      const std::vector<double> w = Doubles(params.gate_weight);
      std::vector<double> counts;
      const double want = GlobalLossReference(c, x, w, ref_prior, mb, &counts);
      EXPECT_GT(want, 0.5);
      EXPECT_NEAR(out.l_aux, want, 1e-5 * want) << ScoreFunctionName(sf) << " mb " << mb;
      EXPECT_EQ(out.aux_counts, counts) << ScoreFunctionName(sf) << " mb " << mb;
      // The gradient of the loss alone (dy = 0) against central differences of the reference.
      const LayerGradients g = layer.Backward(params, out, Tensor::Zeros(x.shape()));
      const double h = 1e-4;
      for (size_t i = 0; i < w.size(); ++i) {
        std::vector<double> up = w, down = w;
        up[i] += h, down[i] -= h;
        const double fd = (GlobalLossReference(c, x, up, ref_prior, mb) -
                           GlobalLossReference(c, x, down, ref_prior, mb)) /
                          (2 * h);
        EXPECT_NEAR(g.params.gate_weight.data<float>()[i], fd, 1e-5 + 1e-4 * std::abs(fd))
            << ScoreFunctionName(sf) << " mb " << mb << " gate.weight " << i;
      }
      // The next micro-batch sees these counts added.
      if (so_far.counts.empty()) so_far.counts.assign(counts.size(), 0.0);
      if (ref_prior.empty()) ref_prior.assign(counts.size(), 0.0);
      for (size_t e = 0; e < counts.size(); ++e) {
        so_far.counts[e] += out.aux_counts[e];
        ref_prior[e] += counts[e];
      }
      ++so_far.micro_batches;
    }
  }
}

// One micro-batch (no earlier counts): Megatron's global loss is its batch aux loss, which is our
// gshard_all_choices when nothing but the scores decides the choices.
TEST(GlobalLoss, OneMicroBatchEqualsTheAllChoicesBatchLoss) {
  LayerConfig all = SmallConfig();
  all.aux_loss = AuxLoss::kGShardAllChoices;
  LayerConfig global = all;
  global.aux_loss = AuxLoss::kGlobal;
  const LayerParams params = InitParams(all, 4);
  const Tensor x = RandomX(10, all.model_dim, 5);
  const float a = MoeLayer(all).Forward(params, x).l_aux;
  const LayerOutput g = MoeLayer(global).Forward(params, x);
  EXPECT_GT(a, 0.5f);
  EXPECT_NEAR(g.l_aux, a, 1e-6f * a);
  EXPECT_EQ(g.aux_counts.size(), 4u);
  EXPECT_EQ(std::accumulate(g.aux_counts.begin(), g.aux_counts.end(), 0.0), 20.0);  // T k
  EXPECT_TRUE(MoeLayer(all).Forward(params, x).aux_counts.empty());  // other losses: none
}

TEST(GlobalLoss, CountsOfAnotherExpertCountAreAnError) {
  LayerConfig c = SmallConfig();
  c.aux_loss = AuxLoss::kGlobal;
  const LayerParams params = InitParams(c, 4);
  AuxCountsSoFar bad{.counts = {1.0, 2.0, 3.0}, .micro_batches = 1};
  ForwardOptions o;
  o.aux_counts_so_far = &bad;
  try {
    MoeLayer(c).Forward(params, RandomX(4, c.model_dim, 1), o);
    FAIL() << "counts of 3 experts were accepted for 4";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("aux_counts_so_far"), std::string::npos) << e.what();
  }
}

// ---- Routing statistics (router_stats.h) ----

// Two calls on each of two ranks, added as a step adds them (the ranks' vectors summed): the
// statistics of the summed loads, drops, entropy and losses, and the bias range.
TEST(RouterStats, AreThoseOfTheSummedCallsAndRanks) {
  auto call = [](std::vector<int64_t> loads, int64_t dropped, float l_aux, float z, double h) {
    LayerOutput o;
    o.expert_loads = std::move(loads);
    o.dropped = dropped;
    o.l_aux = l_aux;
    o.z_loss = z;
    o.entropy_sum = h;
    return o;
  };
  RouterSums rank0, rank1;
  rank0.Add(call({6, 2, 0, 0}, 1, 1.0f, 0.125f, 3.0), 4);
  rank0.Add(call({1, 1, 2, 0}, 0, 2.0f, 0.25f, 1.0), 2);
  rank1.Add(call({1, 1, 2, 0}, 2, 1.0f, 0.125f, 4.0), 2);
  std::vector<double> v = rank0.ToVector(), w = rank1.ToVector();
  ASSERT_EQ(v.size(), w.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] += w[i];
  const Tensor bias = Tensor::FromVector(std::vector<float>{-0.5f, 0.25f, 0.0f, 0.125f}, {4});
  const RouterStats st = RouterSums::FromVector(v).Stats(bias);
  // Loads {8, 4, 4, 0}: 16 pairs, mean 4, population std sqrt(8).
  EXPECT_EQ(st.num_tokens, 8);
  EXPECT_EQ(st.routed, 16);
  EXPECT_DOUBLE_EQ(st.max_over_mean, 2.0);
  EXPECT_DOUBLE_EQ(st.cv, std::sqrt(8.0) / 4.0);
  EXPECT_EQ(st.min_load, 0);
  EXPECT_EQ(st.max_load, 8);
  EXPECT_DOUBLE_EQ(st.dropped_share, 3.0 / 16.0);
  EXPECT_DOUBLE_EQ(st.entropy, 1.0);  // 8 nats over 8 tokens
  EXPECT_DOUBLE_EQ(st.l_aux, 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(st.z_loss, 0.5 / 3.0);
  EXPECT_EQ(st.bias_min, -0.5);
  EXPECT_EQ(st.bias_max, 0.25);
  EXPECT_EQ(RouterSums{}.Stats().max_over_mean, 0.0);  // nothing routed: no division by zero
}

// The router entropy: log E for a router that cannot tell the experts apart (a zero gate, every
// score function), near 0 for one that is sure, and only computed when asked for.
TEST(RouterStats, EntropyOfTheAuxProbabilities) {
  for (ScoreFunction sf :
       {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid, ScoreFunction::kSoftmaxAfterTopK}) {
    LayerConfig c = SmallConfig();
    c.score_function = sf;
    LayerParams params = InitParams(c, 4);
    std::fill_n(params.gate_weight.data<float>(), params.gate_weight.numel(), 0.0f);
    ForwardOptions o;
    o.entropy = true;
    const Tensor x = RandomX(5, c.model_dim, 2);
    EXPECT_NEAR(MoeLayer(c).Forward(params, x, o).entropy_sum, 5 * std::log(4.0), 1e-6)
        << ScoreFunctionName(sf);
    EXPECT_EQ(MoeLayer(c).Forward(params, x).entropy_sum, 0.0);  // not asked for
    // A gate sure of expert 0 for every token: logit 60 for it, -60 for the others.
    const Tensor ones = Tensor::FromVector(std::vector<float>(5 * 6, 1.0f), {5, 6});
    for (int64_t i = 0; i < params.gate_weight.numel(); ++i) {
      params.gate_weight.data<float>()[i] = i < c.model_dim ? 10.0f : -10.0f;
    }
    EXPECT_LT(MoeLayer(c).Forward(params, ones, o).entropy_sum, 1e-20) << ScoreFunctionName(sf);
  }
}

// ---- Forced routes (replay, Megatron-Core's RouterReplay) ----

bool SameFloats(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::equal(a.data<float>(), a.data<float>() + a.numel(), b.data<float>());
}

// A layer fed its own routes reproduces its run bit for bit (outputs, drops, gradients); fed other
// routes it uses them, with the gate values of the scores at those experts (normalized, scaled).
// DeepSeek-V3's router (sigmoid, groups, bias, scaling) with drops, so that nothing but the
// forced ids decides.
TEST(ForcedRoutes, OwnRoutesReproduceTheRunAndOtherRoutesAreUsed) {
  LayerConfig c = SmallConfig();
  c.num_experts = 8, c.num_groups = 4, c.group_topk = 2;
  c.score_function = ScoreFunction::kSigmoid;
  c.topk_scaling_factor = 2.5f;
  c.expert_bias = true;
  c.capacity_factor = 1.0f;
  LayerParams params = InitParams(c, 9);
  params.expert_bias = Tensor::FromVector(
      std::vector<float>{0.1f, -0.2f, 0.0f, 0.3f, -0.1f, 0.0f, 0.2f, -0.3f}, {8});
  const MoeLayer layer(c);
  const Tensor x = RandomX(16, c.model_dim, 3), dy = RandomX(16, c.model_dim, 4);
  const LayerOutput out = layer.Forward(params, x);
  const LayerGradients g = layer.Backward(params, out, dy);
  ASSERT_GT(out.dropped, 0);
  const std::vector<int32_t> own(out.topk_idx.data<int32_t>(),
                                 out.topk_idx.data<int32_t>() + out.topk_idx.numel());
  ForwardOptions o;
  o.forced_experts = own;
  const LayerOutput again = layer.Forward(params, x, o);
  const LayerGradients g_again = layer.Backward(params, again, dy);
  EXPECT_TRUE(SameFloats(again.y, out.y));
  EXPECT_TRUE(SameFloats(again.combine_weights, out.combine_weights));
  EXPECT_EQ(again.dropped, out.dropped);
  EXPECT_TRUE(SameFloats(g_again.x, g.x));
  EXPECT_TRUE(SameFloats(g_again.params.gate_weight, g.params.gate_weight));
  EXPECT_TRUE(SameFloats(g_again.params.experts.fc1_weight, g.params.experts.fc1_weight));

  std::vector<int32_t> other = own;
  for (int32_t& e : other) e = (e + 3) % 8;
  GateOptions go;
  go.forced_experts = other;
  const GateResult r = GateForward(c, x, params.gate_weight, params.expert_bias, go);
  EXPECT_EQ(r.experts, other);
  for (int64_t t = 0; t < 16; ++t) {
    const float s0 = r.scores.data<float>()[t * 8 + other[static_cast<size_t>(t * 2)]];
    const float s1 = r.scores.data<float>()[t * 8 + other[static_cast<size_t>(t * 2 + 1)]];
    EXPECT_FLOAT_EQ(r.gates[static_cast<size_t>(t * 2)], 2.5f * s0 / (s0 + s1)) << "token " << t;
    EXPECT_FLOAT_EQ(r.gates[static_cast<size_t>(t * 2 + 1)], 2.5f * s1 / (s0 + s1));
  }

  auto error_of = [&](std::vector<int32_t> forced) -> std::string {
    ForwardOptions f;
    f.forced_experts = forced;
    try {
      layer.Forward(params, x, f);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "(accepted)";
  };
  std::vector<int32_t> bad = own;
  bad[5] = 8;
  EXPECT_NE(error_of(bad).find("forced_experts: token 2 choice 1 is expert 8"), std::string::npos)
      << error_of(bad);
  bad = own;
  bad[1] = bad[0];
  EXPECT_NE(error_of(bad).find("chooses expert"), std::string::npos) << error_of(bad);
  bad.pop_back();
  EXPECT_NE(error_of(bad).find("expected [16, 2]"), std::string::npos) << error_of(bad);
}

// Megatron-Core's get_updated_expert_bias: bias + rate * sign(mean load - load), the mean over
// the experts of the step's global counts.
TEST(ExpertBiasUpdate, FollowsTheSignOfTheLoadBelowTheMean) {
  Tensor bias = Tensor::FromVector(std::vector<float>{0.1f, 0.0f, -0.2f}, {3});
  UpdateExpertBias(std::vector<int64_t>{7, 1, 4}, 0.25f, bias);  // mean 4
  const float* b = bias.data<float>();
  EXPECT_FLOAT_EQ(b[0], 0.1f - 0.25f);
  EXPECT_FLOAT_EQ(b[1], 0.0f + 0.25f);
  EXPECT_FLOAT_EQ(b[2], -0.2f);  // at the mean: unchanged
}

}  // namespace
}  // namespace switchyard::moe
