// The CUDA kernels of the GPU MoE layer (kernels.cuh) but the gate's (gate_kernels.cu): slots,
// dispatch, activation, combine, reductions, conversions. Each mirrors a piece of src/moe/ (named
// in its comment); the formulas are those of docs/moe.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "cuda/kernel_util.cuh"
#include "cuda/kernels.cuh"

namespace switchyard::cuda::detail {
namespace {

// ---- Slots (moe/plan.cc MakeDispatchPlan, steps 2 and 5) ----

constexpr int kChunk = 1024;  // pairs per chunk: 32 steps of one warp

__device__ __forceinline__ int64_t PairAt(int64_t pos, int64_t t_num, int64_t k,
                                          bool choice_major) {
  return choice_major ? (pos % t_num) * k + pos / t_num : pos;
}

__global__ void ChunkCountKernel(const int32_t* experts, int64_t t_num, int64_t k, int e_num,
                                 bool choice_major, int32_t* chunk_counts) {
  extern __shared__ int32_t counts[];
  for (int e = threadIdx.x; e < e_num; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t n = t_num * k, begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int64_t pos = begin + threadIdx.x; pos < n && pos < begin + kChunk; pos += blockDim.x) {
    atomicAdd(&counts[experts[PairAt(pos, t_num, k, choice_major)]], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < e_num; e += blockDim.x) {
    chunk_counts[static_cast<int64_t>(blockIdx.x) * e_num + e] = counts[e];
  }
}

// Exclusive scan over the chunks, per expert; the totals are the loads.
__global__ void ChunkScanKernel(int32_t* chunk_counts, int64_t chunks, int e_num, Stats* stats) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= e_num) return;
  int32_t run = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int32_t v = chunk_counts[c * e_num + e];
    chunk_counts[c * e_num + e] = run;
    run += v;
  }
  stats->loads[e] = run;
}

// One warp per chunk walks its pairs in slot order, 32 at a time; lanes routed to the same expert
// in one step rank themselves by lane (= slot order).
__global__ void ChunkSlotKernel(const int32_t* experts, int64_t t_num, int64_t k, int e_num,
                                bool choice_major, const int32_t* chunk_base, int32_t* slot) {
  extern __shared__ int32_t run[];
  const int lane = threadIdx.x;
  for (int e = lane; e < e_num; e += 32) {
    run[e] = chunk_base[static_cast<int64_t>(blockIdx.x) * e_num + e];
  }
  __syncwarp();
  const int64_t n = t_num * k, begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int step = 0; step < kChunk / 32; ++step) {
    const int64_t pos = begin + step * 32 + lane;
    const bool valid = pos < n;
    const int64_t pair = valid ? PairAt(pos, t_num, k, choice_major) : -1;
    const int key = valid ? experts[pair] : e_num + lane;
    const unsigned peers = __match_any_sync(kFull, key);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    int base = 0;
    if (valid) base = run[key];
    __syncwarp();
    if (valid) {
      slot[pair] = base + rank;
      if (lane == 31 - __clz(peers)) run[key] = base + __popc(peers);
    }
    __syncwarp();
  }
}

__global__ void FinalizeKernel(const int32_t* experts, int32_t* slot, const float* gates,
                               const int32_t* offsets, int64_t t_num, int k, int64_t capacity,
                               bool dropless, bool renormalize, int32_t* rows, int32_t* row_pairs,
                               float* weights) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= t_num) return;
  float sum = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t i = t * k + j;
    const int32_t s = slot[i];
    const bool keep = dropless || s < capacity;
    const int32_t row = keep ? offsets[experts[i]] + s : -1;
    rows[i] = row;
    slot[i] = keep ? s : -1;
    if (keep) {
      row_pairs[row] = static_cast<int32_t>(i);
      sum += gates[i];
    }
  }
  const float denom = renormalize ? fmaxf(sum, kGateEps) : 1.0f;
  for (int j = 0; j < k; ++j) {
    const int64_t i = t * k + j;
    weights[i] = rows[i] >= 0 ? gates[i] / denom : 0.0f;
  }
}

__global__ void RowExpertsKernel(const int32_t* offsets, int e_num, int64_t num_rows,
                                 int32_t* row_experts) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= num_rows) return;
  int lo = 0, hi = e_num - 1;  // the last e with offsets[e] <= r
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  row_experts[r] = lo;
}

// ---- Dispatch and combine (moe/dispatch.cc) ----

// One block per row: 16-byte copies when the row allows them.
__global__ void DispatchKernel(const char* x, const int32_t* row_pairs, int64_t k,
                               int64_t row_bytes, char* buf) {
  const int64_t r = blockIdx.x;
  const int32_t pair = row_pairs[r];
  char* dst = buf + r * row_bytes;
  if (row_bytes % 16 == 0) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const int64_t n = row_bytes / 16;
    if (pair < 0) {
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = make_uint4(0, 0, 0, 0);
    } else {
      const uint4* s = reinterpret_cast<const uint4*>(x + (pair / k) * row_bytes);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    }
  } else {
    const char* s = pair < 0 ? nullptr : x + (pair / k) * row_bytes;
    for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) dst[i] = s ? s[i] : 0;
  }
}

__device__ __forceinline__ float ActValue(int act, float x) {
  if (act == kActRelu) return x > 0.0f ? x : 0.0f;
  if (act == kActGelu) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
  if (act == kActSilu) return x / (1.0f + expf(-x));
  return x;
}
__device__ __forceinline__ float ActGrad(int act, float x) {
  if (act == kActRelu) return x > 0.0f ? 1.0f : 0.0f;
  if (act == kActGelu) {
    const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
    const float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
    return cdf + x * pdf;
  }
  if (act == kActSilu) {
    const float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
  }
  return 1.0f;
}

// The activation kernels walk [rows, hidden] as one flat range of kV-wide accesses (hidden is a
// multiple of kV), so that blocks span several rows.
template <bool kBf16, int kV>
__global__ void ActivationForwardKernel(int act, const void* a1, const void* a3, const float* b1,
                                        const int32_t* row_experts, const int32_t* row_pairs,
                                        int64_t rows, int64_t hidden, void* h) {
  const int64_t n = rows * hidden;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kV; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * kV) {
    const int64_t r = i / hidden, c = i - r * hidden;
    float out[kV], z[kV], b[kV], q[kV];
    if (row_pairs[r] < 0) {
#pragma unroll
      for (int u = 0; u < kV; ++u) out[u] = 0.0f;
    } else {
      LdV<kBf16, kV>(a1, i, z);
      if (b1) {
        LdBias<kV>(b1, static_cast<int64_t>(row_experts[r]) * hidden + c, b);
#pragma unroll
        for (int u = 0; u < kV; ++u) z[u] += b[u];
      }
#pragma unroll
      for (int u = 0; u < kV; ++u) out[u] = ActValue(act, z[u]);
      if (a3) {
        LdV<kBf16, kV>(a3, i, q);
#pragma unroll
        for (int u = 0; u < kV; ++u) out[u] *= q[u];
      }
    }
    StV<kBf16, kV>(h, i, out);
  }
}

template <bool kBf16, int kV>
__global__ void ActivationBackwardKernel(int act, const void* a1, const void* a3, const float* b1,
                                         const void* dh, const int32_t* row_experts,
                                         const int32_t* row_pairs, int64_t rows, int64_t hidden,
                                         void* da1, void* da3) {
  const int64_t n = rows * hidden;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kV; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * kV) {
    const int64_t r = i / hidden, c = i - r * hidden;
    float g1[kV], g3[kV], z[kV], d[kV], b[kV], q[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) g1[u] = g3[u] = 0.0f;
    if (row_pairs[r] >= 0) {
      LdV<kBf16, kV>(a1, i, z);
      LdV<kBf16, kV>(dh, i, d);
      if (b1) {
        LdBias<kV>(b1, static_cast<int64_t>(row_experts[r]) * hidden + c, b);
#pragma unroll
        for (int u = 0; u < kV; ++u) z[u] += b[u];
      }
#pragma unroll
      for (int u = 0; u < kV; ++u) g1[u] = d[u] * ActGrad(act, z[u]);
      if (a3) {
        LdV<kBf16, kV>(a3, i, q);
#pragma unroll
        for (int u = 0; u < kV; ++u) {
          g1[u] *= q[u];
          g3[u] = d[u] * ActValue(act, z[u]);
        }
      }
    }
    StV<kBf16, kV>(da1, i, g1);
    if (a3) StV<kBf16, kV>(da3, i, g3);
  }
}

template <bool kBf16, int kV>
__global__ void CombineKernel(const void* expert_out, const float* b2, const int32_t* experts,
                              const int32_t* rows, const float* weights, int k, int64_t dim,
                              void* y) {
  const int64_t t = blockIdx.x;
  for (int64_t m = threadIdx.x * kV; m < dim; m += blockDim.x * kV) {
    float acc[kV], v[kV], b[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) acc[u] = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t i = t * k + j;
      const int32_t row = rows[i];
      if (row < 0) continue;
      const float w = weights[i];
      LdV<kBf16, kV>(expert_out, static_cast<int64_t>(row) * dim + m, v);
      if (b2) {
        LdBias<kV>(b2, static_cast<int64_t>(experts[i]) * dim + m, b);
#pragma unroll
        for (int u = 0; u < kV; ++u) v[u] += b[u];
      }
#pragma unroll
      for (int u = 0; u < kV; ++u) acc[u] += w * v[u];
    }
    StV<kBf16, kV>(y, t * dim + m, acc);
  }
}

template <bool kBf16, int kV>
__global__ void CombineBackwardKernel(const void* dy, const void* expert_out, const float* b2,
                                      const int32_t* row_experts, const int32_t* row_pairs,
                                      const float* weights, int64_t k, int64_t dim,
                                      void* d_expert_out, float* d_weights) {
  const int64_t r = blockIdx.x;
  const int32_t pair = row_pairs[r];
  if (pair < 0) {
    float zero[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) zero[u] = 0.0f;
    for (int64_t m = threadIdx.x * kV; m < dim; m += blockDim.x * kV) {
      StV<kBf16, kV>(d_expert_out, r * dim + m, zero);
    }
    return;
  }
  const int64_t t = pair / k;
  const float w = weights[pair];
  const float* bias = b2 ? b2 + static_cast<int64_t>(row_experts[r]) * dim : nullptr;
  float dot = 0.0f;
  for (int64_t m = threadIdx.x * kV; m < dim; m += blockDim.x * kV) {
    float d[kV], v[kV], b[kV], out[kV];
    LdV<kBf16, kV>(dy, t * dim + m, d);
    LdV<kBf16, kV>(expert_out, r * dim + m, v);
    if (bias) {
      LdBias<kV>(bias, m, b);
#pragma unroll
      for (int u = 0; u < kV; ++u) v[u] += b[u];
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      out[u] = w * d[u];
      dot += d[u] * v[u];
    }
    StV<kBf16, kV>(d_expert_out, r * dim + m, out);
  }
  dot = BlockSum(dot);
  if (threadIdx.x == 0) d_weights[pair] = dot;
}

constexpr int kSegRows = 128;

template <bool kBf16>
__global__ void SegmentColumnSumKernel(const void* buf, const int32_t* offsets,
                                       const int32_t* counts, int64_t dim, float* out) {
  const int e = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.z) * kSegRows;
  const int64_t end = min(static_cast<int64_t>(counts[e]), begin + kSegRows);
  if (c >= dim || begin >= end) return;
  float acc = 0.0f;
  const int64_t base = offsets[e];
  for (int64_t r = begin; r < end; ++r) acc += Ld<kBf16>(buf, (base + r) * dim + c);
  atomicAdd(&out[static_cast<int64_t>(e) * dim + c], acc);
}

template <bool kBf16, int kV>
__global__ void DispatchBackwardKernel(const float* dx_gate, const void* d_expert_in,
                                       const int32_t* rows, int k, int64_t dim, void* dx) {
  const int64_t t = blockIdx.x;
  for (int64_t m = threadIdx.x * kV; m < dim; m += blockDim.x * kV) {
    float acc[kV], v[kV];
    LdBias<kV>(dx_gate, t * dim + m, acc);
    for (int j = 0; j < k; ++j) {
      const int32_t row = rows[t * k + j];
      if (row < 0) continue;
      LdV<kBf16, kV>(d_expert_in, static_cast<int64_t>(row) * dim + m, v);
#pragma unroll
      for (int u = 0; u < kV; ++u) acc[u] += v[u];
    }
    StV<kBf16, kV>(dx, t * dim + m, acc);
  }
}

__global__ void ToBf16Kernel(const float* in, int64_t n, __nv_bfloat16* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16(in[i]);
  }
}
__global__ void ToFloatKernel(const __nv_bfloat16* in, int64_t n, float* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat162float(in[i]);
  }
}

// Block size for one row of `vectors` accesses: a multiple of 32, at most 256.

int RowThreads(int64_t vectors) {
  return vectors >= 256 ? 256 : static_cast<int>(std::max<int64_t>(32, (vectors + 31) / 32 * 32));
}

}  // namespace

int64_t SlotScratchInts(int64_t pairs, int64_t num_experts) {
  return ((pairs + kChunk - 1) / kChunk) * num_experts;
}

void LaunchSlots(const int32_t* experts, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                 bool choice_major, int32_t* slot, int32_t* scratch, Stats* stats,
                 cudaStream_t stream) {
  const int64_t pairs = num_tokens * top_k, chunks = (pairs + kChunk - 1) / kChunk;
  const int e_num = static_cast<int>(num_experts);
  const size_t smem = static_cast<size_t>(num_experts) * sizeof(int32_t);
  if (chunks > 0) {
    ChunkCountKernel<<<static_cast<unsigned>(chunks), 256, smem, stream>>>(
        experts, num_tokens, top_k, e_num, choice_major, scratch);
    CheckLaunch("slot counts");
  }
  ChunkScanKernel<<<Blocks(num_experts, 256), 256, 0, stream>>>(scratch, chunks, e_num, stats);
  CheckLaunch("slot scan");
  if (chunks > 0) {
    ChunkSlotKernel<<<static_cast<unsigned>(chunks), 32, smem, stream>>>(
        experts, num_tokens, top_k, e_num, choice_major, scratch, slot);
    CheckLaunch("slots");
  }
}

void LaunchFinalize(const int32_t* experts, int32_t* slot, const float* gates,
                    const int32_t* offsets, int64_t num_tokens, int64_t top_k, int64_t capacity,
                    bool dropless, bool renormalize, int32_t* rows, int32_t* row_pairs,
                    float* weights, cudaStream_t stream) {
  if (num_tokens == 0) return;
  FinalizeKernel<<<Blocks(num_tokens, 256), 256, 0, stream>>>(
      experts, slot, gates, offsets, num_tokens, static_cast<int>(top_k), capacity, dropless,
      renormalize, rows, row_pairs, weights);
  CheckLaunch("finalize");
}

void LaunchRowExperts(const int32_t* offsets, int64_t num_experts, int64_t num_rows,
                      int32_t* row_experts, cudaStream_t stream) {
  if (num_rows == 0) return;
  RowExpertsKernel<<<Blocks(num_rows, 256), 256, 0, stream>>>(
      offsets, static_cast<int>(num_experts), num_rows, row_experts);
  CheckLaunch("row experts");
}

void LaunchDispatch(const void* x, const int32_t* row_pairs, int64_t num_rows, int64_t top_k,
                    int64_t dim, bool bf16, void* buf, cudaStream_t stream) {
  if (num_rows == 0) return;
  const int64_t row_bytes = dim * (bf16 ? 2 : 4);
  DispatchKernel<<<static_cast<unsigned>(num_rows), 128, 0, stream>>>(
      static_cast<const char*>(x), row_pairs, top_k, row_bytes, static_cast<char*>(buf));
  CheckLaunch("dispatch");
}

void LaunchActivationForward(int activation, const void* a1, const void* a3, const float* b1,
                             const int32_t* row_experts, const int32_t* row_pairs, int64_t rows,
                             int64_t hidden, bool bf16, void* h, cudaStream_t stream) {
  if (rows == 0) return;
  const bool vec = hidden % VecOf(bf16) == 0;
  const int blocks = Blocks(rows * hidden / (vec ? VecOf(bf16) : 1), 256, 8192);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, 256, 0, stream>>>(activation, a1, a3, b1, row_experts, row_pairs, rows, hidden,
                                       h);
  };
  if (bf16) {
    vec ? launch(ActivationForwardKernel<true, 8>) : launch(ActivationForwardKernel<true, 1>);
  } else {
    vec ? launch(ActivationForwardKernel<false, 4>) : launch(ActivationForwardKernel<false, 1>);
  }
  CheckLaunch("activation forward");
}

void LaunchActivationBackward(int activation, const void* a1, const void* a3, const float* b1,
                              const void* dh, const int32_t* row_experts, const int32_t* row_pairs,
                              int64_t rows, int64_t hidden, bool bf16, void* da1, void* da3,
                              cudaStream_t stream) {
  if (rows == 0) return;
  const bool vec = hidden % VecOf(bf16) == 0;
  const int blocks = Blocks(rows * hidden / (vec ? VecOf(bf16) : 1), 256, 8192);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, 256, 0, stream>>>(activation, a1, a3, b1, dh, row_experts, row_pairs, rows,
                                       hidden, da1, da3);
  };
  if (bf16) {
    vec ? launch(ActivationBackwardKernel<true, 8>) : launch(ActivationBackwardKernel<true, 1>);
  } else {
    vec ? launch(ActivationBackwardKernel<false, 4>) : launch(ActivationBackwardKernel<false, 1>);
  }
  CheckLaunch("activation backward");
}

void LaunchCombine(const void* expert_out, const float* b2, const int32_t* experts,
                   const int32_t* rows, const float* weights, int64_t num_tokens, int64_t top_k,
                   int64_t dim, bool bf16, void* y, cudaStream_t stream) {
  if (num_tokens == 0) return;
  const auto blocks = static_cast<unsigned>(num_tokens);
  const int k = static_cast<int>(top_k);
  const bool vec = dim % VecOf(bf16) == 0;
  const int threads = RowThreads(vec ? dim / VecOf(bf16) : dim);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, threads, 0, stream>>>(expert_out, b2, experts, rows, weights, k, dim, y);
  };
  if (bf16) {
    vec ? launch(CombineKernel<true, 8>) : launch(CombineKernel<true, 1>);
  } else {
    vec ? launch(CombineKernel<false, 4>) : launch(CombineKernel<false, 1>);
  }
  CheckLaunch("combine");
}

void LaunchCombineBackward(const void* dy, const void* expert_out, const float* b2,
                           const int32_t* row_experts, const int32_t* row_pairs,
                           const float* weights, int64_t num_rows, int64_t top_k, int64_t dim,
                           bool bf16, void* d_expert_out, float* d_weights, cudaStream_t stream) {
  if (num_rows == 0) return;
  const auto blocks = static_cast<unsigned>(num_rows);
  const bool vec = dim % VecOf(bf16) == 0;
  const int threads = RowThreads(vec ? dim / VecOf(bf16) : dim);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, threads, 0, stream>>>(dy, expert_out, b2, row_experts, row_pairs, weights,
                                           top_k, dim, d_expert_out, d_weights);
  };
  if (bf16) {
    vec ? launch(CombineBackwardKernel<true, 8>) : launch(CombineBackwardKernel<true, 1>);
  } else {
    vec ? launch(CombineBackwardKernel<false, 4>) : launch(CombineBackwardKernel<false, 1>);
  }
  CheckLaunch("combine backward");
}

void LaunchSegmentColumnSum(const void* buf, const int32_t* offsets, const int32_t* counts,
                            int64_t num_experts, int64_t max_count, int64_t dim, bool bf16,
                            float* out, cudaStream_t stream) {
  if (cudaMemsetAsync(out, 0, static_cast<size_t>(num_experts * dim) * sizeof(float), stream) !=
      cudaSuccess) {
    CheckLaunch("column sum memset");
  }
  if (max_count == 0 || dim == 0) return;
  dim3 grid(static_cast<unsigned>((dim + 255) / 256), static_cast<unsigned>(num_experts),
            static_cast<unsigned>((max_count + kSegRows - 1) / kSegRows));
  if (bf16) {
    SegmentColumnSumKernel<true><<<grid, 256, 0, stream>>>(buf, offsets, counts, dim, out);
  } else {
    SegmentColumnSumKernel<false><<<grid, 256, 0, stream>>>(buf, offsets, counts, dim, out);
  }
  CheckLaunch("column sum");
}

void LaunchDispatchBackward(const float* dx_gate, const void* d_expert_in, const int32_t* rows,
                            int64_t num_tokens, int64_t top_k, int64_t dim, bool bf16, void* dx,
                            cudaStream_t stream) {
  if (num_tokens == 0) return;
  const auto blocks = static_cast<unsigned>(num_tokens);
  const int k = static_cast<int>(top_k);
  const bool vec = dim % VecOf(bf16) == 0;
  const int threads = RowThreads(vec ? dim / VecOf(bf16) : dim);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, threads, 0, stream>>>(dx_gate, d_expert_in, rows, k, dim, dx);
  };
  if (bf16) {
    vec ? launch(DispatchBackwardKernel<true, 8>) : launch(DispatchBackwardKernel<true, 1>);
  } else {
    vec ? launch(DispatchBackwardKernel<false, 4>) : launch(DispatchBackwardKernel<false, 1>);
  }
  CheckLaunch("dispatch backward");
}

void LaunchToBf16(const float* in, int64_t n, void* out, cudaStream_t stream) {
  if (n == 0) return;
  ToBf16Kernel<<<Blocks(n, 256, 4096), 256, 0, stream>>>(in, n, static_cast<__nv_bfloat16*>(out));
  CheckLaunch("to bfloat16");
}

void LaunchToFloat(const void* in_bf16, int64_t n, float* out, cudaStream_t stream) {
  if (n == 0) return;
  ToFloatKernel<<<Blocks(n, 256, 4096), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(in_bf16), n, out);
  CheckLaunch("to float32");
}

}  // namespace switchyard::cuda::detail
