// cuda_layer_bench: forward+backward of the CUDA MoE layer (switchyard/cuda/moe_layer.h) on one
// GPU, in useful TFLOP/s (the expert GEMMs of the kept pairs), against cuBLAS's own dense GEMM of
// the same total FLOPs measured in the same run (docs/gpu.md has the figures and the commands).
//
//   cuda_layer_bench --tokens 32768 --model 2048 --hidden 8192 --experts 8 --top-k 2
//       [--cf 1.25] [--dropless] [--gated] [--activation gelu] [--dtype bf16|fp32]
//       [--gemm loop|grouped] [--iters 20]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/gemm.h"
#include "cuda/kernels.cuh"
#include "switchyard/core/error.h"
#include "switchyard/cuda/moe_layer.h"

namespace sy = switchyard;
using sy::cuda::detail::CheckCuda;
using sy::cuda::detail::DeviceBuffer;

namespace {

struct Options {
  int64_t tokens = 32768, model = 2048, hidden = 8192, experts = 8, top_k = 2;
  float cf = 1.25f;
  bool dropless = false, gated = false;
  std::string activation = "gelu", dtype = "bf16", gemm = "loop";
  int iters = 20;
};

[[noreturn]] void Usage(const std::string& msg) {
  std::fprintf(stderr, "cuda_layer_bench: %s\n", msg.c_str());
  std::exit(2);
}

int64_t ParseInt(const char* flag, const char* v) {
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || x <= 0) {
    Usage(std::string(flag) + ": expected a positive integer, got '" + v + "'");
  }
  return x;
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) Usage(f + ": expected a value");
      return argv[++i];
    };
    if (f == "--tokens") {
      o.tokens = ParseInt("--tokens", value());
    } else if (f == "--model") {
      o.model = ParseInt("--model", value());
    } else if (f == "--hidden") {
      o.hidden = ParseInt("--hidden", value());
    } else if (f == "--experts") {
      o.experts = ParseInt("--experts", value());
    } else if (f == "--top-k") {
      o.top_k = ParseInt("--top-k", value());
    } else if (f == "--iters") {
      o.iters = static_cast<int>(ParseInt("--iters", value()));
    } else if (f == "--cf") {
      o.cf = std::strtof(value(), nullptr);
    } else if (f == "--dropless") {
      o.dropless = true;
    } else if (f == "--gated") {
      o.gated = true;
    } else if (f == "--activation") {
      o.activation = value();
    } else if (f == "--dtype") {
      o.dtype = value();
      if (o.dtype != "bf16" && o.dtype != "fp32") Usage("--dtype: expected bf16 or fp32");
    } else if (f == "--gemm") {
      o.gemm = value();
      if (o.gemm != "grouped" && o.gemm != "loop") Usage("--gemm: expected grouped or loop");
    } else {
      Usage("unknown flag '" + f + "'");
    }
  }
  return o;
}

// Uniform(-scale, scale) floats from a fixed LCG, uploaded.
float* RandomDevice(DeviceBuffer& buf, int64_t n, float scale, uint64_t seed) {
  std::vector<float> h(static_cast<size_t>(n));
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (float& v : h) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = scale * (static_cast<float>(s >> 40) / static_cast<float>(1 << 24) * 2.0f - 1.0f);
  }
  auto* d = buf.As<float>(static_cast<size_t>(n));
  CheckCuda(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "upload");
  return d;
}

template <typename F>
double TimeMs(int iters, cudaStream_t stream, F run) {
  cudaEvent_t a, b;
  CheckCuda(cudaEventCreate(&a), "event");
  CheckCuda(cudaEventCreate(&b), "event");
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CheckCuda(cudaEventRecord(a, stream), "record");
    run();
    CheckCuda(cudaEventRecord(b, stream), "record");
    CheckCuda(cudaEventSynchronize(b), "sync");
    float v = 0;
    CheckCuda(cudaEventElapsedTime(&v, a, b), "elapsed");
    ms.push_back(v);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int Run(const Options& o) {
  sy::moe::LayerConfig c;
  c.model_dim = o.model;
  c.hidden_dim = o.hidden;
  c.num_experts = o.experts;
  c.top_k = o.top_k;
  c.capacity_factor = o.cf;
  c.dropless = o.dropless;
  c.gated = o.gated;
  c.activation = sy::kernels::ActivationFromName(o.activation);
  c.z_loss_coef = 0.001f;
  const bool bf16 = o.dtype == "bf16";
  const sy::DType dtype = bf16 ? sy::DType::kBFloat16 : sy::DType::kFloat32;
  sy::cuda::CudaMoeLayer layer(
      c, dtype, o.gemm == "grouped" ? sy::cuda::GemmMode::kGrouped : sy::cuda::GemmMode::kLoop);

  const int64_t t = o.tokens, m = o.model, h = o.hidden, e = o.experts;
  const int64_t wn = e * h * m;
  DeviceBuffer bwg, bw1, bb1, bw2, bb2, bw3, gwg, gw1, gb1, gw2, gb2, gw3, xf, dyf, x, dy, y, dx;
  sy::cuda::DeviceParams p;
  p.gate_weight = RandomDevice(bwg, e * m, 1.0f / std::sqrt(static_cast<float>(m)), 1);
  p.fc1_weight = RandomDevice(bw1, wn, 1.0f / std::sqrt(static_cast<float>(m)), 2);
  p.fc1_bias = RandomDevice(bb1, e * h, 0.1f, 3);
  p.fc2_weight = RandomDevice(bw2, wn, 1.0f / std::sqrt(static_cast<float>(h)), 4);
  p.fc2_bias = RandomDevice(bb2, e * m, 0.1f, 5);
  if (o.gated) p.fc3_weight = RandomDevice(bw3, wn, 1.0f / std::sqrt(static_cast<float>(m)), 6);
  sy::cuda::DeviceGrads g;
  g.gate_weight = gwg.As<float>(static_cast<size_t>(e * m));
  g.fc1_weight = gw1.As<float>(static_cast<size_t>(wn));
  g.fc1_bias = gb1.As<float>(static_cast<size_t>(e * h));
  g.fc2_weight = gw2.As<float>(static_cast<size_t>(wn));
  g.fc2_bias = gb2.As<float>(static_cast<size_t>(e * m));
  if (o.gated) g.fc3_weight = gw3.As<float>(static_cast<size_t>(wn));
  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreate(&stream), "stream");
  const size_t act = bf16 ? 2 : 4;
  float* x32 = RandomDevice(xf, t * m, 1.0f, 7);
  float* dy32 = RandomDevice(dyf, t * m, 1.0f, 8);
  void* xd = x.Ensure(static_cast<size_t>(t * m) * act);
  void* dyd = dy.Ensure(static_cast<size_t>(t * m) * act);
  if (bf16) {
    sy::cuda::detail::LaunchToBf16(x32, t * m, xd, stream);
    sy::cuda::detail::LaunchToBf16(dy32, t * m, dyd, stream);
  } else {
    CheckCuda(cudaMemcpy(xd, x32, static_cast<size_t>(t * m) * 4, cudaMemcpyDeviceToDevice), "cp");
    CheckCuda(cudaMemcpy(dyd, dy32, static_cast<size_t>(t * m) * 4, cudaMemcpyDeviceToDevice),
              "cp");
  }
  void* yd = y.Ensure(static_cast<size_t>(t * m) * act);
  void* dxd = dx.Ensure(static_cast<size_t>(t * m) * act);
  layer.PrepareWeights(p, stream);

  sy::cuda::CudaForwardResult fr;
  auto step = [&] {
    fr = layer.Forward(p, xd, t, yd, stream);
    layer.Backward(p, dyd, dxd, g, stream);
  };
  for (int i = 0; i < 3; ++i) step();
  CheckCuda(cudaStreamSynchronize(stream), "sync");
  const double step_ms = TimeMs(o.iters, stream, step);
  const double fwd_ms = TimeMs(o.iters, stream, [&] { fr = layer.Forward(p, xd, t, yd, stream); });
  int64_t kept = 0;
  for (int64_t v : fr.expert_counts) kept += v;
  const double gemms = o.gated ? 3.0 : 2.0;
  const double useful = 3.0 * gemms * 2.0 * static_cast<double>(kept) * m * h;

  // cuBLAS's dense GEMM of the same FLOPs: all kept rows through one expert's shapes, run as the
  // layer runs them (forward: [kept, M] x [M, H]); the rate of that one product.
  cublasHandle_t handle;
  sy::cuda::detail::CheckCublas(cublasCreate(&handle), "cublasCreate");
  sy::cuda::detail::CheckCublas(cublasSetStream(handle, stream), "cublasSetStream");
  DeviceBuffer da, db, dc;
  const cudaDataType_t ty = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  void* a = da.Ensure(static_cast<size_t>(kept * m) * act);
  void* b = db.Ensure(static_cast<size_t>(h * m) * act);
  void* cc = dc.Ensure(static_cast<size_t>(kept * h) * act);
  // Random operands (zeros run faster than real data).
  if (bf16) {
    DeviceBuffer tmp;
    float* r = RandomDevice(tmp, std::max(kept * m, h * m), 1.0f, 9);
    sy::cuda::detail::LaunchToBf16(r, kept * m, a, stream);
    sy::cuda::detail::LaunchToBf16(r, h * m, b, stream);
    CheckCuda(cudaStreamSynchronize(stream), "sync");
  } else {
    RandomDevice(da, kept * m, 1.0f, 9);
    RandomDevice(db, h * m, 1.0f, 10);
  }
  auto dense = [&] {
    sy::cuda::detail::Gemm(handle, false, true, {kept, h, m, a, m, b, m, cc, h}, {ty, ty}, 0.0f);
  };
  for (int i = 0; i < 3; ++i) dense();
  const double dense_ms = TimeMs(o.iters, stream, dense);
  const double dense_tflops = 2.0 * static_cast<double>(kept) * m * h / dense_ms / 1e9;
  const double layer_tflops = useful / step_ms / 1e9;

  std::printf("config: T %lld, M %lld, H %lld, E %lld, k %lld, %s, cf %.2f, %s%s, %s GEMMs%s\n",
              static_cast<long long>(t), static_cast<long long>(m), static_cast<long long>(h),
              static_cast<long long>(e), static_cast<long long>(layer.top_k()), o.dtype.c_str(),
              o.cf, o.dropless ? "dropless, " : "", o.activation.c_str(), o.gemm.c_str(),
              o.gated ? ", gated" : "");
  std::printf("  capacity %lld, kept pairs %lld, dropped %lld\n",
              static_cast<long long>(fr.capacity), static_cast<long long>(kept),
              static_cast<long long>(fr.dropped));
  std::printf("  forward+backward %.3f ms (median of %d), forward %.3f ms\n", step_ms, o.iters,
              fwd_ms);
  std::printf(
      "  useful %.1f TFLOP/s; cuBLAS dense %s GEMM %lldx%lldx%lld: %.1f TFLOP/s -> %.2f "
      "of dense\n",
      layer_tflops, o.dtype.c_str(), static_cast<long long>(kept), static_cast<long long>(h),
      static_cast<long long>(m), dense_tflops, layer_tflops / dense_tflops);
  std::printf("RESULT layer_tflops=%.1f dense_tflops=%.1f ratio=%.3f step_ms=%.3f\n", layer_tflops,
              dense_tflops, layer_tflops / dense_tflops, step_ms);
  cublasDestroy(handle);
  CheckCuda(cudaStreamDestroy(stream), "stream");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(Parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_layer_bench: %s\n", e.what());
    return 1;
  }
}
