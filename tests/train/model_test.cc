// The whole model: finite-difference gradient check on a tiny model (dense, tied/untied,
// LayerNorm/RMSNorm, and with a stand-in MoE FFN plugged in through the FeedForward interface),
// parameter names, causality and determinism.
#include "switchyard/train/model.h"

#include <gtest/gtest.h>

#include <set>

#include "switchyard/train/weight_grad.h"
#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using testing::CheckGradient;
using testing::RandomTensor;

ModelConfig TinyConfig() {
  ModelConfig c;
  c.vocab_size = 11;
  c.seq_len = 6;
  c.model_dim = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.hidden_dim = 12;
  c.init_std = 0.3f;
  return c;
}

Tensor RandomTokens(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  Tensor t = Tensor::Empty({batch, seq}, DType::kInt32);
  CounterRng rng(seed, kStreamData);
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.data<int32_t>()[i] = static_cast<int32_t>(rng.Bits(uint64_t(i))[0] % uint32_t(vocab));
  }
  return t;
}

// A stand-in for the MoE layer with the same contract: y = x W^T ("experts.fc1.weight", expert
// group) and an auxiliary loss coef * mean_t (x_t . u)^2 through "gate.weight" [1, M].
class FakeMoe : public FeedForward {
 public:
  FakeMoe(ParameterSet& params, const std::string& prefix, int64_t m, uint64_t seed) : m_(m) {
    Tensor w = Tensor::Empty({m, m});
    InitNormal(w, 0.3f, seed, prefix + "experts.fc1.weight");
    w_ = &params.Add(prefix + "experts.fc1.weight", w,
                     {.weight_decay = true, .group = ParamGroup::kExpert});
    Tensor u = Tensor::Empty({1, m});
    InitNormal(u, 0.3f, seed, prefix + "gate.weight");
    u_ = &params.Add(prefix + "gate.weight", u);
  }
  bool is_moe() const override { return true; }
  int64_t num_experts() const override { return 3; }
  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext&) override {
    int64_t n = x.size(0);
    FeedForwardOutput out;
    out.y = Tensor::Zeros({n, m_});
    const float* w = w_->value.data<float>();
    const float* u = u_->value.data<float>();
    double aux = 0;
    for (int64_t t = 0; t < n; ++t) {
      const float* xr = x.data<float>() + t * m_;
      double s = 0;
      for (int64_t j = 0; j < m_; ++j) s += double(xr[j]) * u[j];
      aux += s * s;
      for (int64_t o = 0; o < m_; ++o) {
        double acc = 0;
        for (int64_t j = 0; j < m_; ++j) acc += double(xr[j]) * w[o * m_ + j];
        out.y.data<float>()[t * m_ + o] = static_cast<float>(acc);
      }
    }
    out.aux_loss = aux / double(n);
    out.loss = kCoef * out.aux_loss;
    out.routing.expert_loads = {n, 0, n};
    out.routing.expert_counts = {n, 0, n - 1};
    out.routing.routed = 2 * n;
    out.routing.dropped = 1;
    out.state = std::make_shared<const Tensor>(x);
    return out;
  }
  Tensor Backward(const FeedForwardOutput& fwd, const Tensor& dy, float loss_scale, int) override {
    const Tensor& x = *static_cast<const Tensor*>(fwd.state.get());
    int64_t n = x.size(0);
    Tensor dx = Tensor::Zeros({n, m_});
    const float* w = w_->value.data<float>();
    const float* u = u_->value.data<float>();
    for (int64_t t = 0; t < n; ++t) {
      const float* xr = x.data<float>() + t * m_;
      const float* dyr = dy.data<float>() + t * m_;
      float* dxr = dx.data<float>() + t * m_;
      double s = 0;
      for (int64_t j = 0; j < m_; ++j) s += double(xr[j]) * u[j];
      double c = loss_scale * kCoef * 2.0 * s / double(n);
      for (int64_t j = 0; j < m_; ++j) {
        double acc = c * u[j];
        for (int64_t o = 0; o < m_; ++o) {
          acc += double(dyr[o]) * w[o * m_ + j];
          w_->grad.data<float>()[o * m_ + j] += dyr[o] * xr[j];
        }
        dxr[j] = static_cast<float>(acc);
        u_->grad.data<float>()[j] += static_cast<float>(c * xr[j]);
      }
    }
    return dx;
  }

  static constexpr double kCoef = 0.5;

 private:
  int64_t m_;
  Parameter* w_;
  Parameter* u_;
};

FeedForwardFactory FakeMoeFactory() {
  return [](int64_t, const std::string& prefix, ParameterSet& params, uint64_t seed) {
    return std::make_unique<FakeMoe>(params, prefix, TinyConfig().model_dim, seed);
  };
}

struct GradCase {
  std::string name;
  bool tied;
  NormKind norm;
  int64_t moe_every;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

class ModelGradTest : public ::testing::TestWithParam<GradCase> {};

TEST_P(ModelGradTest, GradientsMatchFiniteDifferences) {
  const GradCase& gc = GetParam();
  ModelConfig c = TinyConfig();
  c.tied_head = gc.tied;
  c.norm = gc.norm;
  c.moe_every = gc.moe_every;
  TransformerLm model(c, 5, FakeMoeFactory());
  Tensor tokens = RandomTokens(2, 5, c.vocab_size, 1);
  Tensor targets = RandomTokens(2, 5, c.vocab_size, 2);
  targets.data<int32_t>()[3] = -1;  // an ignored position
  ForwardOptions fo;
  auto loss = [&] {
    ForwardOptions o = fo;
    o.save_for_backward = false;
    return model.Forward(tokens, targets, o).loss;
  };
  LmOutput out = model.Forward(tokens, targets, fo);
  EXPECT_EQ(out.count, 9);
  if (gc.moe_every > 0) {
    // aux_loss is the mean over MoE blocks; the objective sums the blocks' terms.
    double moe_blocks = static_cast<double>(model.num_moe_blocks());
    EXPECT_GT(out.aux_loss, 0.0);
    EXPECT_NEAR(out.loss, out.ce_loss + FakeMoe::kCoef * out.aux_loss * moe_blocks, 1e-9);
    ASSERT_EQ(out.routing.size(), static_cast<size_t>(moe_blocks));
    EXPECT_EQ(out.routing[0].dropped, 1);
  } else {
    EXPECT_EQ(out.loss, out.ce_loss);
    EXPECT_TRUE(out.routing.empty());
  }
  model.parameters().ZeroGrad();
  model.Backward(out);
  for (auto& p : model.parameters().all()) {
    EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad, 5e-3, 3e-2, 1e-4, 24));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, ModelGradTest,
    ::testing::Values(GradCase{"tied_layernorm", true, NormKind::kLayerNorm, 0},
                      GradCase{"untied_rmsnorm", false, NormKind::kRmsNorm, 0},
                      GradCase{"moe_every_2", true, NormKind::kLayerNorm, 2},
                      GradCase{"moe_every_1_untied", false, NormKind::kRmsNorm, 1}),
    [](const auto& p) { return p.param.name; });

TEST(ModelTest, LossScaleScalesEveryGradient) {
  ModelConfig c = TinyConfig();
  c.moe_every = 2;
  TransformerLm model(c, 5, FakeMoeFactory());
  Tensor tokens = RandomTokens(2, 5, c.vocab_size, 1);
  Tensor targets = RandomTokens(2, 5, c.vocab_size, 2);
  LmOutput out = model.Forward(tokens, targets, {});
  model.Backward(out, 1.0f);
  std::vector<Tensor> full;
  for (auto& p : model.parameters().all()) full.push_back(p.grad.Clone());
  model.parameters().ZeroGrad();
  model.Backward(out, 0.25f);
  size_t i = 0;
  for (auto& p : model.parameters().all()) {
    for (int64_t j = 0; j < p.grad.numel(); ++j) {
      EXPECT_NEAR(p.grad.data<float>()[j], 0.25f * full[i].data<float>()[j],
                  1e-6 + 1e-5 * std::abs(full[i].data<float>()[j]))
          << p.name;
    }
    ++i;
  }
}

TEST(ModelTest, ParameterNamesArePyTorchStyle) {
  ModelConfig c = TinyConfig();
  c.moe_every = 2;
  c.tied_head = false;
  TransformerLm model(c, 5, FakeMoeFactory());
  std::vector<std::string> names;
  for (auto& p : model.parameters().all()) names.push_back(p.name);
  std::vector<std::string> expected = {"embed.weight",
                                       "pos_embed.weight",
                                       "blocks.0.norm1.weight",
                                       "blocks.0.norm1.bias",
                                       "blocks.0.attn.qkv.weight",
                                       "blocks.0.attn.qkv.bias",
                                       "blocks.0.attn.proj.weight",
                                       "blocks.0.attn.proj.bias",
                                       "blocks.0.norm2.weight",
                                       "blocks.0.norm2.bias",
                                       "blocks.0.mlp.fc1.weight",
                                       "blocks.0.mlp.fc1.bias",
                                       "blocks.0.mlp.fc2.weight",
                                       "blocks.0.mlp.fc2.bias",
                                       "blocks.1.norm1.weight",
                                       "blocks.1.norm1.bias",
                                       "blocks.1.attn.qkv.weight",
                                       "blocks.1.attn.qkv.bias",
                                       "blocks.1.attn.proj.weight",
                                       "blocks.1.attn.proj.bias",
                                       "blocks.1.norm2.weight",
                                       "blocks.1.norm2.bias",
                                       "blocks.1.moe.experts.fc1.weight",
                                       "blocks.1.moe.gate.weight",
                                       "final_norm.weight",
                                       "final_norm.bias",
                                       "head.weight"};
  EXPECT_EQ(names, expected);
  EXPECT_EQ(model.parameters().Get("blocks.0.attn.qkv.weight").value.shape(), (Shape{24, 8}));
  EXPECT_EQ(model.parameters().Get("blocks.0.mlp.fc1.weight").value.shape(), (Shape{12, 8}));
  EXPECT_EQ(model.parameters().Get("blocks.1.moe.experts.fc1.weight").options.group,
            ParamGroup::kExpert);
  EXPECT_EQ(model.num_moe_blocks(), 1);
  EXPECT_EQ(model.experts_per_moe_block(), (std::vector<int64_t>{3}));
}

TEST(ModelTest, MoeBlocksNeedAFactory) {
  ModelConfig c = TinyConfig();
  c.moe_every = 2;
  EXPECT_THROW(TransformerLm(c, 5), InvalidArgument);
  EXPECT_TRUE(IsMoeBlock(c, 1));
  EXPECT_FALSE(IsMoeBlock(c, 0));
  c.moe_every = 0;
  EXPECT_FALSE(IsMoeBlock(c, 1));
}

TEST(ModelTest, LogitsAreCausalAndDeterministic) {
  ModelConfig c = TinyConfig();
  TransformerLm model(c, 5);
  Tensor tokens = RandomTokens(1, 6, c.vocab_size, 1);
  ForwardOptions fo;
  fo.save_for_backward = false;
  fo.threads = 2;
  Tensor l0 = model.Forward(tokens, Tensor(), fo).logits;
  Tensor again = model.Forward(tokens, Tensor(), fo).logits;
  for (int64_t i = 0; i < l0.numel(); ++i) ASSERT_EQ(l0.data<float>()[i], again.data<float>()[i]);
  tokens.data<int32_t>()[5] = (tokens.data<int32_t>()[5] + 1) % 11;
  Tensor l1 = model.Forward(tokens, Tensor(), fo).logits;
  for (int64_t i = 0; i < 5 * c.vocab_size; ++i) {
    EXPECT_EQ(l0.data<float>()[i], l1.data<float>()[i]) << "position " << i / c.vocab_size;
  }
  // Shorter contexts than seq_len work (generation), longer ones are rejected.
  EXPECT_EQ(model.Forward(tokens.Reshape({2, 3}), Tensor(), fo).logits.shape(),
            (Shape{6, c.vocab_size}));
  EXPECT_THROW(model.Forward(Tensor::Zeros({1, 7}, DType::kInt32), Tensor(), fo), InvalidArgument);
}

TEST(ModelTest, TrainingFlopsPerToken) {
  ModelConfig c;  // the defaults: V 256, M 128, L 4, H 512, S 64
  double matrix = 256.0 * 128 + 4 * (4 * 128.0 * 128 + 2 * 128.0 * 512);
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(c), 6 * matrix + 12.0 * 4 * 64 * 128);
  c.moe_every = 2;  // blocks 1 and 3: gate (8 experts) + 2 experts of 256 instead of the MLP
  double moe = matrix + 2 * (8 * 128.0 + 2 * 2 * 128.0 * 256 - 2 * 128.0 * 512);
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(c, 8, 2, 256), 6 * moe + 12.0 * 4 * 64 * 128);
}

TEST(ModelTest, ConfigIsValidated) {
  ModelConfig c = TinyConfig();
  c.num_heads = 3;
  EXPECT_THROW(TransformerLm(c, 1), InvalidArgument);
  c = TinyConfig();
  c.model_dim = 0;
  EXPECT_THROW(TransformerLm(c, 1), InvalidArgument);
}

}  // namespace
}  // namespace switchyard::train

namespace switchyard::train {
namespace {

// Zero-bubble B/W split (train/weight_grad.h): inside a deferral scope the backward leaves the
// dense linear layers' and the head's weight gradients for later and computes everything else
// (norms, embeddings, the MoE stand-in); running the queue afterwards gives the gradients of a
// plain backward, bit for bit, also when two micro-batches' W run after both B's.
TEST(ModelTest, DeferredWeightGradientsEqualThePlainBackward) {
  ModelConfig c = TinyConfig();
  c.moe_every = 2;
  c.tied_head = false;
  TransformerLm model(c, 5, FakeMoeFactory());
  auto is_deferred = [](const std::string& name) {
    for (const char* suffix : {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "fc1.weight",
                               "fc1.bias", "fc2.weight", "fc2.bias", "head.weight"}) {
      const std::string s = suffix;
      if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) {
        return name.find("experts.") == std::string::npos;
      }
    }
    return false;
  };
  std::vector<LmOutput> outs;
  for (uint64_t k = 0; k < 2; ++k) {
    outs.push_back(model.Forward(RandomTokens(2, 5, c.vocab_size, 1 + 2 * k),
                                 RandomTokens(2, 5, c.vocab_size, 2 + 2 * k), {}));
  }
  for (const LmOutput& o : outs) model.Backward(o, 0.5f);
  std::vector<Tensor> want;
  for (auto& p : model.parameters().all()) want.push_back(p.grad.Clone());

  model.parameters().ZeroGrad();
  WeightGradQueue queues[2];
  for (size_t k = 0; k < 2; ++k) {
    DeferWeightGrads defer(queues[k]);
    model.Backward(outs[k], 0.5f);
  }
  int deferred = 0;
  for (auto& p : model.parameters().all()) {
    double sum = 0;
    for (int64_t j = 0; j < p.grad.numel(); ++j) sum += std::abs(p.grad.data<float>()[j]);
    if (is_deferred(p.name)) {
      EXPECT_EQ(sum, 0.0) << p.name << " was computed in B";
      ++deferred;
    } else {
      EXPECT_GT(sum, 0.0) << p.name << " was not computed in B";
    }
  }
  // Weights and biases of qkv and proj in both blocks, of fc1 and fc2 in the dense block, and
  // the head.
  EXPECT_EQ(deferred, 13);
  EXPECT_FALSE(queues[0].empty());
  EXPECT_EQ(queues[0].size(), queues[1].size());
  queues[0].Run();
  queues[1].Run();
  EXPECT_TRUE(queues[0].empty());
  size_t i = 0;
  for (auto& p : model.parameters().all()) {
    for (int64_t j = 0; j < p.grad.numel(); ++j) {
      ASSERT_EQ(p.grad.data<float>()[j], want[i].data<float>()[j]) << p.name << " element " << j;
    }
    ++i;
  }
}

}  // namespace
}  // namespace switchyard::train
