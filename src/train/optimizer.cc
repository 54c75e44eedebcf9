#include "switchyard/train/optimizer.h"

#include <cmath>
#include <numbers>

namespace switchyard::train {

void AdamWUpdate(float* p, const float* g, float* m, float* v, int64_t n, const AdamWOptions& o,
                 float lr, float weight_decay, int64_t step) {
  SY_CHECK(step >= 1, "AdamWUpdate: step must be >= 1, got {}", step);
  // Bias corrections in double, as PyTorch computes them on the host.
  const double bc1 = 1.0 - std::pow(static_cast<double>(o.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(o.beta2), static_cast<double>(step));
  const float step_size = static_cast<float>(lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = 1.0f - lr * weight_decay;
  const float b1 = o.beta1, b2 = o.beta2, eps = o.eps;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    m[i] = m[i] + (gi - m[i]) * (1.0f - b1);  // exp_avg.lerp_(grad, 1 - beta1)
    v[i] = v[i] * b2 + (1.0f - b2) * gi * gi;
    float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    p[i] = p[i] * decay - step_size * (m[i] / denom);
  }
}

AdamW::AdamW(AdamWOptions options) : options_(options) {
  SY_REQUIRE(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
             InvalidArgument, "AdamW: betas must be in [0, 1), got ({}, {})", options.beta1,
             options.beta2);
  SY_REQUIRE(options.eps > 0, InvalidArgument, "AdamW: eps must be > 0, got {}", options.eps);
  SY_REQUIRE(options.weight_decay >= 0, InvalidArgument, "AdamW: weight_decay must be >= 0, got {}",
             options.weight_decay);
}

void AdamW::Step(ParameterSet& params, float lr) {
  std::vector<Parameter*> all;
  for (auto& p : params.all()) {
    if (p.options.trainable) all.push_back(&p);
  }
  Step(all, lr);
}

void AdamW::Step(std::span<Parameter* const> params, float lr) {
  ++step_;
  for (Parameter* p : params) {
    SY_REQUIRE(p->options.trainable, InvalidArgument, "AdamW: '{}' is a buffer, not trainable",
               p->name);
    auto [it, inserted] = state_.try_emplace(p->name);
    if (inserted) {
      it->second.exp_avg = Tensor::Zeros(p->value.shape());
      it->second.exp_avg_sq = Tensor::Zeros(p->value.shape());
    }
    SY_CHECK(it->second.exp_avg.shape() == p->value.shape(), "AdamW state of '{}' has shape {}",
             p->name, ShapeToString(it->second.exp_avg.shape()));
    float wd = p->options.weight_decay ? options_.weight_decay : 0.0f;
    AdamWUpdate(p->value.data<float>(), p->grad.data<float>(), it->second.exp_avg.data<float>(),
                it->second.exp_avg_sq.data<float>(), p->value.numel(), options_, lr, wd, step_);
  }
}

TensorMap AdamW::StateTensors() const {
  TensorMap out;
  for (const auto& [name, s] : state_) {
    out.emplace(name + ".exp_avg", s.exp_avg);
    out.emplace(name + ".exp_avg_sq", s.exp_avg_sq);
  }
  return out;
}

void AdamW::LoadState(const TensorMap& tensors, int64_t step, const ParameterSet& params) {
  SY_REQUIRE(step >= 0, InvalidArgument, "AdamW state: step must be >= 0, got {}", step);
  std::map<std::string, State> loaded;
  for (const auto& p : params.all()) {
    if (!p.options.trainable) continue;
    State s;
    for (auto [suffix, dst] : {std::pair{".exp_avg", &s.exp_avg}, {".exp_avg_sq", &s.exp_avg_sq}}) {
      std::string key = p.name + suffix;
      auto it = tensors.find(key);
      SY_REQUIRE(it != tensors.end(), InvalidArgument, "AdamW state: '{}' is missing", key);
      SY_REQUIRE(it->second.shape() == p.value.shape(), InvalidArgument,
                 "AdamW state '{}': expected shape {}, got {}", key, ShapeToString(p.value.shape()),
                 ShapeToString(it->second.shape()));
      ExpectFloating(key, it->second);
      *dst = it->second.To(DType::kFloat32);
      if (dst->SharesStorageWith(it->second)) *dst = dst->Clone();
    }
    loaded.emplace(p.name, std::move(s));
  }
  state_ = std::move(loaded);
  step_ = step;
}

double GradSquaredNorm(const ParameterSet& params) {
  double total = 0;
  for (const auto& p : params.all()) {
    if (!p.options.trainable) continue;
    const float* g = p.grad.data<float>();
    double s = 0;
    for (int64_t i = 0; i < p.grad.numel(); ++i) s += static_cast<double>(g[i]) * g[i];
    total += s;
  }
  return total;
}

float ClipFactor(double total_norm, float max_norm) {
  if (max_norm <= 0) return 1.0f;
  double f = static_cast<double>(max_norm) / (total_norm + 1e-6);
  return f < 1.0 ? static_cast<float>(f) : 1.0f;
}

void ScaleGradients(ParameterSet& params, float factor) {
  if (factor == 1.0f) return;
  for (auto& p : params.all()) {
    if (!p.options.trainable) continue;
    float* g = p.grad.data<float>();
    for (int64_t i = 0; i < p.grad.numel(); ++i) g[i] *= factor;
  }
}

float LrSchedule::At(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return max_lr * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
  }
  int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  double progress = static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps);
  if (progress >= 1.0) return min_lr;
  double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return static_cast<float>(min_lr + (max_lr - min_lr) * cosine);
}

}  // namespace switchyard::train
