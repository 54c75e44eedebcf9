// The gate's kernels of the GPU MoE layer (kernels.cuh): the forward (scores, top-k, gate values,
// the losses' sums) and the backward (combine weights -> gate values -> logits, with the losses'
// gradients). Each mirrors a piece of src/moe/ (named in its comment).
#include <cfloat>
#include <climits>

#include "cuda/kernel_util.cuh"
#include "cuda/kernels.cuh"

namespace switchyard::cuda::detail {
namespace {

// ---- Gate (moe/gate.cc GateForward; losses.cc sums) ----

// kPerLane experts per lane: E <= 32 * kPerLane (the launcher picks the smallest that fits).
template <int kPerLane>
__global__ void GateKernel(GateArgs a) {
  __shared__ float block_probs[kMaxExperts];
  __shared__ int block_choices[kMaxExperts];
  const int e_num = static_cast<int>(a.num_experts), k = static_cast<int>(a.top_k);
  for (int e = threadIdx.x; e < e_num; e += blockDim.x) {
    block_probs[e] = 0.0f;
    block_choices[e] = 0;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.0f;
  double z_acc = 0;
  for (int64_t t = warp; t < a.num_tokens; t += warps) {
    const float* l = a.logits + t * e_num;
    float v[kPerLane], p[kPerLane];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      v[i] = e < e_num ? l[e] : -INFINITY;
      mx = fmaxf(mx, v[i]);
    }
    mx = WarpMax(mx);
    float sum = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      p[i] = e < e_num ? expf(v[i] - mx) : 0.0f;
      sum += p[i];
    }
    sum = WarpSum(sum);
    const float lse = mx + logf(sum);
    if (lane == 0) {
      a.lse[t] = lse;
      z_acc += static_cast<double>(lse) * lse;
    }
    float psum = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < e_num) {
        p[i] = a.score == kScoreSigmoid ? 1.0f / (1.0f + expf(-v[i])) : p[i] / sum;
        a.scores[t * e_num + e] = p[i];
        psum += p[i];
      }
    }
    // Aux probabilities: the softmax, or the sigmoid scores normalized per token.
    const float inv = a.score == kScoreSigmoid ? 1.0f / WarpSum(psum) : 1.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] += p[i] * inv;

    // Top-k of the scores (softmax_after_topk: of the logits) plus the expert bias; ties go to
    // the lower expert index.
    float sel[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      sel[i] = e < e_num ? (a.score == kScoreSoftmaxAfterTopK ? v[i] : p[i]) +
                               (a.expert_bias ? a.expert_bias[e] : 0.0f)
                         : -INFINITY;
    }
    uint32_t taken = 0;
    for (int j = 0; j < k; ++j) {
      float best = -INFINITY;
      int best_e = INT_MAX;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        if (e < e_num && !(taken >> i & 1u) && (sel[i] > best || best_e == INT_MAX)) {
          best = sel[i];
          best_e = e;
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(kFull, best, o);
        const int oe = __shfl_xor_sync(kFull, best_e, o);
        if (oe != INT_MAX && (best_e == INT_MAX || ob > best || (ob == best && oe < best_e))) {
          best = ob;
          best_e = oe;
        }
      }
      if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
      if (lane == 0) a.experts[t * k + j] = best_e;
    }
    __syncwarp();
    if (lane == 0) {
      const int32_t* ex = a.experts + t * k;
      float* s = a.choice_scores + t * k;
      float* g = a.gates + t * k;
      if (a.score == kScoreSoftmaxAfterTopK) {
        float m = -INFINITY;
        for (int j = 0; j < k; ++j) m = fmaxf(m, l[ex[j]]);
        float z = 0;
        for (int j = 0; j < k; ++j) {
          s[j] = expf(l[ex[j]] - m);
          z += s[j];
        }
        for (int j = 0; j < k; ++j) s[j] /= z;
      } else {
        for (int j = 0; j < k; ++j) s[j] = a.scores[t * e_num + ex[j]];
      }
      float gs = 0;
      for (int j = 0; j < k; ++j) gs += s[j];
      const bool norm = a.normalize && k > 1 && a.score != kScoreSoftmaxAfterTopK;
      const float denom = norm ? fmaxf(gs, kGateEps) : 1.0f;
      for (int j = 0; j < k; ++j) g[j] = norm ? s[j] / denom : s[j];
      const int counted = a.all_choices ? k : 1;
      for (int j = 0; j < counted; ++j) atomicAdd(&block_choices[ex[j]], 1);
    }
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < e_num) atomicAdd(&block_probs[e], acc[i]);
  }
  if (lane == 0 && z_acc != 0) atomicAdd(&a.stats->z_sum, z_acc);
  __syncthreads();
  for (int e = threadIdx.x; e < e_num; e += blockDim.x) {
    atomicAdd(&a.stats->probs[e], static_cast<double>(block_probs[e]));
    if (block_choices[e] != 0) atomicAdd(&a.stats->choices[e], block_choices[e]);
  }
}

// ---- Gate backward (plan.cc CombineWeightsBackward, gate.cc GateValuesBackward and
// GateBackward, losses.cc GateLossesBackward) ----

constexpr int kMaxTopK = 32;  // the launcher checks k <= kMaxTopK

__global__ void GateBackwardKernel(GateBackwardArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int e_num = static_cast<int>(a.num_experts), k = static_cast<int>(a.top_k);
  const double t_total = static_cast<double>(a.num_tokens);
  for (int64_t t = warp; t < a.num_tokens; t += warps) {
    const int64_t base = t * k;
    // d combine weights -> d gates (renormalize_after_drop) -> d choice scores (normalize_gate).
    float ds[kMaxTopK];
    float g_sum = 0, wdot = 0;
    for (int j = 0; j < k; ++j) {
      if (a.rows[base + j] < 0) continue;
      g_sum += a.gates[base + j];
      wdot += a.d_weights[base + j] * a.weights[base + j];
    }
    for (int j = 0; j < k; ++j) {
      float dg = 0;
      if (a.rows[base + j] >= 0) {
        const float dw = a.d_weights[base + j];
        dg = !a.renormalize ? dw : (g_sum > kGateEps ? (dw - wdot) / g_sum : dw / kGateEps);
      }
      ds[j] = dg;
    }
    const bool satk = a.score == kScoreSoftmaxAfterTopK;
    if (a.normalize && k > 1 && !satk) {
      float s_sum = 0, gdot = 0;
      for (int j = 0; j < k; ++j) {
        s_sum += a.choice_scores[base + j];
        gdot += ds[j] * a.gates[base + j];
      }
      for (int j = 0; j < k; ++j)
        ds[j] = s_sum > kGateEps ? (ds[j] - gdot) / s_sum : ds[j] / kGateEps;
    }
    // d scores -> d logits.
    const float* sc = a.scores + t * e_num;
    float dot = 0;  // softmax: sum_j P[e_j] ds_j; satk: sum_j s_j ds_j
    for (int j = 0; j < k; ++j) {
      dot += ds[j] * (satk ? a.choice_scores[base + j] : sc[a.experts[base + j]]);
    }
    // The GShard loss: dP_e = aux_scale * choices_e / T^2, the same for every token.
    float aux_dot = 0, sig_sum = 1;
    if (a.aux_scale != 0) {
      float part = 0, ssum = 0;
      for (int e = lane; e < e_num; e += 32) {
        part += static_cast<float>(a.aux_scale * a.stats->choices[e] / (t_total * t_total)) * sc[e];
        ssum += sc[e];
      }
      aux_dot = WarpSum(part);
      if (a.score == kScoreSigmoid) {
        sig_sum = WarpSum(ssum);
        aux_dot /= sig_sum;
      }
    }
    const float lse = a.lse[t];
    const float zf = static_cast<float>(a.z_coef * 2.0 * lse / t_total);
    for (int e = lane; e < e_num; e += 32) {
      float dsc = 0;
      int chosen = -1;
      for (int j = 0; j < k; ++j) {
        if (a.experts[base + j] == e) chosen = j;
      }
      if (chosen >= 0) dsc = ds[chosen];
      const float p = sc[e];
      float dl;
      if (a.score == kScoreSoftmax) {
        dl = p * (dsc - dot);
      } else if (a.score == kScoreSigmoid) {
        dl = dsc * p * (1.0f - p);
      } else {
        dl = chosen >= 0 ? a.choice_scores[base + chosen] * (dsc - dot) : 0.0f;
      }
      if (a.z_coef != 0) {
        const float soft = a.score == kScoreSigmoid ? expf(a.logits[t * e_num + e] - lse) : p;
        dl += zf * soft;
      }
      if (a.aux_scale != 0) {
        const float dp =
            static_cast<float>(a.aux_scale * a.stats->choices[e] / (t_total * t_total));
        if (a.score == kScoreSigmoid) {
          dl += (dp - aux_dot) / sig_sum * p * (1.0f - p);
        } else {
          dl += p * (dp - aux_dot);
        }
      }
      a.d_logits[t * e_num + e] = dl;
    }
  }
}

int GateBlocks(int64_t num_tokens) {
  int sms = 132;
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  }
  return Blocks(num_tokens, 8, static_cast<int64_t>(sms) * 8);
}

}  // namespace

void LaunchGate(const GateArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return;
  auto launch = [&](auto kernel) { kernel<<<GateBlocks(a.num_tokens), 256, 0, stream>>>(a); };
  if (a.num_experts <= 32) {
    launch(GateKernel<1>);
  } else if (a.num_experts <= 64) {
    launch(GateKernel<2>);
  } else if (a.num_experts <= 128) {
    launch(GateKernel<4>);
  } else if (a.num_experts <= 256) {
    launch(GateKernel<8>);
  } else {
    launch(GateKernel<static_cast<int>(kMaxExperts / 32)>);
  }
  CheckLaunch("gate");
}

void LaunchGateBackward(const GateBackwardArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return;
  if (a.top_k > kMaxTopK) throw std::runtime_error("gate backward: top_k above 32");
  GateBackwardKernel<<<GateBlocks(a.num_tokens), 256, 0, stream>>>(a);
  CheckLaunch("gate backward");
}

}  // namespace switchyard::cuda::detail
