// Helpers shared by the CUDA layer's kernel files (kernels.cu, gate_kernels.cu): launch checks,
// bfloat16 / float32 loads and stores (scalar and 16-byte), warp and block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace switchyard::cuda::detail {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr float kGateEps = 1.1920928955078125e-07f;  // moe::kGateEps (float32's epsilon)
constexpr int kActRelu = 0, kActGelu = 1, kActSilu = 2;

inline void CheckLaunch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA kernel ") + what + ": " + cudaGetErrorString(err));
  }
}

inline int Blocks(int64_t n, int threads, int64_t cap = 1 << 20) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<int>(b < cap ? b : cap);
}

template <bool kBf16>
__device__ __forceinline__ float Ld(const void* p, int64_t i) {
  if constexpr (kBf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}
template <bool kBf16>
__device__ __forceinline__ void St(void* p, int64_t i, float v) {
  if constexpr (kBf16) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// kV consecutive elements from element i (kV = 1, or one 16-byte access: 8 bfloat16 / 4 float).
template <bool kBf16, int kV>
__device__ __forceinline__ void LdV(const void* p, int64_t i, float (&v)[kV]) {
  if constexpr (kV == 1) {
    v[0] = Ld<kBf16>(p, i);
  } else if constexpr (kBf16) {
    static_assert(kV == 8);
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p) + i);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(h[q]);
      v[2 * q] = f.x;
      v[2 * q + 1] = f.y;
    }
  } else {
    static_assert(kV == 4);
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
  }
}
template <bool kBf16, int kV>
__device__ __forceinline__ void StV(void* p, int64_t i, const float (&v)[kV]) {
  if constexpr (kV == 1) {
    St<kBf16>(p, i, v[0]);
  } else if constexpr (kBf16) {
    uint4 raw;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(v[2 * q], v[2 * q + 1]);
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p) + i) = raw;
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = make_float4(v[0], v[1], v[2], v[3]);
  }
}
// float32 bias values (kV of them; the bias arrays are float32 whatever the activations).
template <int kV>
__device__ __forceinline__ void LdBias(const float* b, int64_t i, float (&v)[kV]) {
  if constexpr (kV == 1) {
    v[0] = b[i];
  } else {
#pragma unroll
    for (int q = 0; q < kV; q += 4) {
      const float4 f = *reinterpret_cast<const float4*>(b + i + q);
      v[q] = f.x;
      v[q + 1] = f.y;
      v[q + 2] = f.z;
      v[q + 3] = f.w;
    }
  }
}
constexpr int VecOf(bool bf16) { return bf16 ? 8 : 4; }

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float BlockSum(float v) {
  __shared__ float part[32];
  v = WarpSum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> 5);
  float s = lane < warps ? part[lane] : 0.0f;
  return WarpSum(s);
}

}  // namespace
}  // namespace switchyard::cuda::detail
