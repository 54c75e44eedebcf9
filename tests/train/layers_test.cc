// Per-piece checks of the dense transformer pieces: forward against plain loops, backward
// against finite differences of L = sum(y * r) for a fixed random r.
#include "switchyard/train/layers.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "switchyard/train/feed_forward.h"
#include "testing/random.h"
#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using testing::CheckGradient;
using testing::Dot;
using testing::RandomTensor;

// Sets every parameter of `params` to U(-scale, scale) (init_std 0.02 makes gradients tiny).
void Randomize(ParameterSet& params, float scale, uint64_t seed) {
  for (auto& p : params.all()) {
    p.value.CopyFrom(RandomTensor(p.value.shape(), seed++, -scale, scale));
  }
}

TEST(LinearTest, ForwardMatchesLoops) {
  ParameterSet params;
  Linear lin(params, "fc.", 5, 3, true, 0.5f, 1);
  Randomize(params, 0.5f, 7);
  Tensor x = RandomTensor({4, 5}, 2);
  Tensor y = lin.Forward(x);
  ASSERT_EQ(y.shape(), (Shape{4, 3}));
  const float* w = params.Get("fc.weight").value.data<float>();
  const float* b = params.Get("fc.bias").value.data<float>();
  for (int i = 0; i < 4; ++i) {
    for (int o = 0; o < 3; ++o) {
      double s = b[o];
      for (int k = 0; k < 5; ++k) s += double(x.data<float>()[i * 5 + k]) * w[o * 5 + k];
      EXPECT_NEAR(y.data<float>()[i * 3 + o], s, 1e-5);
    }
  }
}

TEST(LinearTest, GradientsMatchFiniteDifferences) {
  ParameterSet params;
  Linear lin(params, "fc.", 6, 4, true, 0.5f, 1);
  Tensor x = RandomTensor({5, 6}, 2);
  Tensor r = RandomTensor({5, 4}, 3);
  auto loss = [&] { return Dot(lin.Forward(x), r); };
  params.ZeroGrad();
  Tensor dx = lin.Backward(x, r);
  EXPECT_TRUE(CheckGradient("dx", loss, x, dx));
  for (auto& p : params.all()) EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad));
}

TEST(LinearTest, BackwardAccumulates) {
  ParameterSet params;
  Linear lin(params, "fc.", 3, 2, true, 0.5f, 1);
  Tensor x = RandomTensor({4, 3}, 2);
  Tensor r = RandomTensor({4, 2}, 3);
  lin.Backward(x, r);
  Tensor once = params.Get("fc.weight").grad.Clone();
  lin.Backward(x, r);
  for (int64_t i = 0; i < once.numel(); ++i) {
    EXPECT_FLOAT_EQ(params.Get("fc.weight").grad.data<float>()[i], 2 * once.data<float>()[i]);
  }
}

TEST(LinearTest, RejectsWrongShape) {
  ParameterSet params;
  Linear lin(params, "fc.", 3, 2, true, 0.5f, 1);
  EXPECT_THROW(lin.Forward(Tensor::Zeros({4, 5})), InvalidArgument);
}

TEST(EmbeddingTest, ForwardGathersAndBackwardScatters) {
  ParameterSet params;
  Embedding emb(params, "embed.", 7, 3, 1.0f, 1);
  Tensor ids = Tensor::FromVector<int32_t>({2, 5, 2, 0}, {4});
  Tensor y = emb.Forward(ids);
  const float* w = params.Get("embed.weight").value.data<float>();
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(y.data<float>()[i * 3 + j], w[ids.data<int32_t>()[i] * 3 + j]);
    }
  }
  Tensor r = RandomTensor({4, 3}, 3);
  auto loss = [&] { return Dot(emb.Forward(ids), r); };
  emb.Backward(ids, r);
  Parameter& p = params.Get("embed.weight");
  EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad, 1e-3, 1e-3, 1e-4, 1000));
  EXPECT_THROW(emb.Forward(Tensor::FromVector<int32_t>({7}, {1})), InvalidArgument);
  EXPECT_THROW(emb.Forward(Tensor::FromVector<int32_t>({-1}, {1})), InvalidArgument);
}

class NormTest : public ::testing::TestWithParam<NormKind> {};

TEST_P(NormTest, ForwardNormalizes) {
  ParameterSet params;
  Norm norm(params, "ln.", 8, GetParam());
  Tensor x = RandomTensor({3, 8}, 4, -2.0f, 3.0f);
  Tensor y = norm.Forward(x, nullptr);
  for (int i = 0; i < 3; ++i) {
    const float* yr = y.data<float>() + i * 8;
    double mean = 0, sq = 0;
    for (int j = 0; j < 8; ++j) mean += yr[j];
    mean /= 8;
    bool layer_norm = GetParam() == NormKind::kLayerNorm;
    for (int j = 0; j < 8; ++j) {
      double centered = layer_norm ? yr[j] - mean : yr[j];
      sq += centered * centered;
    }
    if (layer_norm) {
      EXPECT_NEAR(mean, 0.0, 1e-5);
    }
    EXPECT_NEAR(sq / 8, 1.0, 1e-3);  // unit variance (LayerNorm) / unit mean square (RMSNorm)
  }
}

TEST_P(NormTest, GradientsMatchFiniteDifferences) {
  ParameterSet params;
  Norm norm(params, "ln.", 8, GetParam());
  Randomize(params, 1.0f, 9);
  Tensor x = RandomTensor({4, 8}, 4, -2.0f, 2.0f);
  Tensor r = RandomTensor({4, 8}, 5);
  auto loss = [&] { return Dot(norm.Forward(x, nullptr), r); };
  NormCache cache;
  norm.Forward(x, &cache);
  params.ZeroGrad();
  Tensor dx = norm.Backward(cache, r);
  EXPECT_TRUE(CheckGradient("dx", loss, x, dx));
  for (auto& p : params.all()) EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad));
  EXPECT_EQ(params.Find("ln.bias") != nullptr, GetParam() == NormKind::kLayerNorm);
}

TEST_P(NormTest, ThreadsSplitRowsAndSumPartialGradients) {
  ParameterSet p1, p3;
  Norm n1(p1, "ln.", 16, GetParam()), n3(p3, "ln.", 16, GetParam());
  Tensor x = RandomTensor({37, 16}, 4, -2.0f, 2.0f);
  Tensor r = RandomTensor({37, 16}, 5);
  NormCache c1, c3;
  Tensor y1 = n1.Forward(x, &c1, 1), y3 = n3.Forward(x, &c3, 3);
  Tensor dx1 = n1.Backward(c1, r, 1), dx3 = n3.Backward(c3, r, 3);
  for (int64_t i = 0; i < y1.numel(); ++i) {
    ASSERT_EQ(y1.data<float>()[i], y3.data<float>()[i]);  // rows are independent
    ASSERT_EQ(dx1.data<float>()[i], dx3.data<float>()[i]);
  }
  for (size_t k = 0; k < p1.size(); ++k) {  // sums over rows in another order
    EXPECT_TRUE(::switchyard::testing::AllClose(p3.all()[k].grad.data<float>(),
                                                p1.all()[k].grad.data<float>(), 16, 1e-5, 1e-5));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, NormTest,
                         ::testing::Values(NormKind::kLayerNorm, NormKind::kRmsNorm),
                         [](const auto& p) { return std::string(NormKindName(p.param)); });

// Plain reference: per (sequence, head), causal softmax attention in double.
std::vector<double> ReferenceAttention(const Tensor& qkv, int64_t batch, int64_t seq, int64_t m,
                                       int64_t heads) {
  int64_t hd = m / heads;
  std::vector<double> out(static_cast<size_t>(batch * seq * m));
  const float* p = qkv.data<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < seq; ++i) {
        std::vector<double> s(static_cast<size_t>(i + 1));
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t c = 0; c < hd; ++c) {
            d += double(p[(b * seq + i) * 3 * m + h * hd + c]) *
                 p[(b * seq + j) * 3 * m + m + h * hd + c];
          }
          s[j] = d / std::sqrt(double(hd));
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (auto& v : s) z += (v = std::exp(v - mx));
        for (int64_t c = 0; c < hd; ++c) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) {
            acc += s[j] / z * p[(b * seq + j) * 3 * m + 2 * m + h * hd + c];
          }
          out[(b * seq + i) * m + h * hd + c] = acc;
        }
      }
    }
  }
  return out;
}

TEST(AttentionTest, ForwardMatchesReference) {
  ParameterSet params;
  const int64_t batch = 2, seq = 5, m = 8, heads = 2;
  CausalSelfAttention attn(params, "attn.", m, heads, 0.5f, 0.5f, 1);
  Tensor x = RandomTensor({batch * seq, m}, 4);
  AttentionCache cache;
  attn.Forward(x, batch, 1, &cache);
  std::vector<double> ref = ReferenceAttention(cache.qkv, batch, seq, m, heads);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(cache.att.data<float>()[i], ref[i], 1e-5);
}

TEST(AttentionTest, IsCausal) {
  ParameterSet params;
  const int64_t seq = 6, m = 8;
  CausalSelfAttention attn(params, "attn.", m, 2, 0.5f, 0.5f, 1);
  Tensor x = RandomTensor({seq, m}, 4);
  Tensor y0 = attn.Forward(x, 1, 1, nullptr);
  for (int64_t j = 0; j < m; ++j) x.data<float>()[(seq - 1) * m + j] += 1.0f;  // change last token
  Tensor y1 = attn.Forward(x, 1, 1, nullptr);
  for (int64_t i = 0; i < (seq - 1) * m; ++i) EXPECT_EQ(y0.data<float>()[i], y1.data<float>()[i]);
  bool last_changed = false;
  for (int64_t j = 0; j < m; ++j)
    last_changed |= y0.data<float>()[(seq - 1) * m + j] != y1.data<float>()[(seq - 1) * m + j];
  EXPECT_TRUE(last_changed);
}

TEST(AttentionTest, GradientsMatchFiniteDifferences) {
  ParameterSet params;
  const int64_t batch = 2, seq = 4, m = 8, heads = 2;
  CausalSelfAttention attn(params, "attn.", m, heads, 0.4f, 0.4f, 1);
  Randomize(params, 0.4f, 11);
  Tensor x = RandomTensor({batch * seq, m}, 4);
  Tensor r = RandomTensor({batch * seq, m}, 5);
  auto loss = [&] { return Dot(attn.Forward(x, batch, 1, nullptr), r); };
  AttentionCache cache;
  attn.Forward(x, batch, 1, &cache);
  params.ZeroGrad();
  Tensor dx = attn.Backward(cache, r, 1);
  EXPECT_TRUE(CheckGradient("dx", loss, x, dx));
  for (auto& p : params.all()) EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad));
}

TEST(AttentionTest, ThreadsGiveIdenticalResults) {
  ParameterSet params;
  const int64_t batch = 3, seq = 7, m = 16, heads = 4;
  CausalSelfAttention attn(params, "attn.", m, heads, 0.3f, 0.3f, 1);
  Tensor x = RandomTensor({batch * seq, m}, 4);
  Tensor r = RandomTensor({batch * seq, m}, 5);
  AttentionCache c1, c2;
  Tensor y1 = attn.Forward(x, batch, 1, &c1);
  Tensor y2 = attn.Forward(x, batch, 2, &c2);
  Tensor dx1 = attn.Backward(c1, r, 1);
  Tensor dx2 = attn.Backward(c2, r, 3);
  for (int64_t i = 0; i < y1.numel(); ++i) {
    ASSERT_EQ(y1.data<float>()[i], y2.data<float>()[i]);
    ASSERT_EQ(dx1.data<float>()[i], dx2.data<float>()[i]);
  }
}

TEST(AttentionTest, RejectsHeadsNotDividingModelDim) {
  ParameterSet params;
  EXPECT_THROW(CausalSelfAttention(params, "attn.", 10, 4, 0.02f, 0.02f, 1), InvalidArgument);
}

TEST(CrossEntropyTest, MatchesReferenceAndIgnoresNegativeTargets) {
  Tensor logits = RandomTensor({4, 5}, 6, -3.0f, 3.0f);
  Tensor targets = Tensor::FromVector<int32_t>({1, -1, 4, 0}, {4});
  Tensor dlogits;
  CrossEntropyResult r = SoftmaxCrossEntropy(logits, targets, &dlogits, 1.0f);
  EXPECT_EQ(r.count, 3);
  double ref = 0;
  for (int i = 0; i < 4; ++i) {
    int t = targets.data<int32_t>()[i];
    if (t < 0) continue;
    double z = 0;
    for (int j = 0; j < 5; ++j) z += std::exp(double(logits.data<float>()[i * 5 + j]));
    ref += std::log(z) - logits.data<float>()[i * 5 + t];
  }
  EXPECT_NEAR(r.loss, ref / 3, 1e-5);
  auto loss = [&] { return SoftmaxCrossEntropy(logits, targets, nullptr).loss; };
  EXPECT_TRUE(CheckGradient("dlogits", loss, logits, dlogits, 1e-3, 1e-2, 1e-5, 100));
  for (int j = 0; j < 5; ++j) EXPECT_EQ(dlogits.data<float>()[5 + j], 0.0f);  // ignored row
  EXPECT_THROW(SoftmaxCrossEntropy(logits, Tensor::FromVector<int32_t>({5, 0, 0, 0}, {4}), nullptr),
               InvalidArgument);
}

TEST(CrossEntropyTest, ThreadsGiveTheSameResult) {
  Tensor logits = RandomTensor({53, 7}, 6, -3.0f, 3.0f);
  std::vector<int32_t> t(53);
  for (int i = 0; i < 53; ++i) t[i] = i % 9 == 4 ? -1 : i % 7;
  Tensor targets = Tensor::FromVector(t, {53});
  Tensor d1, d3;
  CrossEntropyResult r1 = SoftmaxCrossEntropy(logits, targets, &d1, 0.5f, 1);
  CrossEntropyResult r3 = SoftmaxCrossEntropy(logits, targets, &d3, 0.5f, 3);
  EXPECT_EQ(r1.count, r3.count);
  EXPECT_NEAR(r1.loss, r3.loss, 1e-12);
  for (int64_t i = 0; i < d1.numel(); ++i) ASSERT_EQ(d1.data<float>()[i], d3.data<float>()[i]);
}

TEST(DenseFeedForwardTest, GradientsMatchFiniteDifferences) {
  for (auto act :
       {kernels::Activation::kGelu, kernels::Activation::kRelu, kernels::Activation::kSilu}) {
    ParameterSet params;
    DenseFeedForward ffn(params, "mlp.", 6, 10, act, 0.4f, 0.4f, 3);
    Randomize(params, 0.4f, 13);
    Tensor x = RandomTensor({5, 6}, 4);
    Tensor r = RandomTensor({5, 6}, 5);
    FeedForwardContext ctx;
    auto loss = [&] {
      FeedForwardContext c = ctx;
      c.save_for_backward = false;
      return Dot(ffn.Forward(x, c).y, r);
    };
    FeedForwardOutput out = ffn.Forward(x, ctx);
    EXPECT_EQ(out.loss, 0.0);
    EXPECT_TRUE(out.routing.expert_loads.empty());
    params.ZeroGrad();
    Tensor dx = ffn.Backward(out, r, 1.0f, 1);
    std::string name(kernels::ActivationName(act));
    EXPECT_TRUE(CheckGradient(name + " dx", loss, x, dx));
    for (auto& p : params.all()) {
      EXPECT_TRUE(CheckGradient(name + " " + p.name, loss, p.value, p.grad));
    }
  }
}

TEST(ParameterSetTest, NamesAreUniqueAndLoadChecksShapes) {
  ParameterSet params;
  params.Add("a.weight", Tensor::Zeros({2, 3}), {.weight_decay = true});
  params.Add("a.state", Tensor::Zeros({2}), {.trainable = false});
  EXPECT_THROW(params.Add("a.weight", Tensor::Zeros({1})), InvalidArgument);
  EXPECT_FALSE(params.Get("a.state").grad.defined());
  EXPECT_EQ(params.NumTrainableElements(), 6);
  TensorMap good{{"a.weight", Tensor::Full({2, 3}, 2.0)}, {"a.state", Tensor::Full({2}, 3.0)}};
  params.LoadValues(good);
  EXPECT_EQ(params.Get("a.weight").value.At(5), 2.0);
  TensorMap bad_shape{{"a.weight", Tensor::Zeros({3, 2})}, {"a.state", Tensor::Zeros({2})}};
  EXPECT_THROW(params.LoadValues(bad_shape), InvalidArgument);
  TensorMap missing{{"a.weight", Tensor::Zeros({2, 3})}};
  EXPECT_THROW(params.LoadValues(missing), InvalidArgument);
  TensorMap extra = good;
  extra.emplace("b", Tensor::Zeros({1}));
  EXPECT_THROW(params.LoadValues(extra), InvalidArgument);
  params.LoadValues(extra, /*allow_extra=*/true);
}

TEST(ParameterSetTest, InitIsKeyedByNameAndSeed) {
  Tensor a = Tensor::Empty({100}), b = Tensor::Empty({100}), c = Tensor::Empty({100});
  InitNormal(a, 0.02f, 1, "x.weight");
  InitNormal(b, 0.02f, 1, "x.weight");
  InitNormal(c, 0.02f, 1, "y.weight");
  double sq = 0;
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(a.data<float>()[i], b.data<float>()[i]);
    differs |= a.data<float>()[i] != c.data<float>()[i];
    sq += double(a.data<float>()[i]) * a.data<float>()[i];
  }
  EXPECT_TRUE(differs);
  EXPECT_NEAR(std::sqrt(sq / 100), 0.02, 0.006);
}

}  // namespace
}  // namespace switchyard::train
