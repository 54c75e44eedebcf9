// The MoE layer of docs/moe.md on one NVIDIA GPU (docs/gpu.md): gate, slots and capacity, the
// permutation to the experts and back, the experts' grouped GEMMs (cuBLAS), the combine and the
// GShard / z losses, forward and backward, on a CUDA stream. Built only with SY_BUILD_CUDA=ON.
//
// Same semantics as moe::MoeLayer (its outputs and gradients are compared with it in
// tests/cuda/), for the options listed in docs/gpu.md; any other option is refused by the
// constructor with an InvalidArgument naming it.
//
// Activations (x, y, dy, dx) are device arrays in the layer's dtype (float32 or bfloat16);
// parameters and gradients are float32 device arrays in the CPU layer's layout (PyTorch Linear,
// stacked over experts). With bfloat16 the expert GEMMs run on bfloat16 operands with float32
// accumulation; the gate, the losses and every reduction run in float32.
//
// Every call enqueues its work on `stream`; Forward synchronizes the stream once, after the
// routing, to read the experts' loads (capacity and the GEMM sizes depend on them). A layer
// object keeps the state of its last Forward for Backward: it is not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "switchyard/core/dtype.h"
#include "switchyard/moe/config.h"

typedef struct CUstream_st* cudaStream_t;  // NOLINT: cuda_runtime.h's name

namespace switchyard::cuda {

// True when a CUDA device is present and usable (the tests skip without one).
bool DeviceAvailable();

// Parameters (float32, device). fc1/fc2 biases only with fc_bias, fc3 only when gated, the
// expert bias only with expert_bias.
struct DeviceParams {
  const float* gate_weight = nullptr;  // [E, M]
  const float* expert_bias = nullptr;  // [E]
  const float* fc1_weight = nullptr;   // [E, H, M]
  const float* fc1_bias = nullptr;     // [E, H]
  const float* fc2_weight = nullptr;   // [E, M, H]
  const float* fc2_bias = nullptr;     // [E, M]
  const float* fc3_weight = nullptr;   // [E, H, M]
};
// Gradients (float32, device), overwritten by Backward; same shapes as DeviceParams.
struct DeviceGrads {
  float* gate_weight = nullptr;
  float* fc1_weight = nullptr;
  float* fc1_bias = nullptr;
  float* fc2_weight = nullptr;
  float* fc2_bias = nullptr;
  float* fc3_weight = nullptr;
};

// How the per-expert GEMMs are issued.
// How the per-expert GEMMs are issued. kLoop is the default: on the H200 with cuBLAS 13.0,
// cublasGemmGroupedBatchedEx ran a CUTLASS sm80 kernel several times slower than the loop
// (docs/gpu.md), and it refuses bfloat16 operands with a float32 output (the weight gradients),
// which then run as the loop.
enum class GemmMode : uint8_t {
  kLoop,    // one cublasGemmEx per expert
  kGrouped  // one cublasGemmGroupedBatchedEx per GEMM step (all experts at once)
};

struct CudaForwardResult {
  float l_aux = 0;
  float z_loss = 0;
  int64_t capacity = 0;  // C (dropless: the largest count)
  int64_t dropped = 0;
  std::vector<int64_t> expert_loads;   // [E] before drops
  std::vector<int64_t> expert_counts;  // [E] kept
};

// Routing results of the last Forward, copied to the host (tests).
struct CudaRouting {
  std::vector<int32_t> topk_idx;       // [T, k]
  std::vector<int32_t> locations;      // [T, k] slot, -1 dropped
  std::vector<float> gates;            // [T, k]
  std::vector<float> combine_weights;  // [T, k]
};

class CudaMoeLayer {
 public:
  // Validates the config (moe::ValidateConfig) and refuses the options docs/gpu.md lists as not
  // supported on the GPU. `dtype`: kFloat32 or kBFloat16, the dtype of x / y / dy / dx.
  CudaMoeLayer(moe::LayerConfig config, DType dtype, GemmMode gemm = GemmMode::kLoop);
  ~CudaMoeLayer();
  CudaMoeLayer(const CudaMoeLayer&) = delete;
  CudaMoeLayer& operator=(const CudaMoeLayer&) = delete;

  const moe::LayerConfig& config() const;
  int64_t top_k() const;

  // Makes the bfloat16 copies of the expert weights the GEMMs read (bfloat16 layers only; call
  // after every change of the weights, e.g. after an optimizer step). A float32 layer reads the
  // parameters in place.
  void PrepareWeights(const DeviceParams& params, cudaStream_t stream);

  // x [T, M] -> y [T, M], both device arrays of the layer's dtype. The result equals the CPU
  // layer's training call and evaluation call alike (noise and random routing are refused).
  CudaForwardResult Forward(const DeviceParams& params, const void* x, int64_t num_tokens, void* y,
                            cudaStream_t stream);

  // Gradients of sum(y * dy) + aux_loss_coef * l_aux + z_loss_coef * z_loss for the last
  // Forward (same params and x, which must still be valid): dx [T, M] in the layer's dtype and
  // the parameter gradients.
  void Backward(const DeviceParams& params, const void* dy, void* dx, const DeviceGrads& grads,
                cudaStream_t stream);

  // The weights of l_aux and z_loss in the objective Backward differentiates (by default the
  // config's aux_loss_coef and z_loss_coef; an autograd caller passes the incoming gradients).
  void SetLossWeights(float aux_loss_coef, float z_loss_coef);

  // The last Forward's routing (synchronizes the stream).
  CudaRouting Routing(cudaStream_t stream) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace switchyard::cuda
