// The Hugging Face families' routers and their load-balancing loss, against plain references
// written from the modeling code (Mixtral, Qwen2-MoE, OLMoE):
//   routing_weights = softmax(router_logits, dim=-1, float32)
//   routing_weights, selected = topk(routing_weights, top_k)
//   if norm_topk_prob (Mixtral: always): routing_weights /= routing_weights.sum(-1)
// and load_balancing_loss_func over the router logits of all layers concatenated.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/router_load_loss.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

Tensor Random(int64_t rows, int64_t cols, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v = switchyard::testing::RandomVector(static_cast<size_t>(rows * cols), seed);
  for (float& x : v) x *= scale;
  return Tensor::FromVector(v, {rows, cols});
}

std::vector<double> Softmax(const float* row, int64_t n) {
  double mx = *std::max_element(row, row + n), sum = 0;
  std::vector<double> p(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) sum += (p[e] = std::exp(row[e] - mx));
  for (double& x : p) x /= sum;
  return p;
}

// Indices of the k largest (ties: lower index), as torch.topk on distinct values.
std::vector<int> TopK(const std::vector<double>& p, int64_t k) {
  std::vector<int> idx(p.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return p[a] > p[b]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// The families' routers as gate configurations (docs/models.md): norm_topk_prob false is the
// softmax score function without normalize_gate; norm_topk_prob true (Mixtral always) is
// softmax_after_topk, for every k — normalize_gate alone leaves k = 1 unnormalized (g = p, where
// Hugging Face's renormalization gives 1), so it equals the family's router only for k > 1.
// Dropless routes every choice.
struct RouterCase {
  ScoreFunction score;
  bool normalize_gate;
  bool norm_topk_prob;  // what Hugging Face computes
};

TEST(HfRouter, SoftmaxTopKRenormalizedByNormTopkProb) {
  const int64_t tokens = 9, m_dim = 5, e_num = 6;
  const RouterCase cases[] = {{ScoreFunction::kSoftmax, false, false},
                              {ScoreFunction::kSoftmaxAfterTopK, true, true},
                              {ScoreFunction::kSoftmax, true, true}};
  for (int64_t k : {1, 2, 4}) {
    for (const RouterCase& rc : cases) {
      if (rc.score == ScoreFunction::kSoftmax && rc.normalize_gate && k == 1) continue;
      const bool norm_topk_prob = rc.norm_topk_prob;
      LayerConfig c;
      c.model_dim = m_dim, c.hidden_dim = 4, c.num_experts = e_num, c.top_k = k;
      c.score_function = rc.score;
      c.normalize_gate = rc.normalize_gate;
      c.dropless = true;
      c.aux_loss = AuxLoss::kNone;
      c.fc_bias = false;
      c.gated = true;
      c.activation = kernels::Activation::kSilu;
      ValidateConfig(c);
      Tensor x = Random(tokens, m_dim, 1), w = Random(e_num, m_dim, 2);
      GateOptions opt;
      opt.training = false;
      GateResult g = GateForward(c, x, w, Tensor(), opt);
      for (int64_t t = 0; t < tokens; ++t) {
        std::vector<float> logits(static_cast<size_t>(e_num));
        for (int64_t e = 0; e < e_num; ++e) {
          double s = 0;
          for (int64_t j = 0; j < m_dim; ++j) {
            s += double(x.data<float>()[t * m_dim + j]) * w.data<float>()[e * m_dim + j];
          }
          logits[e] = static_cast<float>(s);
        }
        std::vector<double> p = Softmax(logits.data(), e_num);
        std::vector<int> top = TopK(p, k);
        double sum = 0;
        for (int e : top) sum += p[e];
        for (int64_t j = 0; j < k; ++j) {
          ASSERT_EQ(g.experts[t * k + j], top[j]) << "token " << t << " choice " << j;
          double want = norm_topk_prob ? p[top[j]] / sum : p[top[j]];
          EXPECT_NEAR(g.gates[t * k + j], want, 1e-6)
              << "k " << k << " norm_topk_prob " << norm_topk_prob << " score "
              << ScoreFunctionName(rc.score);
        }
      }
    }
  }
}

// load_balancing_loss_func written out: concatenate, softmax, top-k one-hot, means, E * sum.
double ReferenceLoss(const std::vector<Tensor>& layers, int64_t k) {
  const int64_t e_num = layers[0].size(1);
  std::vector<double> frac(static_cast<size_t>(e_num), 0.0), prob(frac);
  double rows = 0;
  for (const Tensor& l : layers) {
    for (int64_t t = 0; t < l.size(0); ++t) {
      std::vector<double> p = Softmax(l.data<float>() + t * e_num, e_num);
      for (int e : TopK(p, k)) frac[e] += 1;
      for (int64_t e = 0; e < e_num; ++e) prob[e] += p[e];
      rows += 1;
    }
  }
  double acc = 0;
  for (int64_t e = 0; e < e_num; ++e) acc += (frac[e] / rows) * (prob[e] / rows);
  return acc * e_num;
}

TEST(HfLoadBalancingLoss, ConcatenatedLayersMatchTheReference) {
  const int64_t e_num = 8;
  for (int64_t k : {1, 2, 3}) {
    std::vector<Tensor> layers = {Random(7, e_num, 3, 2.0f), Random(7, e_num, 4, 0.5f),
                                  Random(7, e_num, 5, 4.0f)};
    const double got = RouterLoadLoss(layers, k);
    EXPECT_NEAR(got, ReferenceLoss(layers, k), 1e-6) << "k " << k;
    // Not the mean of per-layer losses: the concatenation's cross terms count.
    double mean = 0;
    for (const Tensor& l : layers) mean += ReferenceLoss({l}, k) / 3;
    EXPECT_GT(std::abs(got - mean), 1e-4) << "k " << k;
  }
}

TEST(HfLoadBalancingLoss, UniformRoutingGivesTopK) {
  for (int64_t k : {1, 2, 5}) {
    std::vector<Tensor> layers = {Tensor::Zeros({6, 8}), Tensor::Zeros({4, 8})};
    EXPECT_DOUBLE_EQ(RouterLoadLoss(layers, k), static_cast<double>(k));
  }
}

// Rows split over ranks (or layers over pipeline stages): adding the parts' sums (an all-reduce
// of ToVector) gives the loss of the whole, and each part's gradient is its rows of the whole's.
TEST(HfLoadBalancingLoss, PartsAddUpAndGradientsMatchFiniteDifferences) {
  const int64_t e_num = 5, k = 2;
  Tensor a = Random(6, e_num, 7, 2.0f), b = Random(4, e_num, 8, 2.0f);
  RouterLoadSums total = ComputeRouterLoadSums(a, k);
  std::vector<double> v = ComputeRouterLoadSums(b, k).ToVector();
  total.Add(RouterLoadSums::FromVector(e_num, k, v));
  const std::vector<Tensor> both = {a, b};
  EXPECT_NEAR(RouterLoadLoss(total), RouterLoadLoss(both, k), 1e-12);
  EXPECT_NEAR(RouterLoadLoss(total), ReferenceLoss(both, k), 1e-6);

  const float coef = 0.7f;
  for (Tensor* part : {&a, &b}) {
    Tensor d = Tensor::Zeros(part->shape());
    RouterLoadLossBackward(*part, total, coef, d);
    for (int64_t i = 0; i < part->numel(); ++i) {
      float* p = part->data<float>() + i;
      const float saved = *p;
      const double eps = 1e-3;
      *p = saved + static_cast<float>(eps);
      const double plus = ReferenceLoss({a, b}, k);
      *p = saved - static_cast<float>(eps);
      const double minus = ReferenceLoss({a, b}, k);
      *p = saved;
      const double fd = coef * (plus - minus) / (2 * eps);
      EXPECT_NEAR(d.data<float>()[i], fd, 1e-4 + 1e-2 * std::abs(fd)) << "element " << i;
    }
  }
}

// x [T, M] -> x W^T [T, E] (the router logits).
Tensor RouterLogits(const Tensor& x, const Tensor& w) {
  const int64_t t_num = x.size(0), m_dim = x.size(1), e_num = w.size(0);
  Tensor l = Tensor::Zeros({t_num, e_num});
  for (int64_t t = 0; t < t_num; ++t) {
    for (int64_t e = 0; e < e_num; ++e) {
      double acc = 0;
      for (int64_t i = 0; i < m_dim; ++i) {
        acc += static_cast<double>(x.data<float>()[t * m_dim + i]) * w.data<float>()[e * m_dim + i];
      }
      l.data<float>()[t * e_num + e] = static_cast<float>(acc);
    }
  }
  return l;
}

// aux_loss hf_concat in the MoE layer: two layers' calls are parts of one concatenation. Each
// reports its sums (those of its logits x Wg^T), alone its l_aux is Hugging Face's loss of its
// rows, and its Backward given the concatenation's sums differentiates coef x the
// concatenation's loss: with dy = 0 the gate weight's and the input's gradients match central
// differences of ReferenceLoss over both layers' logits (both router families).
TEST(HfLoadBalancingLoss, MoeLayerBackwardDifferentiatesTheConcatenation) {
  for (ScoreFunction score : {ScoreFunction::kSoftmax, ScoreFunction::kSoftmaxAfterTopK}) {
    LayerConfig c;
    c.model_dim = 6;
    c.hidden_dim = 4;
    c.num_experts = 5;
    c.top_k = 2;
    c.score_function = score;
    c.normalize_gate = false;
    c.dropless = true;
    c.capacity_factor = 0;
    c.aux_loss = AuxLoss::kHfConcat;
    c.aux_loss_coef = 0.7f;
    const MoeLayer layer(c);
    LayerParams p[2] = {InitParams(c, 11), InitParams(c, 12)};
    for (LayerParams& q : p) {  // logits of a few units: distinct top k
      for (int64_t i = 0; i < q.gate_weight.numel(); ++i) q.gate_weight.data<float>()[i] *= 8.0f;
    }
    Tensor x[2] = {Random(7, c.model_dim, 21), Random(4, c.model_dim, 22)};
    LayerOutput out[2];
    RouterLoadSums total(c.num_experts, c.top_k);
    for (int l = 0; l < 2; ++l) {
      out[l] = layer.Forward(p[l], x[l]);
      const Tensor logits = RouterLogits(x[l], p[l].gate_weight);
      const RouterLoadSums want = ComputeRouterLoadSums(logits, c.top_k);
      ASSERT_EQ(out[l].concat_sums.num_rows, want.num_rows);
      EXPECT_EQ(out[l].concat_sums.choices, want.choices);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        EXPECT_NEAR(out[l].concat_sums.probs[e], want.probs[e], 1e-5);
      }
      EXPECT_NEAR(out[l].l_aux, ReferenceLoss({logits}, c.top_k), 1e-5);
      total.Add(out[l].concat_sums);
    }
    auto objective = [&]() {
      return c.aux_loss_coef * ReferenceLoss({RouterLogits(x[0], p[0].gate_weight),
                                              RouterLogits(x[1], p[1].gate_weight)},
                                             c.top_k);
    };
    for (int l = 0; l < 2; ++l) {
      const LayerGradients g = layer.Backward(p[l], out[l], Tensor::Zeros(x[l].shape()), 1, &total);
      for (auto [value, grad] :
           {std::pair{&p[l].gate_weight, &g.params.gate_weight}, std::pair{&x[l], &g.x}}) {
        for (int64_t i = 0; i < value->numel(); i += 3) {
          float* v = value->data<float>() + i;
          const float saved = *v;
          const double eps = 1e-3;
          *v = saved + static_cast<float>(eps);
          const double plus = objective();
          *v = saved - static_cast<float>(eps);
          const double minus = objective();
          *v = saved;
          const double fd = (plus - minus) / (2 * eps);
          EXPECT_NEAR(grad->data<float>()[i], fd, 2e-4 + 1e-2 * std::abs(fd))
              << "layer " << l << " element " << i;
        }
      }
    }
  }
}

TEST(HfLoadBalancingLoss, BadArgumentsAreNamed) {
  EXPECT_THROW(ComputeRouterLoadSums(Tensor::Zeros({3, 4}), 5), InvalidArgument);
  EXPECT_THROW(ComputeRouterLoadSums(Tensor::Zeros({3, 4}), 0), InvalidArgument);
  RouterLoadSums s(4, 2);
  EXPECT_THROW(s.Add(RouterLoadSums(5, 2)), InvalidArgument);
  EXPECT_THROW(RouterLoadSums::FromVector(4, 2, std::vector<double>(8)), InvalidArgument);
  try {
    ComputeRouterLoadSums(Tensor::Zeros({3, 4}), 5);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts_per_tok 5"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace switchyard::moe
