#include "switchyard/train/feed_forward.h"

#include "train/parallel_for.h"

namespace switchyard::train {
namespace {

// float32, or bfloat16 under mixed precision.
struct DenseState {
  Tensor x;  // [num_tokens, model_dim]
  Tensor h;  // [num_tokens, hidden_dim] fc1 output, before the activation
  Tensor a;  // [num_tokens, hidden_dim] act(h)
};

}  // namespace

DenseFeedForward::DenseFeedForward(ParameterSet& params, const std::string& prefix,
                                   int64_t model_dim, int64_t hidden_dim,
                                   kernels::Activation activation, float init_std,
                                   float out_init_std, uint64_t seed)
    : activation_(activation),
      fc1_(params, prefix + "fc1.", model_dim, hidden_dim, true, init_std, seed),
      fc2_(params, prefix + "fc2.", hidden_dim, model_dim, true, out_init_std, seed) {}

FeedForwardOutput DenseFeedForward::Forward(const Tensor& x, const FeedForwardContext& context) {
  const bool bf16 = context.precision == Precision::kBFloat16;
  const Tensor x_in = bf16 ? ToBFloat16(x, context.threads) : x;
  Tensor h = fc1_.Forward(x_in, context.threads);
  Tensor a = ActivationForwardParallel(activation_, h, context.threads);
  if (bf16) a = ToBFloat16(a, context.threads);
  FeedForwardOutput out;
  out.y = fc2_.Forward(a, context.threads);
  if (context.save_for_backward) {
    if (bf16) h = ToBFloat16(h, context.threads);
    out.state = std::make_shared<const DenseState>(DenseState{x_in, h, a});
  }
  return out;
}

Tensor DenseFeedForward::Backward(const FeedForwardOutput& forward, const Tensor& dy,
                                  float loss_scale, int threads) {
  SY_CHECK(forward.state != nullptr, "DenseFeedForward::Backward needs save_for_backward");
  const auto& s = *static_cast<const DenseState*>(forward.state.get());
  Tensor da = fc2_.Backward(s.a, dy, threads);
  const Tensor h = ToFloat32(s.h, threads);
  ActivationBackwardInPlace(activation_, h, da, threads);
  return fc1_.Backward(s.x, da, threads);
}

void DenseFeedForward::SavedTensors(const FeedForwardOutput& forward,
                                    std::vector<Tensor>* out) const {
  if (forward.state == nullptr) return;
  const auto& s = *static_cast<const DenseState*>(forward.state.get());
  out->insert(out->end(), {s.x, s.h, s.a});
}

}  // namespace switchyard::train
