#include "switchyard/train/gated_shared_moe.h"

#include <cmath>
#include <utility>

#include "switchyard/core/error.h"
#include "switchyard/train/swiglu.h"
#include "train/parallel_for.h"

namespace switchyard::train {

namespace {

struct GatedSharedState {
  FeedForwardOutput routed;  // y dropped; the routed FFN's state
  FeedForwardOutput shared;  // y dropped; the shared expert's state
  Tensor x;                  // [n, M] the input (the gate's)
  Tensor gate;               // [n] sigmoid(x · w_g)
  Tensor shared_y;           // [n, M] SwiGLU_shared(x)
};

}  // namespace

GatedSharedExpertMoe::GatedSharedExpertMoe(
    std::unique_ptr<FeedForward> routed, ParameterSet& params, const std::string& prefix,
    int64_t model_dim, int64_t shared_hidden, float init_std, float out_init_std, uint64_t seed,
    comm::Communicator& tp_group, TensorParallelOptions tp_options, parallel::CommStats* stats)
    : routed_(std::move(routed)),
      shared_(params, prefix + "shared_expert.", model_dim, shared_hidden, /*bias=*/false, init_std,
              out_init_std, seed, tp_group, tp_options, stats),
      gate_(params, prefix + "shared_expert_gate.", model_dim, 1, /*bias=*/false, init_std, seed) {
  SY_CHECK(routed_ != nullptr && routed_->is_moe(), "{}: the gated shared expert needs an MoE FFN",
           prefix);
}

FeedForwardOutput GatedSharedExpertMoe::Forward(const Tensor& x,
                                                const FeedForwardContext& context) {
  const int threads = context.threads;
  auto state = std::make_shared<GatedSharedState>();
  state->routed = routed_->Forward(x, context);
  state->shared = shared_.Forward(x, context);
  const int64_t n = x.size(0), m = x.size(1);
  state->gate = gate_.Forward(x, threads).Reshape({n});
  float* g = state->gate.data<float>();
  for (int64_t t = 0; t < n; ++t) g[t] = 1.0f / (1.0f + std::exp(-g[t]));
  FeedForwardOutput out;
  out.y = Tensor::Empty({n, m});
  const float* r = state->routed.y.data<float>();
  const float* s = state->shared.y.data<float>();
  float* y = out.y.data<float>();
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < m; ++j) y[t * m + j] = r[t * m + j] + g[t] * s[t * m + j];
    }
  });
  out.loss = state->routed.loss;
  out.aux_loss = state->routed.aux_loss;
  out.z_loss = state->routed.z_loss;
  out.routing = std::move(state->routed.routing);
  state->routed.y = Tensor();
  if (context.save_for_backward) {
    state->x = x;
    state->shared_y = state->shared.y;
    state->shared.y = Tensor();
    out.state = state;
  }
  return out;
}

Tensor GatedSharedExpertMoe::Backward(const FeedForwardOutput& forward, const Tensor& dy,
                                      float loss_scale, int threads) {
  SY_CHECK(forward.state != nullptr, "GatedSharedExpertMoe::Backward needs save_for_backward");
  const auto& st = *static_cast<const GatedSharedState*>(forward.state.get());
  Tensor d_shared, d_logit;
  SigmoidGateBackward(st.gate, st.shared_y, dy, &d_shared, &d_logit);
  Tensor dx = routed_->Backward(st.routed, dy, loss_scale, threads);
  AddInPlaceParallel(dx, shared_.Backward(st.shared, d_shared, loss_scale, threads), threads);
  AddInPlaceParallel(dx, gate_.Backward(st.x, d_logit, threads), threads);
  return dx;
}

void GatedSharedExpertMoe::SavedTensors(const FeedForwardOutput& forward,
                                        std::vector<Tensor>* out) const {
  if (forward.state == nullptr) return;
  const auto& st = *static_cast<const GatedSharedState*>(forward.state.get());
  routed_->SavedTensors(st.routed, out);
  shared_.SavedTensors(st.shared, out);
  out->insert(out->end(), {st.gate, st.shared_y});
}

}  // namespace switchyard::train
