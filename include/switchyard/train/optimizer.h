// AdamW with decoupled weight decay (PyTorch's torch.optim.AdamW, step for step), gradient
// clipping by global norm (torch.nn.utils.clip_grad_norm_), and the warm-up + cosine learning
// rate schedule.
//
// The update is elementwise, so a rank can update any contiguous range of a parameter with
// AdamWUpdate: that is what ZeRO stage 1/2 shards do (each rank steps its shard, then the
// shards are all-gathered). Optimizer state is named like PyTorch's: "<param>.exp_avg",
// "<param>.exp_avg_sq", plus the step count.
//
// Thread-safety: none; one step at a time.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>

#include "switchyard/core/safetensors.h"
#include "switchyard/core/tensor.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

struct AdamWOptions {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // applied only to parameters with ParamOptions::weight_decay
};

// One AdamW step on n elements, `step` >= 1 the 1-based step count (bias correction):
//   p *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
void AdamWUpdate(float* p, const float* g, float* m, float* v, int64_t n,
                 const AdamWOptions& options, float lr, float weight_decay, int64_t step);

class AdamW {
 public:
  explicit AdamW(AdamWOptions options = {});

  const AdamWOptions& options() const { return options_; }
  // Steps taken so far (0 before the first).
  int64_t step() const { return step_; }

  // One step of every trainable parameter of `params` with learning rate `lr`; state is created
  // (zeros) on first use of a parameter.
  void Step(ParameterSet& params, float lr);
  // One step of the given parameters only (e.g. the parameters this rank owns under ZeRO).
  void Step(std::span<Parameter* const> params, float lr);

  // "<name>.exp_avg" and "<name>.exp_avg_sq" for every parameter with state; share storage.
  TensorMap StateTensors() const;
  // Replaces the state: for each trainable parameter of `params`, its two tensors must be in
  // `tensors` with the parameter's shape (InvalidArgument naming the tensor otherwise).
  void LoadState(const TensorMap& tensors, int64_t step, const ParameterSet& params);

 private:
  struct State {
    Tensor exp_avg;
    Tensor exp_avg_sq;
  };
  AdamWOptions options_;
  int64_t step_ = 0;
  std::map<std::string, State> state_;
};

// Sum over the trainable parameters of sum(grad^2), in double. Distributed runs add the
// contributions of all ranks (each parameter's gradient counted once) before taking the root.
double GradSquaredNorm(const ParameterSet& params);
// The factor clip_grad_norm_ scales gradients by: min(1, max_norm / (total_norm + 1e-6)).
// max_norm <= 0 disables clipping (factor 1).
float ClipFactor(double total_norm, float max_norm);
// grad *= factor for every trainable parameter (no-op for factor 1).
void ScaleGradients(ParameterSet& params, float factor);

// Linear warm-up to max_lr over warmup_steps, then cosine decay to min_lr at total_steps
// (min_lr after that). Steps are 0-based: step 0 uses max_lr / warmup_steps.
struct LrSchedule {
  float max_lr = 3e-3f;
  float min_lr = 3e-4f;
  int64_t warmup_steps = 50;
  int64_t total_steps = 1000;

  float At(int64_t step) const;
};

}  // namespace switchyard::train
