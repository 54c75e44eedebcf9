// `switchyard eval`'s computation: a Hugging Face MoE model through TransformerLm on one rank,
// with the family's load-balancing loss over the concatenated router logits.
#include "switchyard/train/hf_eval.h"

#include <fmt/format.h>

#include <memory>
#include <utility>

#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/router_load_loss.h"
#include "switchyard/train/model.h"
#include "switchyard/train/moe_feed_forward.h"

namespace switchyard::train::hf {
namespace {

using kernels::Trans;

// The router sums of every MoE layer of one forward (the concatenation's).
struct RouterSums {
  moe::RouterLoadSums total;
};

// An MoE block with Hugging Face's load-balancing loss: the inner FFN computes the block (its own
// balancing loss weighted 0), and this adds coef * d aux / d logits through logits = x Wg^T.
class HfAuxFeedForward : public FeedForward {
 public:
  HfAuxFeedForward(std::unique_ptr<FeedForward> inner, Parameter* gate, int64_t top_k, float coef,
                   std::shared_ptr<RouterSums> sums)
      : inner_(std::move(inner)), gate_(gate), top_k_(top_k), coef_(coef), sums_(std::move(sums)) {}

  bool is_moe() const override { return true; }
  int64_t num_experts() const override { return inner_->num_experts(); }

  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override {
    auto state = std::make_shared<State>();
    state->inner = inner_->Forward(x, context);
    const int64_t n = x.size(0), m = x.size(1), e = gate_->value.size(0);
    state->x = x;
    state->logits = Tensor::Zeros({n, e});
    kernels::Gemm(Trans::kNo, Trans::kYes, n, e, m, 1.0f, x.data<float>(), m,
                  gate_->value.data<float>(), m, 0.0f, state->logits.data<float>(), e);
    sums_->total.Add(moe::ComputeRouterLoadSums(state->logits, top_k_));
    FeedForwardOutput out = state->inner;
    out.state = state;
    return out;
  }

  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override {
    const auto& state = *static_cast<const State*>(forward.state.get());
    Tensor dx = inner_->Backward(state.inner, dy, loss_scale, threads);
    const int64_t n = state.x.size(0), m = state.x.size(1), e = gate_->value.size(0);
    Tensor dl = Tensor::Zeros({n, e});
    moe::RouterLoadLossBackward(state.logits, sums_->total, coef_ * loss_scale, dl);
    // dx += dl Wg; dWg += dl^T x.
    kernels::Gemm(Trans::kNo, Trans::kNo, n, m, e, 1.0f, dl.data<float>(), e,
                  gate_->value.data<float>(), m, 1.0f, dx.data<float>(), m);
    kernels::Gemm(Trans::kYes, Trans::kNo, e, m, n, 1.0f, dl.data<float>(), e,
                  state.x.data<float>(), m, 1.0f, gate_->grad.data<float>(), m);
    return dx;
  }

 private:
  struct State {
    FeedForwardOutput inner;
    Tensor x;       // [n, M] the block's FFN input
    Tensor logits;  // [n, E]
  };
  std::unique_ptr<FeedForward> inner_;
  Parameter* gate_;
  int64_t top_k_;
  float coef_;
  std::shared_ptr<RouterSums> sums_;
};

// targets[b, t] = tokens[b, t + 1]; the last position of each row is ignored (-1).
Tensor ShiftedTargets(const Tensor& tokens) {
  const int64_t b = tokens.size(0), t = tokens.size(1);
  Tensor targets = Tensor::Empty({b, t}, DType::kInt32);
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t i = 0; i < t; ++i) {
      targets.data<int32_t>()[r * t + i] = i + 1 < t ? tokens.data<int32_t>()[r * t + i + 1] : -1;
    }
  }
  return targets;
}

}  // namespace

EvalResult EvaluateModel(const TrainConfig& config, const TensorMap& weights, const Tensor& tokens,
                         double aux_coef, bool grads, int threads) {
  SY_REQUIRE(tokens.defined() && tokens.dtype() == DType::kInt32 && tokens.dim() == 2 &&
                 tokens.size(1) >= 2 && tokens.size(1) <= config.model.seq_len,
             InvalidArgument, "tokens: expected int32 [batch, T] with 2 <= T <= {}, got {}",
             config.model.seq_len, tokens.defined() ? tokens.ToString() : "none");
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    const int32_t id = tokens.data<int32_t>()[i];
    SY_REQUIRE(id >= 0 && id < config.model.vocab_size, InvalidArgument,
               "tokens: input_ids[{}][{}] = {} is outside the vocabulary [0, {})",
               i / tokens.size(1), i % tokens.size(1), id, config.model.vocab_size);
  }
  TrainConfig c = config;
  c.aux_loss_coef = 0;  // the family's loss is the wrapper's
  auto sums = std::make_shared<RouterSums>();
  sums->total = moe::RouterLoadSums(c.num_experts, c.top_k);
  FeedForwardFactory inner =
      MoeFeedForwardFactory([c](int64_t b) { return MoeBlockLayerConfig(c, b); });
  const auto coef = static_cast<float>(aux_coef);
  FeedForwardFactory factory = [inner, sums, coef, top_k = c.top_k](
                                   int64_t block, const std::string& prefix, ParameterSet& params,
                                   uint64_t seed) -> std::unique_ptr<FeedForward> {
    auto ffn = inner(block, prefix, params, seed);
    return std::make_unique<HfAuxFeedForward>(std::move(ffn), &params.Get(prefix + "gate.weight"),
                                              top_k, coef, sums);
  };
  TransformerLm model(c.model, c.seed, factory);
  model.parameters().LoadValues(weights);

  const Tensor targets = ShiftedTargets(tokens);
  ForwardOptions options{.training = true, .save_for_backward = grads, .threads = threads};
  LmOutput out = model.Forward(tokens, targets, options, /*keep_logits=*/true);
  EvalResult r;
  r.logits = out.logits.Reshape({tokens.size(0), tokens.size(1), c.model.vocab_size});
  r.ce_loss = out.ce_loss;
  r.aux_loss = moe::RouterLoadLoss(sums->total);
  r.loss = r.ce_loss + aux_coef * r.aux_loss;
  if (!grads) return r;
  model.parameters().ZeroGrad();
  model.Backward(out, 1.0f, threads);
  for (const Parameter& p : model.parameters().all()) {
    if (p.grad.defined()) r.grads[p.name] = p.grad;
  }
  return r;
}

}  // namespace switchyard::train::hf
