#include "switchyard/train/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>

#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using testing::RandomTensor;

TEST(AdamWTest, FirstStepMatchesHandComputedPyTorchValue) {
  // p = 1, g = 0.5, lr 0.1, wd 0.1, betas (0.9, 0.999): decay -> 0.99, m = 0.05, v = 2.5e-4,
  // step_size = lr / (1 - 0.9) = 1, denom = sqrt(v) / sqrt(1 - 0.999) + eps = 0.5 -> p = 0.89.
  float p = 1.0f, g = 0.5f, m = 0.0f, v = 0.0f;
  AdamWOptions o{.beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f};
  AdamWUpdate(&p, &g, &m, &v, 1, o, 0.1f, 0.1f, 1);
  EXPECT_NEAR(p, 0.89f, 1e-6);
  EXPECT_FLOAT_EQ(m, 0.05f);
  EXPECT_NEAR(v, 2.5e-4f, 1e-8);  // 1 - 0.999f is not exact in float32
}

TEST(AdamWTest, StepsMatchDoubleReference) {
  ParameterSet params;
  params.Add("w", RandomTensor({7}, 1), {.weight_decay = true});
  params.Add("b", RandomTensor({3}, 2));
  AdamWOptions o;
  o.weight_decay = 0.2f;
  AdamW opt(o);
  std::vector<double> p[2], m[2], v[2];
  int k = 0;
  for (auto& prm : params.all()) {
    for (int64_t i = 0; i < prm.value.numel(); ++i) p[k].push_back(prm.value.data<float>()[i]);
    m[k].assign(p[k].size(), 0.0);
    v[k].assign(p[k].size(), 0.0);
    ++k;
  }
  for (int step = 1; step <= 5; ++step) {
    float lr = 0.01f * static_cast<float>(step);
    k = 0;
    for (auto& prm : params.all()) {
      prm.grad.CopyFrom(RandomTensor(prm.value.shape(), 100 + step * 10 + k));
      double wd = prm.options.weight_decay ? o.weight_decay : 0.0;
      for (size_t i = 0; i < p[k].size(); ++i) {
        double g = prm.grad.data<float>()[i];
        p[k][i] *= 1 - lr * wd;
        m[k][i] = o.beta1 * m[k][i] + (1 - o.beta1) * g;
        v[k][i] = o.beta2 * v[k][i] + (1 - o.beta2) * g * g;
        double mh = m[k][i] / (1 - std::pow(o.beta1, step));
        double vh = v[k][i] / (1 - std::pow(o.beta2, step));
        p[k][i] -= lr * mh / (std::sqrt(vh) + o.eps);
      }
      ++k;
    }
    opt.Step(params, lr);
  }
  EXPECT_EQ(opt.step(), 5);
  k = 0;
  for (auto& prm : params.all()) {
    for (size_t i = 0; i < p[k].size(); ++i) {
      EXPECT_NEAR(prm.value.data<float>()[i], p[k][i], 2e-6) << prm.name << "[" << i << "]";
    }
    ++k;
  }
}

TEST(AdamWTest, BuffersAreNotOptimizedAndStateRoundTrips) {
  auto make = [](ParameterSet& params) {
    params.Add("w", RandomTensor({4, 2}, 1), {.weight_decay = true});
    params.Add("buf", Tensor::Full({2}, 5.0), {.trainable = false});
  };
  ParameterSet a, b;
  make(a);
  make(b);
  AdamW opt_a;
  for (int s = 0; s < 3; ++s) {
    a.Get("w").grad.CopyFrom(RandomTensor({4, 2}, 10 + s));
    opt_a.Step(a, 0.01f);
  }
  EXPECT_EQ(a.Get("buf").value.At(0), 5.0);
  TensorMap state = opt_a.StateTensors();
  EXPECT_EQ(state.size(), 2u);
  ASSERT_TRUE(state.count("w.exp_avg") && state.count("w.exp_avg_sq"));
  // A fresh optimizer loaded with the state continues bit for bit.
  b.LoadValues(a.Values());
  AdamW opt_b;
  opt_b.LoadState(state, opt_a.step(), b);
  for (int s = 3; s < 6; ++s) {
    a.Get("w").grad.CopyFrom(RandomTensor({4, 2}, 10 + s));
    b.Get("w").grad.CopyFrom(RandomTensor({4, 2}, 10 + s));
    opt_a.Step(a, 0.01f);
    opt_b.Step(b, 0.01f);
  }
  for (int64_t i = 0; i < 8; ++i) {
    EXPECT_EQ(a.Get("w").value.data<float>()[i], b.Get("w").value.data<float>()[i]);
  }
  TensorMap bad = state;
  bad.erase("w.exp_avg_sq");
  EXPECT_THROW(opt_b.LoadState(bad, 1, b), InvalidArgument);
}

TEST(ClipTest, GlobalNormAcrossParameters) {
  ParameterSet params;
  params.Add("a", Tensor::Zeros({2}));
  params.Add("b", Tensor::Zeros({1}));
  params.Add("buf", Tensor::Zeros({1}), {.trainable = false});
  params.Get("a").grad.CopyFrom(Tensor::FromVector<float>({3.0f, 0.0f}, {2}));
  params.Get("b").grad.CopyFrom(Tensor::FromVector<float>({4.0f}, {1}));
  double norm = std::sqrt(GradSquaredNorm(params));
  EXPECT_DOUBLE_EQ(norm, 5.0);
  float f = ClipFactor(norm, 1.0f);
  EXPECT_NEAR(f, 0.2f, 1e-6);
  ScaleGradients(params, f);
  EXPECT_NEAR(std::sqrt(GradSquaredNorm(params)), 1.0, 1e-6);
  EXPECT_EQ(ClipFactor(0.5, 1.0f), 1.0f);   // below the threshold: untouched
  EXPECT_EQ(ClipFactor(50.0, 0.0f), 1.0f);  // disabled
}

TEST(LrScheduleTest, WarmupThenCosine) {
  LrSchedule s{.max_lr = 1.0f, .min_lr = 0.1f, .warmup_steps = 10, .total_steps = 110};
  EXPECT_FLOAT_EQ(s.At(0), 0.1f);
  EXPECT_FLOAT_EQ(s.At(4), 0.5f);
  EXPECT_FLOAT_EQ(s.At(9), 1.0f);
  EXPECT_FLOAT_EQ(s.At(10), 1.0f);
  EXPECT_NEAR(s.At(60), 0.55f, 1e-6);  // halfway through the decay
  EXPECT_FLOAT_EQ(s.At(110), 0.1f);
  EXPECT_FLOAT_EQ(s.At(500), 0.1f);
  for (int64_t t = 10; t < 110; ++t) EXPECT_GE(s.At(t), s.At(t + 1));
  LrSchedule no_warmup{.max_lr = 2.0f, .min_lr = 0.0f, .warmup_steps = 0, .total_steps = 4};
  EXPECT_FLOAT_EQ(no_warmup.At(0), 2.0f);
}

}  // namespace
}  // namespace switchyard::train
