// Grouped-query attention and the SwiGLU MLP over a tensor-parallel group.
#include "switchyard/train/tensor_parallel_gqa.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "switchyard/comm/self.h"
#include "switchyard/train/rope.h"
#include "train/parallel_for.h"
#include "train/qkv_layout.h"

namespace switchyard::train {

using parallel::CommStats;

namespace {

TpGqaOptions Checked(TpGqaOptions o, const std::string& prefix, int p) {
  SY_REQUIRE(o.num_heads > 0 && o.model_dim % o.num_heads == 0, InvalidArgument,
             "{}: num_heads {} must be positive and divide model_dim {}", prefix, o.num_heads,
             o.model_dim);
  if (o.num_kv_heads == 0) o.num_kv_heads = o.num_heads;
  SY_REQUIRE(o.num_kv_heads > 0 && o.num_heads % o.num_kv_heads == 0, InvalidArgument,
             "{}: 'num_kv_heads' {} must divide 'num_heads' {}", prefix, o.num_kv_heads,
             o.num_heads);
  SY_REQUIRE(o.num_kv_heads % p == 0 || p % o.num_kv_heads == 0, InvalidArgument,
             "{}: 'num_kv_heads' {} and the tensor-parallel size {}: one must divide the other "
             "(each rank holds whole kv heads, or one kv head replicated over tp / num_kv_heads "
             "ranks)",
             prefix, o.num_kv_heads, p);
  SY_REQUIRE(o.num_heads % p == 0, InvalidArgument,
             "{}: 'num_heads' {} does not divide by the tensor-parallel size {}", prefix,
             o.num_heads, p);
  SY_REQUIRE(!o.rope || (o.model_dim / o.num_heads) % 2 == 0, InvalidArgument,
             "{}: RoPE needs an even head_dim, got {}", prefix, o.model_dim / o.num_heads);
  return o;
}

// RMSNorm over the full_dim columns of which this rank holds x [n, c]: the sums of squares
// all-reduced over the group. Returns y; rstd [n] for backward.
Tensor ShardedRmsNormForward(comm::Communicator& g, const Tensor& x, const Parameter& w,
                             int64_t full_dim, float eps, Tensor* rstd, CommStats* stats) {
  const int64_t n = x.size(0), c = x.size(1);
  Tensor ss = Tensor::Empty({n});
  const float* xp = x.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int64_t j = 0; j < c; ++j) s += static_cast<double>(xp[i * c + j]) * xp[i * c + j];
    ss.data<float>()[i] = static_cast<float>(s);
  }
  AllReduceTensor(g, ss, stats);
  Tensor y = Tensor::Empty({n, c});
  *rstd = Tensor::Empty({n});
  const float* wp = w.value.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float r = 1.0f / std::sqrt(ss.data<float>()[i] / static_cast<float>(full_dim) + eps);
    rstd->data<float>()[i] = r;
    for (int64_t j = 0; j < c; ++j) y.data<float>()[i * c + j] = xp[i * c + j] * r * wp[j];
  }
  return y;
}

Tensor ShardedRmsNormBackward(comm::Communicator& g, const Tensor& x, const Tensor& rstd,
                              const Parameter& w, int64_t full_dim, const Tensor& dy,
                              CommStats* stats) {
  const int64_t n = x.size(0), c = x.size(1);
  const float* xp = x.data<float>();
  const float* dp = dy.data<float>();
  const float* wp = w.value.data<float>();
  float* dw = w.grad.data<float>();
  Tensor dot = Tensor::Empty({n});
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    const float r = rstd.data<float>()[i];
    for (int64_t j = 0; j < c; ++j) {
      s += static_cast<double>(dp[i * c + j]) * wp[j] * xp[i * c + j];
      dw[j] += dp[i * c + j] * xp[i * c + j] * r;
    }
    dot.data<float>()[i] = static_cast<float>(s);
  }
  AllReduceTensor(g, dot, stats);
  Tensor dx = Tensor::Empty({n, c});
  for (int64_t i = 0; i < n; ++i) {
    const float r = rstd.data<float>()[i];
    const float k = r * r * r * dot.data<float>()[i] / static_cast<float>(full_dim);
    for (int64_t j = 0; j < c; ++j) {
      dx.data<float>()[i * c + j] = r * wp[j] * dp[i * c + j] - xp[i * c + j] * k;
    }
  }
  return dx;
}

Parameter* AddNormWeight(ParameterSet& params, const std::string& name, int64_t local_dim,
                         const comm::Communicator& g) {
  Tensor w = Tensor::Empty({local_dim});
  std::fill_n(w.data<float>(), local_dim, 1.0f);
  Parameter& p = params.Add(name, w);
  if (g.size() > 1) p.tp_shard = TpShard{TpShard::Dim::kRows};
  return &p;
}

}  // namespace

// ---- TensorParallelGqaAttention ----

TensorParallelGqaAttention::TensorParallelGqaAttention(
    ParameterSet& params, const std::string& prefix, TpGqaOptions options,
    comm::Communicator& group, TensorParallelOptions tp_options, CommStats* stats)
    : group_(group),
      tp_options_(tp_options),
      options_(Checked(options, prefix, group.size())),
      head_dim_(options_.model_dim / options_.num_heads),
      local_heads_(options_.num_heads / group.size()),
      local_kv_heads_(std::max<int64_t>(1, options_.num_kv_heads / group.size())),
      kv_self_(group.size() > options_.num_kv_heads ? comm::CreateSelfCommunicator(prefix + "kv")
                                                    : nullptr),
      kv_head_(group.rank() / std::max<int64_t>(1, group.size() / options_.num_kv_heads)),
      q_(params, prefix + "q_proj.", options_.model_dim, options_.num_heads * head_dim_,
         options_.qkv_bias, options_.init_std, options_.seed, group, tp_options),
      k_(params, prefix + "k_proj.", options_.model_dim, options_.num_kv_heads * head_dim_,
         options_.qkv_bias, options_.init_std, options_.seed, kv_self_ ? *kv_self_ : group,
         tp_options),
      v_(params, prefix + "v_proj.", options_.model_dim, options_.num_kv_heads * head_dim_,
         options_.qkv_bias, options_.init_std, options_.seed, kv_self_ ? *kv_self_ : group,
         tp_options),
      o_(params, prefix + "o_proj.", options_.num_heads * head_dim_, options_.model_dim,
         options_.o_bias, options_.o_init_std, options_.seed, group, tp_options),
      stats_(stats) {
  SY_REQUIRE(!tp_options.comm_overlap, InvalidArgument,
             "{}: tp_comm_overlap is not supported with grouped-query attention (the "
             "Hugging Face families' attention)",
             prefix);
  if (options_.qk_norm) {
    q_norm_ = AddNormWeight(params, prefix + "q_norm.weight", local_heads_ * head_dim_, group);
    k_norm_ = replicated_kv() ? AddNormWeight(params, prefix + "k_norm.weight",
                                              options_.num_kv_heads * head_dim_, *kv_self_)
                              : AddNormWeight(params, prefix + "k_norm.weight",
                                              local_kv_heads_ * head_dim_, group);
  }
}

Tensor TensorParallelGqaAttention::KvColumns(const Tensor& full) const {
  const int64_t n = full.size(0), d = head_dim_, width = full.size(1);
  Tensor out = Tensor::Empty({n, d});
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(out.data<float>() + i * d, full.data<float>() + i * width + kv_head_ * d,
                static_cast<size_t>(d) * sizeof(float));
  }
  return out;
}

Tensor TensorParallelGqaAttention::PadKvColumns(const Tensor& local) const {
  const int64_t n = local.size(0), d = head_dim_, width = options_.num_kv_heads * d;
  Tensor out = Tensor::Zeros({n, width});
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(out.data<float>() + i * width + kv_head_ * d, local.data<float>() + i * d,
                static_cast<size_t>(d) * sizeof(float));
  }
  return out;
}

void TensorParallelGqaAttention::SumKvGradsOverReplicas(
    const std::function<Tensor()>& backward) const {
  // With sequence parallelism the data-parallel reduction of replicated parameters spans the tp
  // ranks and sums the replicas' gradients itself.
  std::vector<Parameter*> kv = {&k_.local().weight(), &v_.local().weight()};
  for (Parameter* b : {k_.local().bias(), v_.local().bias(), k_norm_}) {
    if (b != nullptr) kv.push_back(b);
  }
  if (tp_options_.sequence_parallel || group_.size() == 1) {
    (void)backward();
    return;
  }
  // This call's gradients alone, summed over the group, then added to what was there.
  std::vector<Tensor> kept;
  for (Parameter* p : kv) {
    kept.push_back(p->grad.Clone());
    std::fill_n(p->grad.data<float>(), p->grad.numel(), 0.0f);
  }
  (void)backward();
  for (size_t i = 0; i < kv.size(); ++i) {
    AllReduceTensor(group_, kv[i]->grad, stats_);
    AddInPlaceParallel(kv[i]->grad, kept[i], 1);
  }
}

Tensor TensorParallelGqaAttention::ProjectQkv(const Tensor& x, std::span<const int64_t> positions,
                                              TpGqaCache* cache, int threads,
                                              Precision precision) const {
  Tensor input = EnterTensorParallel(group_, tp_options_, x, stats_);
  if (precision == Precision::kBFloat16) input = ToBFloat16(input, threads);
  const int64_t n = input.size(0), d = head_dim_;
  SY_REQUIRE(static_cast<int64_t>(positions.size()) == n, InvalidArgument,
             "attention positions: expected {} (one per token), got {}", n, positions.size());
  Tensor q = q_.local().Forward(input, threads);
  Tensor k = k_.local().Forward(input, threads);
  Tensor v = v_.local().Forward(input, threads);
  if (cache != nullptr) {
    cache->x = input;
    cache->positions.assign(positions.begin(), positions.end());
  }
  if (options_.qk_norm) {
    Tensor q_rstd, k_rstd;
    Tensor qn = ShardedRmsNormForward(group_, q, *q_norm_, options_.num_heads * d,
                                      options_.norm_eps, &q_rstd, stats_);
    Tensor kn =
        ShardedRmsNormForward(replicated_kv() ? *kv_self_ : group_, k, *k_norm_,
                              options_.num_kv_heads * d, options_.norm_eps, &k_rstd, stats_);
    if (cache != nullptr) {
      cache->q_pre = q, cache->k_pre = k, cache->q_rstd = q_rstd, cache->k_rstd = k_rstd;
    }
    q = qn, k = kn;
  }
  if (replicated_kv()) k = KvColumns(k), v = KvColumns(v);
  if (options_.rope) {
    q = RopeForward(q, positions, d, options_.rope_theta, threads);
    k = RopeForward(k, positions, d, options_.rope_theta, threads);
  }
  Tensor qkv = RepeatKvQkv(q, k, v, local_heads_, local_kv_heads_, d);
  return qkv;
}

Tensor TensorParallelGqaAttention::ProjectQkvBackward(const TpGqaCache& cache, const Tensor& dqkv,
                                                      int threads) const {
  const int64_t n = cache.x.size(0), d = head_dim_, heads = local_heads_;
  const int64_t qd = heads * d;
  ExpectShape("attention d(qkv)", dqkv, {n, 3 * qd});
  QkvGrads grads = RepeatKvQkvBackward(dqkv, heads, local_kv_heads_, d);
  Tensor dq = grads.dq, dk = grads.dk, dv = grads.dv;
  if (options_.rope) {
    dq = RopeBackward(dq, cache.positions, d, options_.rope_theta, threads);
    dk = RopeBackward(dk, cache.positions, d, options_.rope_theta, threads);
  }
  if (options_.qk_norm) {
    dq = ShardedRmsNormBackward(group_, cache.q_pre, cache.q_rstd, *q_norm_, options_.num_heads * d,
                                dq, stats_);
  }
  Tensor dx = q_.local().Backward(cache.x, dq, threads);
  auto kv_backward = [&]() {
    if (replicated_kv()) dk = PadKvColumns(dk), dv = PadKvColumns(dv);
    if (options_.qk_norm) {
      dk = ShardedRmsNormBackward(replicated_kv() ? *kv_self_ : group_, cache.k_pre, cache.k_rstd,
                                  *k_norm_, options_.num_kv_heads * d, dk, stats_);
    }
    AddInPlaceParallel(dx, k_.local().Backward(cache.x, dk, threads), threads);
    AddInPlaceParallel(dx, v_.local().Backward(cache.x, dv, threads), threads);
    return dx;
  };
  if (replicated_kv()) {
    SumKvGradsOverReplicas(kv_backward);
  } else {
    kv_backward();
  }
  return EnterTensorParallelBackward(group_, tp_options_, dx, stats_);
}

// ---- TensorParallelSwiGlu ----

namespace {

struct SwiGluState {
  Tensor x;     // [n, M] gathered input
  Tensor gate;  // [n, I / P] before silu
  Tensor up;    // [n, I / P]
  Tensor a;     // [n, I / P] silu(gate) * up, down's input
};

float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

}  // namespace

TensorParallelSwiGlu::TensorParallelSwiGlu(ParameterSet& params, const std::string& prefix,
                                           int64_t model_dim, int64_t intermediate_size, bool bias,
                                           float init_std, float out_init_std, uint64_t seed,
                                           comm::Communicator& group, TensorParallelOptions options,
                                           CommStats* stats)
    : group_(group),
      options_(options),
      gate_(params, prefix + "gate_proj.", model_dim, intermediate_size, bias, init_std, seed,
            group, options),
      up_(params, prefix + "up_proj.", model_dim, intermediate_size, bias, init_std, seed, group,
          options),
      down_(params, prefix + "down_proj.", intermediate_size, model_dim, bias, out_init_std, seed,
            group, options),
      stats_(stats) {
  SY_REQUIRE(!options.comm_overlap, InvalidArgument,
             "{}: tp_comm_overlap is not supported with the SwiGLU MLP", prefix);
}

FeedForwardOutput TensorParallelSwiGlu::Forward(const Tensor& x,
                                                const FeedForwardContext& context) {
  const int threads = context.threads;
  const bool bf16 = context.precision == Precision::kBFloat16;
  auto state = std::make_shared<SwiGluState>();
  state->x = EnterTensorParallel(group_, options_, x, stats_);
  if (bf16) state->x = ToBFloat16(state->x, threads);
  state->gate = gate_.local().Forward(state->x, threads);
  state->up = up_.local().Forward(state->x, threads);
  Tensor a = Tensor::Empty(state->gate.shape());
  const float* g = state->gate.data<float>();
  const float* u = state->up.data<float>();
  float* ap = a.data<float>();
  ParallelFor(a.numel(), threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ap[i] = g[i] * Sigmoid(g[i]) * u[i];
  });
  if (bf16) a = ToBFloat16(a, threads);
  state->a = a;
  FeedForwardOutput out;
  out.y = down_.Forward(a, nullptr, threads, stats_);
  if (context.save_for_backward) out.state = state;
  return out;
}

Tensor TensorParallelSwiGlu::Backward(const FeedForwardOutput& forward, const Tensor& dy,
                                      float /*loss_scale*/, int threads) {
  SY_CHECK(forward.state != nullptr, "TensorParallelSwiGlu::Backward needs save_for_backward");
  const auto& s = *static_cast<const SwiGluState*>(forward.state.get());
  Tensor da = down_.Backward(RowParallelCache{s.a}, dy, threads, stats_);
  Tensor dg = Tensor::Empty(da.shape()), du = Tensor::Empty(da.shape());
  const float* g = s.gate.data<float>();
  const float* u = s.up.data<float>();
  const float* d = da.data<float>();
  float* dgp = dg.data<float>();
  float* dup = du.data<float>();
  ParallelFor(da.numel(), threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float sg = Sigmoid(g[i]);
      dup[i] = d[i] * g[i] * sg;
      dgp[i] = d[i] * u[i] * sg * (1.0f + g[i] * (1.0f - sg));
    }
  });
  Tensor dx = gate_.local().Backward(s.x, dg, threads);
  AddInPlaceParallel(dx, up_.local().Backward(s.x, du, threads), threads);
  return EnterTensorParallelBackward(group_, options_, dx, stats_);
}

void TensorParallelSwiGlu::SavedTensors(const FeedForwardOutput& forward,
                                        std::vector<Tensor>* out) const {
  if (forward.state == nullptr) return;
  const auto& s = *static_cast<const SwiGluState*>(forward.state.get());
  out->insert(out->end(), {s.x, s.gate, s.up, s.a});
}

}  // namespace switchyard::train
