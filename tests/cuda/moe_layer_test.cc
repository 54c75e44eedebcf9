// The CUDA layer (switchyard/cuda/moe_layer.h) against the CPU layer (moe::MoeLayer) on the same
// inputs: routing exactly, outputs, losses and every gradient within a relative bound (the norm of
// the difference over the norm of the CPU value): 1e-4 in float32, 2e-2 in bfloat16 (bfloat16
// operands and intermediates, float32 accumulation; measured on the H200 in docs/gpu.md).
#include "switchyard/cuda/moe_layer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device.h"
#include "switchyard/core/error.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/tensor.h"
#include "switchyard/moe/layer.h"

namespace switchyard::cuda {
namespace {

using detail::CheckCuda;
using detail::DeviceBuffer;

constexpr double kFloat32Bound = 1e-4;
constexpr double kBFloat16Bound = 2e-2;

std::vector<float> ToFloats(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::kFloat32) {
    std::memcpy(v.data(), t.data<float>(), v.size() * 4);
  } else {
    const BFloat16* p = t.data<BFloat16>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

template <typename T>
std::vector<T> Values(const Tensor& t) {
  const T* p = t.data<T>();
  return std::vector<T>(p, p + t.numel());
}

// Uploads a host tensor (its own dtype) into `buf`.
void* Upload(const Tensor& t, DeviceBuffer& buf) {
  const size_t bytes = static_cast<size_t>(t.numel()) * DTypeSize(t.dtype());
  void* d = buf.Ensure(bytes);
  CheckCuda(cudaMemcpy(d, t.raw(), bytes, cudaMemcpyHostToDevice), "upload");
  return d;
}

std::vector<float> Download(const void* d, int64_t n, DType dtype) {
  Tensor t = Tensor::Empty({n}, dtype);
  CheckCuda(
      cudaMemcpy(t.raw(), d, static_cast<size_t>(n) * DTypeSize(dtype), cudaMemcpyDeviceToHost),
      "download");
  return ToFloats(t);
}

double RelError(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  if (std::isnan(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

Tensor RandomTensor(Shape shape, uint64_t seed, float scale) {
  Tensor t = Tensor::Empty(std::move(shape));
  CounterRng rng(seed, 7);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    p[i] = scale * (2.0f * rng.Uniform(static_cast<uint64_t>(i)) - 1.0f);
  }
  return t;
}

struct Case {
  std::string name;
  moe::LayerConfig config;
  int64_t tokens;
  DType dtype;
  GemmMode gemm;
};

moe::LayerConfig Base(int64_t m, int64_t h, int64_t e, int64_t k) {
  moe::LayerConfig c;
  c.model_dim = m;
  c.hidden_dim = h;
  c.num_experts = e;
  c.top_k = k;
  c.aux_loss_coef = 0.01f;
  c.z_loss_coef = 0.001f;
  return c;
}

// Runs both layers forward and backward and compares everything.
void Compare(const Case& tc) {
  ASSERT_TRUE(DeviceAvailable()) << "the cuda tests need an NVIDIA GPU";
  const moe::LayerConfig& c = tc.config;
  const int64_t t_num = tc.tokens, m_dim = c.model_dim;
  moe::MoeLayer cpu(c);
  moe::LayerParams params = moe::InitParams(c, 11);
  if (c.expert_bias) params.expert_bias = RandomTensor({c.num_experts}, 5, 0.05f);
  // Biases of zero would hide a missing bias; give them values.
  if (c.fc_bias) {
    params.experts.fc1_bias = RandomTensor({c.num_experts, c.hidden_dim}, 3, 0.2f);
    params.experts.fc2_bias = RandomTensor({c.num_experts, m_dim}, 4, 0.2f);
  }
  Tensor x = RandomTensor({t_num, m_dim}, 1, 1.0f);
  Tensor dy = RandomTensor({t_num, m_dim}, 2, 1.0f);
  if (tc.dtype == DType::kBFloat16) {
    x = x.To(DType::kBFloat16);
    dy = dy.To(DType::kBFloat16);
  }
  moe::ForwardOptions fo;
  moe::LayerOutput ref = cpu.Forward(params, x, fo);
  moe::LayerGradients ref_g = cpu.Backward(params, ref, dy);

  // Device copies.
  DeviceBuffer bx, bdy, by, bdx, bwg, beb, bw1, bb1, bw2, bb2, bw3;
  DeviceBuffer gwg, gw1, gb1, gw2, gb2, gw3;
  DeviceParams dp;
  dp.gate_weight = static_cast<const float*>(Upload(params.gate_weight, bwg));
  if (c.expert_bias) dp.expert_bias = static_cast<const float*>(Upload(params.expert_bias, beb));
  dp.fc1_weight = static_cast<const float*>(Upload(params.experts.fc1_weight, bw1));
  dp.fc2_weight = static_cast<const float*>(Upload(params.experts.fc2_weight, bw2));
  if (c.fc_bias) {
    dp.fc1_bias = static_cast<const float*>(Upload(params.experts.fc1_bias, bb1));
    dp.fc2_bias = static_cast<const float*>(Upload(params.experts.fc2_bias, bb2));
  }
  if (c.gated) dp.fc3_weight = static_cast<const float*>(Upload(params.experts.fc3_weight, bw3));
  const size_t act = DTypeSize(tc.dtype);
  const void* dx_in = Upload(x, bx);
  const void* ddy = Upload(dy, bdy);
  void* dyout = by.Ensure(static_cast<size_t>(t_num * m_dim) * act);
  void* ddx = bdx.Ensure(static_cast<size_t>(t_num * m_dim) * act);
  const int64_t wn = c.num_experts * c.hidden_dim * m_dim;
  DeviceGrads dg;
  dg.gate_weight = gwg.As<float>(static_cast<size_t>(c.num_experts * m_dim));
  dg.fc1_weight = gw1.As<float>(static_cast<size_t>(wn));
  dg.fc2_weight = gw2.As<float>(static_cast<size_t>(wn));
  if (c.fc_bias) {
    dg.fc1_bias = gb1.As<float>(static_cast<size_t>(c.num_experts * c.hidden_dim));
    dg.fc2_bias = gb2.As<float>(static_cast<size_t>(c.num_experts * m_dim));
  }
  if (c.gated) dg.fc3_weight = gw3.As<float>(static_cast<size_t>(wn));
  // Poison the outputs: every element must be written.
  CheckCuda(cudaMemset(dyout, 0xff, static_cast<size_t>(t_num * m_dim) * act), "poison");
  CheckCuda(cudaMemset(ddx, 0xff, static_cast<size_t>(t_num * m_dim) * act), "poison");
  CheckCuda(cudaMemset(dg.fc1_weight, 0xff, static_cast<size_t>(wn) * 4), "poison");

  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreate(&stream), "stream");
  CudaMoeLayer gpu(c, tc.dtype, tc.gemm);
  gpu.PrepareWeights(dp, stream);
  CudaForwardResult out = gpu.Forward(dp, dx_in, t_num, dyout, stream);
  gpu.Backward(dp, ddy, ddx, dg, stream);
  CudaRouting routing = gpu.Routing(stream);
  CheckCuda(cudaStreamSynchronize(stream), "sync");
  CheckCuda(cudaStreamDestroy(stream), "stream");

  // Routing: exact.
  EXPECT_EQ(routing.topk_idx, Values<int32_t>(ref.topk_idx));
  EXPECT_EQ(routing.locations, Values<int32_t>(ref.locations));
  EXPECT_EQ(out.capacity, ref.capacity);
  EXPECT_EQ(out.expert_loads, ref.expert_loads);
  EXPECT_EQ(out.expert_counts, ref.expert_counts);
  EXPECT_EQ(out.dropped, ref.dropped);
  EXPECT_LT(RelError(routing.gates, Values<float>(ref.gates)), kFloat32Bound);
  EXPECT_LT(RelError(routing.combine_weights, Values<float>(ref.combine_weights)), kFloat32Bound);
  EXPECT_NEAR(out.l_aux, ref.l_aux, kFloat32Bound * std::abs(ref.l_aux));
  EXPECT_NEAR(out.z_loss, ref.z_loss, kFloat32Bound * std::abs(ref.z_loss));

  const double bound = tc.dtype == DType::kFloat32 ? kFloat32Bound : kBFloat16Bound;
  auto check = [&](const char* what, const std::vector<float>& got, const Tensor& want) {
    double rel = RelError(got, ToFloats(want));
    EXPECT_LT(rel, bound) << what;
    std::printf("  %-22s rel. error %.3g\n", what, rel);
  };
  check("y", Download(dyout, t_num * m_dim, tc.dtype), ref.y);
  check("dx", Download(ddx, t_num * m_dim, tc.dtype), ref_g.x);
  check("d gate.weight", Download(dg.gate_weight, c.num_experts * m_dim, DType::kFloat32),
        ref_g.params.gate_weight);
  check("d fc1.weight", Download(dg.fc1_weight, wn, DType::kFloat32),
        ref_g.params.experts.fc1_weight);
  check("d fc2.weight", Download(dg.fc2_weight, wn, DType::kFloat32),
        ref_g.params.experts.fc2_weight);
  if (c.fc_bias) {
    check("d fc1.bias", Download(dg.fc1_bias, c.num_experts * c.hidden_dim, DType::kFloat32),
          ref_g.params.experts.fc1_bias);
    check("d fc2.bias", Download(dg.fc2_bias, c.num_experts * m_dim, DType::kFloat32),
          ref_g.params.experts.fc2_bias);
  }
  if (c.gated) {
    check("d fc3.weight", Download(dg.fc3_weight, wn, DType::kFloat32),
          ref_g.params.experts.fc3_weight);
  }
}

std::vector<Case> Cases() {
  std::vector<Case> v;
  // The default path: softmax top-2, Tutel capacity (drops at cf 1), GELU, biases, both losses.
  moe::LayerConfig a = Base(64, 128, 8, 2);
  v.push_back({"default_grouped", a, 512, DType::kFloat32, GemmMode::kGrouped});
  v.push_back({"default_loop", a, 512, DType::kFloat32, GemmMode::kLoop});
  v.push_back({"default_bf16", a, 512, DType::kBFloat16, GemmMode::kLoop});
  // Dropless, SwiGLU (gated SiLU), sigmoid scores with the expert bias, no biases.
  moe::LayerConfig b = Base(96, 64, 16, 4);
  b.dropless = true;
  b.gated = true;
  b.activation = kernels::Activation::kSilu;
  b.score_function = moe::ScoreFunction::kSigmoid;
  b.expert_bias = true;
  b.fc_bias = false;
  v.push_back({"dropless_swiglu_sigmoid", b, 700, DType::kFloat32, GemmMode::kLoop});
  v.push_back({"dropless_swiglu_sigmoid_bf16", b, 700, DType::kBFloat16, GemmMode::kGrouped});
  // Token-order slots, k = 3, heavy drops with renormalization, DeepSpeed's capacity formula,
  // min_capacity and alignment, the all-choices loss, ReLU.
  moe::LayerConfig d = Base(32, 48, 6, 3);
  d.slot_order = moe::SlotOrder::kTokenOrder;
  d.renormalize_after_drop = true;
  d.capacity_factor = 0.5f;
  d.capacity_formula = moe::CapacityFormula::kDeepSpeed;
  d.min_capacity = 4;
  d.alignment = 8;
  d.aux_loss = moe::AuxLoss::kGShardAllChoices;
  d.activation = kernels::Activation::kRelu;
  v.push_back({"token_order_renormalize", d, 1500, DType::kFloat32, GemmMode::kLoop});
  // softmax_after_topk, a capped capacity (cf < 0), top-1, no aux loss; 3000 tokens: several
  // slot chunks.
  moe::LayerConfig s = Base(40, 80, 5, 2);
  s.score_function = moe::ScoreFunction::kSoftmaxAfterTopK;
  s.capacity_factor = -0.8f;
  s.aux_loss = moe::AuxLoss::kNone;
  v.push_back({"softmax_after_topk_capped", s, 3000, DType::kFloat32, GemmMode::kLoop});
  moe::LayerConfig one = Base(64, 32, 4, 1);
  one.capacity_factor = 0.0f;  // no drops, C = the largest load
  v.push_back({"top1_cf0", one, 333, DType::kFloat32, GemmMode::kLoop});
  // 64 experts, top-8 (fine-grained), capacity with drops.
  moe::LayerConfig f = Base(128, 64, 64, 8);
  f.capacity_factor = 1.25f;
  v.push_back({"fine_grained_64x8", f, 2048, DType::kFloat32, GemmMode::kLoop});
  // No tokens; one expert with top-1 (every token routed to it, cf 2: no drops).
  v.push_back({"no_tokens", Base(32, 16, 4, 2), 0, DType::kFloat32, GemmMode::kLoop});
  moe::LayerConfig single = Base(32, 16, 1, 1);
  single.capacity_factor = 2.0f;
  v.push_back({"one_expert", single, 100, DType::kBFloat16, GemmMode::kLoop});
  // Rows that are no multiple of the 16-byte access (bfloat16 M = 36, H = 20): the scalar paths.
  moe::LayerConfig odd = Base(36, 20, 4, 2);
  odd.gated = true;
  v.push_back({"odd_sizes_bf16", odd, 300, DType::kBFloat16, GemmMode::kLoop});
  v.push_back({"odd_sizes", odd, 300, DType::kFloat32, GemmMode::kGrouped});
  return v;
}

class CudaLayerTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaLayerTest, MatchesCpuLayer) { Compare(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Configs, CudaLayerTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

TEST(CudaLayer, RefusesUnsupportedOptions) {
  moe::LayerConfig c = Base(8, 8, 4, 2);
  c.drop_policy = moe::DropPolicy::kProbs;
  try {
    CudaMoeLayer layer(c, DType::kFloat32);
    FAIL() << "drop_policy probs was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("drop_policy = probs"), std::string::npos) << e.what();
  }
  c = Base(8, 8, 4, 2);
  c.prescore = true;
  EXPECT_THROW(CudaMoeLayer(c, DType::kFloat32), InvalidArgument);
  c = Base(8, 8, 4, 2);
  EXPECT_THROW(CudaMoeLayer(c, DType::kInt32), InvalidArgument);
  // The routers of the CPU layer the GPU does not run yet: refused by key, never ignored.
  const std::vector<std::pair<std::string, std::function<void(moe::LayerConfig&)>>> routers = {
      {"group_topk = 2",
       [](moe::LayerConfig& r) {
         r.num_groups = 4;
         r.group_topk = 2;
       }},
      {"topk_scaling_factor = 2.5", [](moe::LayerConfig& r) { r.topk_scaling_factor = 2.5f; }},
      {"aux_loss = sequence", [](moe::LayerConfig& r) {
         r.aux_loss = moe::AuxLoss::kSequence;
         r.sequence_length = 4;
       }}};
  for (const auto& [needle, set] : routers) {
    c = Base(8, 8, 4, 2);
    set(c);
    try {
      CudaMoeLayer layer(c, DType::kFloat32);
      FAIL() << needle << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

TEST(CudaLayer, BFloat16ForwardNeedsPreparedWeights) {
  ASSERT_TRUE(DeviceAvailable()) << "the cuda tests need an NVIDIA GPU";
  CudaMoeLayer layer(Base(8, 8, 4, 2), DType::kBFloat16);
  DeviceBuffer w;
  DeviceParams p;
  p.gate_weight = p.fc1_weight = p.fc2_weight = w.As<float>(64);
  try {
    layer.Forward(p, nullptr, 0, nullptr, nullptr);
    FAIL() << "a bfloat16 Forward ran without PrepareWeights";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("PrepareWeights"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace switchyard::cuda
