#include "switchyard/cuda/moe_layer.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <string>

#include "cuda/device.h"
#include "cuda/gemm.h"
#include "cuda/kernels.cuh"
#include "switchyard/core/error.h"
#include "switchyard/moe/plan.h"

namespace switchyard::cuda {

using detail::CheckCublas;
using detail::CheckCuda;
using detail::DeviceBuffer;
using detail::GemmProblem;
using detail::GemmTypes;

bool DeviceAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

namespace {

// The options the GPU layer does not implement (docs/gpu.md): refused up front, by key.
void RequireSupported(const moe::LayerConfig& c) {
  auto refuse = [](const char* key, const std::string& value) {
    throw InvalidArgument(fmt::format(
        "the CUDA layer does not support {} = {} (docs/gpu.md lists what runs on the GPU)", key,
        value));
  };
  if (c.noise != moe::NoiseKind::kNone) refuse("noise", std::string(moe::NoiseKindName(c.noise)));
  if (c.random_routing) refuse("random_routing", "true");
  if (c.batch_prioritized_routing) refuse("batch_prioritized_routing", "true");
  if (c.drop_policy != moe::DropPolicy::kPosition) {
    refuse("drop_policy", std::string(moe::DropPolicyName(c.drop_policy)));
  }
  if (c.prescore) refuse("prescore", "true");
  if (c.aux_loss == moe::AuxLoss::kImportanceLoad) refuse("aux_loss", "importance_load");
  if (c.aux_loss == moe::AuxLoss::kSequence) refuse("aux_loss", "sequence");
  if (c.aux_loss == moe::AuxLoss::kGlobal) refuse("aux_loss", "global");
  if (c.aux_loss == moe::AuxLoss::kHfConcat) refuse("aux_loss", "hf_concat");
  if (c.group_topk > 0) refuse("group_topk", std::to_string(c.group_topk));
  if (c.topk_scaling_factor != 1.0f) {
    refuse("topk_scaling_factor", fmt::format("{}", c.topk_scaling_factor));
  }
  if (c.residual_moe) refuse("residual_moe", "true");
  if (c.shared_expert_hidden > 0) {
    refuse("shared_expert_hidden", std::to_string(c.shared_expert_hidden));
  }
  if (c.check_finite) refuse("check_finite", "true");
  if (c.activation == kernels::Activation::kIdentity) refuse("activation", "identity");
  SY_REQUIRE(c.num_experts <= detail::kMaxExperts, InvalidArgument,
             "the CUDA layer supports num_experts <= {}, got {}", detail::kMaxExperts,
             c.num_experts);
  SY_REQUIRE(moe::EffectiveTopK(c) <= 32, InvalidArgument,
             "the CUDA layer supports top_k <= 32, got {}", moe::EffectiveTopK(c));
}

int ScoreKindOf(moe::ScoreFunction f) {
  switch (f) {
    case moe::ScoreFunction::kSigmoid: return detail::kScoreSigmoid;
    case moe::ScoreFunction::kSoftmaxAfterTopK: return detail::kScoreSoftmaxAfterTopK;
    default: return detail::kScoreSoftmax;
  }
}

}  // namespace

struct CudaMoeLayer::Impl {
  moe::LayerConfig c;
  DType dtype;
  bool bf16;
  int64_t k;
  float aux_coef = 0, z_coef = 0;  // weights of the losses in Backward
  cublasHandle_t handle = nullptr;
  detail::GroupedGemm grouped;

  // bfloat16 copies of the expert weights (bf16 layers).
  DeviceBuffer w1b, w2b, w3b;
  // Forward state.
  int64_t t_num = 0, capacity = 0, num_rows = 0, max_count = 0;
  bool has_forward = false;       // a Forward completed (x may be null when T = 0)
  bool weights_prepared = false;  // bf16: PrepareWeights ran
  const void* x = nullptr;
  std::vector<int64_t> loads, counts, offsets;
  std::vector<int32_t> dev_offsets_counts;  // host copy of [offsets E+1, counts E]
  DeviceBuffer xf, logits, scores, lse, experts, choice_scores, gates, slot, rows, weights, stats,
      scratch, offsets_counts, row_pairs, row_experts, xbuf, a1, a3, h, ybuf;
  // Backward buffers.
  DeviceBuffer d_weights, dybuf, dh, da1, da3, dxbuf, d_logits, dx_gate;
  detail::Stats host_stats{};

  Impl(moe::LayerConfig config, DType dt, GemmMode mode)
      : c(std::move(config)), dtype(dt), bf16(dt == DType::kBFloat16), grouped(mode) {
    moe::ValidateConfig(c);
    RequireSupported(c);
    SY_REQUIRE(dt == DType::kFloat32 || dt == DType::kBFloat16, InvalidArgument,
               "the CUDA layer's dtype: expected float32 or bfloat16, got {}", DTypeName(dt));
    k = moe::EffectiveTopK(c);
    aux_coef = c.aux_loss_coef;
    z_coef = c.z_loss_coef;
    CheckCublas(cublasCreate(&handle), "cublasCreate");
  }
  ~Impl() {
    if (handle != nullptr) cublasDestroy(handle);
  }

  size_t ActBytes() const { return bf16 ? 2 : 4; }
  GemmTypes ActTypes() const {
    cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    return {t, t};
  }
  GemmTypes GradTypes() const { return {bf16 ? CUDA_R_16BF : CUDA_R_32F, CUDA_R_32F}; }
  char* Act(const DeviceBuffer& b, int64_t row, int64_t cols) const {
    return static_cast<char*>(b.get()) + static_cast<size_t>(row * cols) * ActBytes();
  }
  const char* Weight(const float* fp32, const DeviceBuffer& copy, int64_t e, int64_t size) const {
    const char* base =
        bf16 ? static_cast<const char*>(copy.get()) : reinterpret_cast<const char*>(fp32);
    return base + static_cast<size_t>(e * size) * ActBytes();
  }

  // One problem per expert over its filled rows [offsets[e], offsets[e] + counts[e]).
  template <typename F>
  std::vector<GemmProblem> PerExpert(F make) const {
    std::vector<GemmProblem> out;
    out.reserve(static_cast<size_t>(c.num_experts));
    for (int64_t e = 0; e < c.num_experts; ++e) {
      out.push_back(make(e, offsets[static_cast<size_t>(e)], counts[static_cast<size_t>(e)]));
    }
    return out;
  }

  void SetStream(cudaStream_t stream) {
    CheckCublas(cublasSetStream(handle, stream), "cublasSetStream");
  }

  void Routing(const DeviceParams& params, const void* x_in, int64_t t, cudaStream_t stream);
  void ExpertsForward(const DeviceParams& params, cudaStream_t stream);
  void ExpertsBackward(const DeviceParams& params, const DeviceGrads& grads, cudaStream_t stream);
};

CudaMoeLayer::CudaMoeLayer(moe::LayerConfig config, DType dtype, GemmMode gemm)
    : impl_(std::make_unique<Impl>(std::move(config), dtype, gemm)) {}
CudaMoeLayer::~CudaMoeLayer() = default;

const moe::LayerConfig& CudaMoeLayer::config() const { return impl_->c; }
int64_t CudaMoeLayer::top_k() const { return impl_->k; }

void CudaMoeLayer::PrepareWeights(const DeviceParams& params, cudaStream_t stream) {
  Impl& s = *impl_;
  if (!s.bf16) return;
  const int64_t n = s.c.num_experts * s.c.hidden_dim * s.c.model_dim;
  detail::LaunchToBf16(params.fc1_weight, n, s.w1b.Ensure(static_cast<size_t>(n) * 2), stream);
  detail::LaunchToBf16(params.fc2_weight, n, s.w2b.Ensure(static_cast<size_t>(n) * 2), stream);
  if (s.c.gated) {
    detail::LaunchToBf16(params.fc3_weight, n, s.w3b.Ensure(static_cast<size_t>(n) * 2), stream);
  }
  s.weights_prepared = true;
}

// Gate, losses' sums, slots, capacity, drops and the row maps; the one synchronization.
void CudaMoeLayer::Impl::Routing(const DeviceParams& params, const void* x_in, int64_t t,
                                 cudaStream_t stream) {
  const int64_t m_dim = c.model_dim, e_num = c.num_experts;
  t_num = t;
  x = x_in;
  const float* x32 = static_cast<const float*>(x_in);
  if (bf16) {
    float* conv = xf.As<float>(static_cast<size_t>(t * m_dim));
    detail::LaunchToFloat(x_in, t * m_dim, conv, stream);
    x32 = conv;
  }
  float* lg = logits.As<float>(static_cast<size_t>(t * e_num));
  detail::Gemm(handle, false, true,
               {t, e_num, m_dim, x32, m_dim, params.gate_weight, m_dim, lg, e_num},
               {CUDA_R_32F, CUDA_R_32F}, 0.0f);
  auto* st = stats.As<detail::Stats>(1);
  CheckCuda(cudaMemsetAsync(st, 0, sizeof(detail::Stats), stream), "memset");
  detail::GateArgs ga{};
  ga.logits = lg;
  ga.expert_bias = c.expert_bias ? params.expert_bias : nullptr;
  ga.num_tokens = t;
  ga.num_experts = e_num;
  ga.top_k = k;
  ga.score = ScoreKindOf(c.score_function);
  ga.normalize = c.normalize_gate;
  ga.all_choices = c.aux_loss == moe::AuxLoss::kGShardAllChoices;
  ga.scores = scores.As<float>(static_cast<size_t>(t * e_num));
  ga.lse = lse.As<float>(static_cast<size_t>(t));
  ga.experts = experts.As<int32_t>(static_cast<size_t>(t * k));
  ga.choice_scores = choice_scores.As<float>(static_cast<size_t>(t * k));
  ga.gates = gates.As<float>(static_cast<size_t>(t * k));
  ga.stats = st;
  detail::LaunchGate(ga, stream);
  auto* sl = slot.As<int32_t>(static_cast<size_t>(t * k));
  auto* scr = scratch.As<int32_t>(static_cast<size_t>(detail::SlotScratchInts(t * k, e_num)));
  detail::LaunchSlots(ga.experts, t, k, e_num, c.slot_order == moe::SlotOrder::kChoiceMajor, sl,
                      scr, st, stream);
  CheckCuda(cudaMemcpyAsync(&host_stats, st, sizeof(detail::Stats), cudaMemcpyDeviceToHost, stream),
            "copy of the routing statistics");
  CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize after the routing");

  // Capacity and the expert buffer's layout (moe/plan.cc, steps 4 and 5).
  loads.assign(static_cast<size_t>(e_num), 0);
  int64_t max_load = 0;
  for (int64_t e = 0; e < e_num; ++e) {
    loads[static_cast<size_t>(e)] = host_stats.loads[e];
    max_load = std::max(max_load, loads[static_cast<size_t>(e)]);
  }
  capacity = c.dropless ? max_load : moe::ComputeCapacity(c, t, max_load);
  counts.assign(static_cast<size_t>(e_num), 0);
  offsets.assign(static_cast<size_t>(e_num) + 1, 0);
  max_count = 0;
  for (int64_t e = 0; e < e_num; ++e) {
    const auto i = static_cast<size_t>(e);
    counts[i] = c.dropless ? loads[i] : std::min(loads[i], capacity);
    max_count = std::max(max_count, counts[i]);
    // Compact in both modes: the kept rows of expert e follow those of e - 1 (capacity mode's
    // [E, C] padding would only be skipped again by every kernel and GEMM).
    offsets[i + 1] = offsets[i] + counts[i];
  }
  num_rows = offsets.back();
  SY_REQUIRE(num_rows < std::numeric_limits<int32_t>::max(), InvalidArgument,
             "the expert buffer's {} rows exceed the int32 index range", num_rows);
  dev_offsets_counts.assign(static_cast<size_t>(2 * e_num + 1), 0);
  for (int64_t e = 0; e <= e_num; ++e) {
    dev_offsets_counts[static_cast<size_t>(e)] =
        static_cast<int32_t>(offsets[static_cast<size_t>(e)]);
  }
  for (int64_t e = 0; e < e_num; ++e) {
    dev_offsets_counts[static_cast<size_t>(e_num + 1 + e)] =
        static_cast<int32_t>(counts[static_cast<size_t>(e)]);
  }
  auto* oc = offsets_counts.As<int32_t>(dev_offsets_counts.size());
  CheckCuda(cudaMemcpyAsync(oc, dev_offsets_counts.data(), dev_offsets_counts.size() * 4,
                            cudaMemcpyHostToDevice, stream),
            "copy of the expert offsets");
  auto* rp = row_pairs.As<int32_t>(static_cast<size_t>(std::max<int64_t>(num_rows, 1)));
  CheckCuda(cudaMemsetAsync(rp, 0xff, static_cast<size_t>(num_rows) * 4, stream), "memset");
  detail::LaunchFinalize(ga.experts, sl, ga.gates, oc, t, k, capacity, c.dropless,
                         c.renormalize_after_drop && k > 1,
                         rows.As<int32_t>(static_cast<size_t>(t * k)), rp,
                         weights.As<float>(static_cast<size_t>(t * k)), stream);
  detail::LaunchRowExperts(
      oc, e_num, num_rows,
      row_experts.As<int32_t>(static_cast<size_t>(std::max<int64_t>(num_rows, 1))), stream);
}

void CudaMoeLayer::Impl::ExpertsForward(const DeviceParams& params, cudaStream_t stream) {
  const int64_t m_dim = c.model_dim, h_dim = c.hidden_dim, rows_n = std::max<int64_t>(num_rows, 1);
  const size_t ab = ActBytes();
  xbuf.Ensure(static_cast<size_t>(rows_n * m_dim) * ab);
  detail::LaunchDispatch(x, static_cast<const int32_t*>(row_pairs.get()), num_rows, k, m_dim, bf16,
                         xbuf.get(), stream);
  a1.Ensure(static_cast<size_t>(rows_n * h_dim) * ab);
  if (c.gated) a3.Ensure(static_cast<size_t>(rows_n * h_dim) * ab);
  h.Ensure(static_cast<size_t>(rows_n * h_dim) * ab);
  ybuf.Ensure(static_cast<size_t>(rows_n * m_dim) * ab);
  const int64_t wsize = h_dim * m_dim;
  auto up = [&](const float* w, const DeviceBuffer& copy, DeviceBuffer& out) {
    grouped.Run(handle, false, true, PerExpert([&](int64_t e, int64_t off, int64_t cnt) {
                  return GemmProblem{cnt,   h_dim,
                                     m_dim, Act(xbuf, off, m_dim),
                                     m_dim, Weight(w, copy, e, wsize),
                                     m_dim, Act(out, off, h_dim),
                                     h_dim};
                }),
                ActTypes(), 0.0f);
  };
  up(params.fc1_weight, w1b, a1);
  if (c.gated) up(params.fc3_weight, w3b, a3);
  const auto* rp = static_cast<const int32_t*>(row_pairs.get());
  const auto* re = static_cast<const int32_t*>(row_experts.get());
  detail::LaunchActivationForward(
      static_cast<int>(c.activation), a1.get(), c.gated ? a3.get() : nullptr,
      c.fc_bias ? params.fc1_bias : nullptr, re, rp, num_rows, h_dim, bf16, h.get(), stream);
  grouped.Run(handle, false, true, PerExpert([&](int64_t e, int64_t off, int64_t cnt) {
                return GemmProblem{cnt,   m_dim,
                                   h_dim, Act(h, off, h_dim),
                                   h_dim, Weight(params.fc2_weight, w2b, e, wsize),
                                   h_dim, Act(ybuf, off, m_dim),
                                   m_dim};
              }),
              ActTypes(), 0.0f);
}

CudaForwardResult CudaMoeLayer::Forward(const DeviceParams& params, const void* x,
                                        int64_t num_tokens, void* y, cudaStream_t stream) {
  Impl& s = *impl_;
  SY_REQUIRE(num_tokens >= 0 && num_tokens * s.k < std::numeric_limits<int32_t>::max(),
             InvalidArgument, "num_tokens: expected 0 <= T with T * top_k < 2^31, got {}",
             num_tokens);
  SY_REQUIRE(!s.bf16 || s.weights_prepared, InvalidArgument,
             "Forward: a bfloat16 layer needs PrepareWeights before its first Forward (the "
             "bfloat16 copies of the expert weights)");
  s.SetStream(stream);
  s.has_forward = false;
  s.Routing(params, x, num_tokens, stream);
  s.ExpertsForward(params, stream);
  detail::LaunchCombine(s.ybuf.get(), s.c.fc_bias ? params.fc2_bias : nullptr,
                        static_cast<const int32_t*>(s.experts.get()),
                        static_cast<const int32_t*>(s.rows.get()),
                        static_cast<const float*>(s.weights.get()), num_tokens, s.k, s.c.model_dim,
                        s.bf16, y, stream);

  s.has_forward = true;
  CudaForwardResult r;
  r.capacity = s.capacity;
  r.expert_loads = s.loads;
  r.expert_counts = s.counts;
  for (size_t e = 0; e < s.loads.size(); ++e) r.dropped += s.loads[e] - s.counts[e];
  if (num_tokens > 0) {
    const double t = static_cast<double>(num_tokens);
    r.z_loss = static_cast<float>(s.host_stats.z_sum / t);
    if (s.c.aux_loss == moe::AuxLoss::kGShard || s.c.aux_loss == moe::AuxLoss::kGShardAllChoices) {
      const int64_t counted = s.c.aux_loss == moe::AuxLoss::kGShardAllChoices ? s.k : 1;
      double sum = 0;
      for (int64_t e = 0; e < s.c.num_experts; ++e) {
        sum += s.host_stats.probs[e] / t * (s.host_stats.choices[e] / t);
      }
      r.l_aux = static_cast<float>(static_cast<double>(s.c.num_experts) /
                                   static_cast<double>(counted) * sum);
    }
  }
  return r;
}

void CudaMoeLayer::Impl::ExpertsBackward(const DeviceParams& params, const DeviceGrads& grads,
                                         cudaStream_t stream) {
  const int64_t m_dim = c.model_dim, h_dim = c.hidden_dim, e_num = c.num_experts;
  const int64_t rows_n = std::max<int64_t>(num_rows, 1), wsize = h_dim * m_dim;
  const size_t ab = ActBytes();
  const auto* oc = static_cast<const int32_t*>(offsets_counts.get());
  const auto* rp = static_cast<const int32_t*>(row_pairs.get());
  const auto* re = static_cast<const int32_t*>(row_experts.get());
  // Experts without rows get zero weight gradients (their GEMMs are skipped).
  for (float* g : {grads.fc1_weight, grads.fc2_weight, c.gated ? grads.fc3_weight : nullptr}) {
    if (g != nullptr) {
      CheckCuda(cudaMemsetAsync(g, 0, static_cast<size_t>(e_num * wsize) * 4, stream), "memset");
    }
  }
  if (c.fc_bias) {
    detail::LaunchSegmentColumnSum(dybuf.get(), oc, oc + e_num + 1, e_num, max_count, m_dim, bf16,
                                   grads.fc2_bias, stream);
  }
  dh.Ensure(static_cast<size_t>(rows_n * h_dim) * ab);
  grouped.Run(handle, false, false, PerExpert([&](int64_t e, int64_t off, int64_t cnt) {
                return GemmProblem{cnt,   h_dim,
                                   m_dim, Act(dybuf, off, m_dim),
                                   m_dim, Weight(params.fc2_weight, w2b, e, wsize),
                                   h_dim, Act(dh, off, h_dim),
                                   h_dim};
              }),
              ActTypes(), 0.0f);
  grouped.Run(handle, true, false, PerExpert([&](int64_t e, int64_t off, int64_t cnt) {
                return GemmProblem{m_dim, h_dim,
                                   cnt,   Act(dybuf, off, m_dim),
                                   m_dim, Act(h, off, h_dim),
                                   h_dim, grads.fc2_weight + e * wsize,
                                   h_dim};
              }),
              GradTypes(), 0.0f);
  da1.Ensure(static_cast<size_t>(rows_n * h_dim) * ab);
  if (c.gated) da3.Ensure(static_cast<size_t>(rows_n * h_dim) * ab);
  detail::LaunchActivationBackward(
      static_cast<int>(c.activation), a1.get(), c.gated ? a3.get() : nullptr,
      c.fc_bias ? params.fc1_bias : nullptr, dh.get(), re, rp, num_rows, h_dim, bf16, da1.get(),
      c.gated ? da3.get() : nullptr, stream);
  if (c.fc_bias) {
    detail::LaunchSegmentColumnSum(da1.get(), oc, oc + e_num + 1, e_num, max_count, h_dim, bf16,
                                   grads.fc1_bias, stream);
  }
  dxbuf.Ensure(static_cast<size_t>(rows_n * m_dim) * ab);
  auto down = [&](const float* w, const DeviceBuffer& copy, const DeviceBuffer& da, float beta) {
    grouped.Run(handle, false, false, PerExpert([&](int64_t e, int64_t off, int64_t cnt) {
                  return GemmProblem{cnt,   m_dim,
                                     h_dim, Act(da, off, h_dim),
                                     h_dim, Weight(w, copy, e, wsize),
                                     m_dim, Act(dxbuf, off, m_dim),
                                     m_dim};
                }),
                ActTypes(), beta);
  };
  auto wgrad = [&](const DeviceBuffer& da, float* out) {
    grouped.Run(
        handle, true, false, PerExpert([&](int64_t e, int64_t off, int64_t cnt) {
          return GemmProblem{
              h_dim, m_dim,           cnt,  Act(da, off, h_dim), h_dim, Act(xbuf, off, m_dim),
              m_dim, out + e * wsize, m_dim};
        }),
        GradTypes(), 0.0f);
  };
  down(params.fc1_weight, w1b, da1, 0.0f);
  wgrad(da1, grads.fc1_weight);
  if (c.gated) {
    down(params.fc3_weight, w3b, da3, 1.0f);
    wgrad(da3, grads.fc3_weight);
  }
}

void CudaMoeLayer::Backward(const DeviceParams& params, const void* dy, void* dx,
                            const DeviceGrads& grads, cudaStream_t stream) {
  Impl& s = *impl_;
  SY_REQUIRE(s.has_forward, InvalidArgument, "Backward: no Forward ran before");
  const int64_t t = s.t_num, k = s.k, m_dim = s.c.model_dim, e_num = s.c.num_experts;
  s.SetStream(stream);
  const size_t ab = s.ActBytes();
  auto* dw = s.d_weights.As<float>(static_cast<size_t>(std::max<int64_t>(t * k, 1)));
  CheckCuda(cudaMemsetAsync(dw, 0, static_cast<size_t>(t * k) * 4, stream), "memset");
  s.dybuf.Ensure(static_cast<size_t>(std::max<int64_t>(s.num_rows, 1) * m_dim) * ab);
  detail::LaunchCombineBackward(dy, s.ybuf.get(), s.c.fc_bias ? params.fc2_bias : nullptr,
                                static_cast<const int32_t*>(s.row_experts.get()),
                                static_cast<const int32_t*>(s.row_pairs.get()),
                                static_cast<const float*>(s.weights.get()), s.num_rows, k, m_dim,
                                s.bf16, s.dybuf.get(), dw, stream);
  s.ExpertsBackward(params, grads, stream);

  // Gate: d combine weights -> d logits (with the losses' gradients) -> dWg and dx.
  detail::GateBackwardArgs ga{};
  ga.logits = static_cast<const float*>(s.logits.get());
  ga.scores = static_cast<const float*>(s.scores.get());
  ga.lse = static_cast<const float*>(s.lse.get());
  ga.experts = static_cast<const int32_t*>(s.experts.get());
  ga.choice_scores = static_cast<const float*>(s.choice_scores.get());
  ga.gates = static_cast<const float*>(s.gates.get());
  ga.weights = static_cast<const float*>(s.weights.get());
  ga.rows = static_cast<const int32_t*>(s.rows.get());
  ga.d_weights = dw;
  ga.stats = static_cast<const detail::Stats*>(s.stats.get());
  ga.num_tokens = t;
  ga.num_experts = e_num;
  ga.top_k = k;
  ga.score = ScoreKindOf(s.c.score_function);
  ga.normalize = s.c.normalize_gate;
  ga.renormalize = s.c.renormalize_after_drop && k > 1;
  const bool gshard =
      s.c.aux_loss == moe::AuxLoss::kGShard || s.c.aux_loss == moe::AuxLoss::kGShardAllChoices;
  const int64_t counted = s.c.aux_loss == moe::AuxLoss::kGShardAllChoices ? k : 1;
  ga.aux_scale =
      gshard ? s.aux_coef * static_cast<float>(e_num) / static_cast<float>(counted) : 0.0f;
  ga.z_coef = s.z_coef;
  ga.d_logits = s.d_logits.As<float>(static_cast<size_t>(std::max<int64_t>(t * e_num, 1)));
  detail::LaunchGateBackward(ga, stream);
  const float* x32 =
      s.bf16 ? static_cast<const float*>(s.xf.get()) : static_cast<const float*>(s.x);
  // The gate's gradient products of a bfloat16 layer run in TF32 (x is bfloat16, exact in TF32;
  // d_logits and Wg lose 13 mantissa bits, well inside the layer's bfloat16 bound). The forward's
  // logits stay float32: they decide the routing, which must equal the CPU layer's.
  const cublasComputeType_t grad_compute =
      s.bf16 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  detail::Gemm(s.handle, true, false,
               {e_num, m_dim, t, ga.d_logits, e_num, x32, m_dim, grads.gate_weight, m_dim},
               {CUDA_R_32F, CUDA_R_32F}, 0.0f, grad_compute);
  if (t == 0) {
    CheckCuda(cudaMemsetAsync(grads.gate_weight, 0, static_cast<size_t>(e_num * m_dim) * 4, stream),
              "memset");
  }
  auto* dxg = s.dx_gate.As<float>(static_cast<size_t>(std::max<int64_t>(t * m_dim, 1)));
  detail::Gemm(s.handle, false, false,
               {t, m_dim, e_num, ga.d_logits, e_num, params.gate_weight, m_dim, dxg, m_dim},
               {CUDA_R_32F, CUDA_R_32F}, 0.0f, grad_compute);
  detail::LaunchDispatchBackward(dxg, s.dxbuf.get(), static_cast<const int32_t*>(s.rows.get()), t,
                                 k, m_dim, s.bf16, dx, stream);
}

void CudaMoeLayer::SetLossWeights(float aux_loss_coef, float z_loss_coef) {
  SY_REQUIRE(aux_loss_coef >= 0 && z_loss_coef >= 0, InvalidArgument,
             "the loss weights of l_aux ({}) and z_loss ({}) must be >= 0", aux_loss_coef,
             z_loss_coef);
  impl_->aux_coef = aux_loss_coef;
  impl_->z_coef = z_loss_coef;
}

CudaRouting CudaMoeLayer::Routing(cudaStream_t stream) const {
  const Impl& s = *impl_;
  CudaRouting r;
  const auto n = static_cast<size_t>(s.t_num * s.k);
  r.topk_idx.resize(n);
  r.locations.resize(n);
  r.gates.resize(n);
  r.combine_weights.resize(n);
  if (n > 0) {
    CheckCuda(
        cudaMemcpyAsync(r.topk_idx.data(), s.experts.get(), n * 4, cudaMemcpyDeviceToHost, stream),
        "copy");
    CheckCuda(
        cudaMemcpyAsync(r.locations.data(), s.slot.get(), n * 4, cudaMemcpyDeviceToHost, stream),
        "copy");
    CheckCuda(cudaMemcpyAsync(r.gates.data(), s.gates.get(), n * 4, cudaMemcpyDeviceToHost, stream),
              "copy");
    CheckCuda(cudaMemcpyAsync(r.combine_weights.data(), s.weights.get(), n * 4,
                              cudaMemcpyDeviceToHost, stream),
              "copy");
  }
  CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return r;
}

}  // namespace switchyard::cuda
