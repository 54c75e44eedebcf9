// The tensor-parallel attention and MLP blocks (column- then row-parallel projections around the
// attention core and the activation) and the gradient all-reduce of replicated parameters
// (docs/tensor_parallel.md). The linear layers, the embedding and the loss they build on are in
// tensor_parallel.cc.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "switchyard/kernels/vec_math.h"
#include "switchyard/train/tensor_parallel.h"
#include "train/parallel_for.h"

namespace switchyard::train {

using parallel::CommStats;

// ---- Attention and MLP ----

namespace {

int64_t LocalHeads(const std::string& prefix, int64_t model_dim, int64_t num_heads,
                   const comm::Communicator& g) {
  SY_REQUIRE(num_heads > 0 && model_dim % num_heads == 0, InvalidArgument,
             "{}: num_heads {} must be positive and divide model_dim {}", prefix, num_heads,
             model_dim);
  SY_REQUIRE(num_heads % g.size() == 0, InvalidArgument,
             "{} tensor-parallel attention: num_heads {} does not divide by the tensor-parallel "
             "size {} (each rank computes whole heads)",
             prefix, num_heads, g.size());
  return num_heads / g.size();
}

}  // namespace

TensorParallelAttention::TensorParallelAttention(ParameterSet& params, const std::string& prefix,
                                                 int64_t model_dim, int64_t num_heads,
                                                 float init_std, float proj_init_std, uint64_t seed,
                                                 comm::Communicator& group,
                                                 TensorParallelOptions options,
                                                 parallel::CommStats* stats)
    : local_heads_(LocalHeads(prefix, model_dim, num_heads, group)),
      qkv_(params, prefix + "qkv.", model_dim, 3 * model_dim, true, init_std, seed, group, options,
           3),
      proj_(params, prefix + "proj.", model_dim, model_dim, true, proj_init_std, seed, group,
            options),
      stats_(stats) {}

Tensor TensorParallelAttention::Forward(const Tensor& x, int64_t batch_size, int threads,
                                        AttentionCache* cache, Precision precision) const {
  // Mixed precision: every tensor kept for backward is bfloat16 (CausalSelfAttention's roundings).
  const bool bf16 = precision == Precision::kBFloat16;
  ColumnParallelCache qc;
  Tensor qkv = qkv_.Forward(x, &qc, threads, stats_, precision);
  if (bf16) qkv = ToBFloat16(qkv, threads);
  SY_REQUIRE(batch_size > 0 && qkv.size(0) % batch_size == 0, InvalidArgument,
             "tensor-parallel attention: {} tokens are not batch_size {} whole sequences",
             qkv.size(0), batch_size);
  Tensor probs;
  Tensor att = CausalAttentionForward(qkv, batch_size, local_heads_, threads,
                                      cache != nullptr ? &probs : nullptr);
  if (bf16) att = ToBFloat16(att, threads);
  Tensor y = proj_.Forward(att, nullptr, threads, stats_);
  if (cache != nullptr) *cache = AttentionCache{qc.x, qkv, probs, att, batch_size};
  return y;
}

Tensor TensorParallelAttention::Backward(const AttentionCache& cache, const Tensor& dy,
                                         int threads) const {
  Tensor datt = proj_.Backward(RowParallelCache{cache.att}, dy, threads, stats_);
  Tensor dqkv = CausalAttentionBackward(cache.qkv, cache.probs, datt, cache.batch_size,
                                        local_heads_, threads);
  return qkv_.Backward(ColumnParallelCache{cache.x}, dqkv, threads, stats_);
}

namespace {

struct TensorParallelMlpState {
  ColumnParallelCache fc1;
  Tensor h;  // [num_tokens, hidden_dim / P] fc1 output, before the activation
  RowParallelCache fc2;
};

}  // namespace

TensorParallelFeedForward::TensorParallelFeedForward(
    ParameterSet& params, const std::string& prefix, int64_t model_dim, int64_t hidden_dim,
    kernels::Activation activation, float init_std, float out_init_std, uint64_t seed,
    comm::Communicator& group, TensorParallelOptions options, parallel::CommStats* stats)
    : activation_(activation),
      fc1_(params, prefix + "fc1.", model_dim, hidden_dim, true, init_std, seed, group, options),
      fc2_(params, prefix + "fc2.", hidden_dim, model_dim, true, out_init_std, seed, group,
           options),
      stats_(stats) {}

FeedForwardOutput TensorParallelFeedForward::Forward(const Tensor& x,
                                                     const FeedForwardContext& context) {
  // Mixed precision as DenseFeedForward: bfloat16 GEMM operands, kept as bfloat16.
  const bool bf16 = context.precision == Precision::kBFloat16;
  auto state = std::make_shared<TensorParallelMlpState>();
  Tensor h = fc1_.Forward(x, &state->fc1, context.threads, stats_, context.precision);
  Tensor a = ActivationForwardParallel(activation_, h, context.threads);
  if (bf16) a = ToBFloat16(a, context.threads);
  FeedForwardOutput out;
  out.y = fc2_.Forward(a, &state->fc2, context.threads, stats_);
  if (context.save_for_backward) {
    state->h = bf16 ? ToBFloat16(h, context.threads) : h;
    out.state = state;
  }
  return out;
}

Tensor TensorParallelFeedForward::Backward(const FeedForwardOutput& forward, const Tensor& dy,
                                           float loss_scale, int threads) {
  SY_CHECK(forward.state != nullptr, "TensorParallelFeedForward::Backward needs save_for_backward");
  const auto& s = *static_cast<const TensorParallelMlpState*>(forward.state.get());
  Tensor da = fc2_.Backward(s.fc2, dy, threads, stats_);
  const Tensor h = ToFloat32(s.h, threads);
  ActivationBackwardInPlace(activation_, h, da, threads);
  return fc1_.Backward(s.fc1, da, threads, stats_);
}

void TensorParallelFeedForward::SavedTensors(const FeedForwardOutput& forward,
                                             std::vector<Tensor>* out) const {
  if (forward.state == nullptr) return;
  const auto& s = *static_cast<const TensorParallelMlpState*>(forward.state.get());
  out->insert(out->end(), {s.fc1.x, s.h, s.fc2.x});
}

void AllReduceGrads(comm::Communicator& group, std::span<Parameter* const> params,
                    CommStats* stats) {
  int64_t total = 0;
  for (const Parameter* p : params) {
    SY_REQUIRE(p != nullptr && p->grad.defined(), InvalidArgument,
               "AllReduceGrads: expected trainable parameters, got {}",
               p == nullptr ? "null" : p->name + " (a buffer)");
    total += p->grad.numel();
  }
  if (total == 0) return;
  Tensor flat = Tensor::Empty({total});
  float* f = flat.data<float>();
  for (const Parameter* p : params) f = std::copy_n(p->grad.data<float>(), p->grad.numel(), f);
  AllReduceTensor(group, flat, stats);
  const float* src = flat.data<float>();
  for (const Parameter* p : params) {
    std::copy_n(src, p->grad.numel(), p->grad.data<float>());
    src += p->grad.numel();
  }
}

}  // namespace switchyard::train
