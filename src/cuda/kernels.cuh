// The CUDA kernels of the GPU MoE layer (moe_layer.cc strings them together). Plain C++
// declarations, so host code compiled by the C++ compiler can call the launchers.
// `bf16` selects bfloat16 buffers (uint16 bit patterns) instead of float32 for the arrays marked
// "act": activations and expert buffers. Every launcher enqueues on `stream` and checks the launch.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;  // NOLINT: cuda_runtime.h's name

namespace switchyard::cuda::detail {

// Largest E the gate kernel holds per token (32 experts per lane of a warp).
inline constexpr int64_t kMaxExperts = 1024;

enum ScoreKind : int { kScoreSoftmax = 0, kScoreSigmoid = 1, kScoreSoftmaxAfterTopK = 2 };

// Per-step statistics, one device block (zeroed before the gate), copied to the host once.
struct Stats {
  double z_sum;                  // sum_t lse_t^2
  double probs[kMaxExperts];     // sum_t P[t, e]
  int32_t choices[kMaxExperts];  // counted choices per expert (1st, or all k)
  int32_t loads[kMaxExperts];    // routed pairs per expert
};

struct GateArgs {
  const float* logits;       // [T, E]
  const float* expert_bias;  // [E] or null
  int64_t num_tokens, num_experts, top_k;
  int score;             // ScoreKind
  bool normalize;        // normalize_gate (ignored for softmax_after_topk)
  bool all_choices;      // aux loss counts all k choices (else the 1st)
  float* scores;         // [T, E] softmax (also for softmax_after_topk) or sigmoid
  float* lse;            // [T]
  int32_t* experts;      // [T, k]
  float* choice_scores;  // [T, k]
  float* gates;          // [T, k]
  Stats* stats;
};
void LaunchGate(const GateArgs& a, cudaStream_t stream);

// Slots before drops: slot[t * k + j] = the pair's rank among earlier pairs of its expert in slot
// order (choice-major or token order); also fills stats->loads. `scratch` holds
// SlotScratchInts(T * k, E) ints.
int64_t SlotScratchInts(int64_t pairs, int64_t num_experts);
void LaunchSlots(const int32_t* experts, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                 bool choice_major, int32_t* slot, int32_t* scratch, Stats* stats,
                 cudaStream_t stream);

// Drops (position policy: the first C slots survive; dropless keeps all), rows, the row -> pair
// map and the combine weights (renormalized over the survivors when `renormalize`).
//   offsets [E + 1] first row of each expert; row_pairs [num_rows] must be -1 beforehand.
void LaunchFinalize(const int32_t* experts, int32_t* slot, const float* gates,
                    const int32_t* offsets, int64_t num_tokens, int64_t top_k, int64_t capacity,
                    bool dropless, bool renormalize, int32_t* rows, int32_t* row_pairs,
                    float* weights, cudaStream_t stream);

// buf[r] = x[row_pairs[r] / k] (0 for padding rows). act arrays.
void LaunchDispatch(const void* x, const int32_t* row_pairs, int64_t num_rows, int64_t top_k,
                    int64_t dim, bool bf16, void* buf, cudaStream_t stream);

// h = act(a1 + b1) [* a3] over [rows, H]; padding rows (row_pairs < 0) get 0. a1, a3, h act.
void LaunchActivationForward(int activation, const void* a1, const void* a3, const float* b1,
                             const int32_t* row_experts, const int32_t* row_pairs, int64_t rows,
                             int64_t hidden, bool bf16, void* h, cudaStream_t stream);
// da1 = dh * act'(a1 + b1) [* a3], da3 = dh * act(a1 + b1). In place is not allowed.
void LaunchActivationBackward(int activation, const void* a1, const void* a3, const float* b1,
                              const void* dh, const int32_t* row_experts, const int32_t* row_pairs,
                              int64_t rows, int64_t hidden, bool bf16, void* da1, void* da3,
                              cudaStream_t stream);

// row_experts[r] = expert owning row r (from offsets), for the bias lookups.
void LaunchRowExperts(const int32_t* offsets, int64_t num_experts, int64_t num_rows,
                      int32_t* row_experts, cudaStream_t stream);

// y[t] = sum_j w[t, j] * (Y[rows[t, j]] + b2[e_j]) (x's dtype out; b2 may be null).
void LaunchCombine(const void* expert_out, const float* b2, const int32_t* experts,
                   const int32_t* rows, const float* weights, int64_t num_tokens, int64_t top_k,
                   int64_t dim, bool bf16, void* y, cudaStream_t stream);
// dY[r] = w * dy[t] (0 for padding) and d_weights[pair] = dy[t] . (Y[r] + b2[e]).
void LaunchCombineBackward(const void* dy, const void* expert_out, const float* b2,
                           const int32_t* row_experts, const int32_t* row_pairs,
                           const float* weights, int64_t num_rows, int64_t top_k, int64_t dim,
                           bool bf16, void* d_expert_out, float* d_weights, cudaStream_t stream);

// out[e, n] = sum over the filled rows of expert e of buf[r, n] (out zeroed here). buf act.
// max_count: the largest count (sizes the grid).
void LaunchSegmentColumnSum(const void* buf, const int32_t* offsets, const int32_t* counts,
                            int64_t num_experts, int64_t max_count, int64_t dim, bool bf16,
                            float* out, cudaStream_t stream);

// dx[t] = dx_gate[t] + sum_j dX[rows[t, j]] (dx in x's dtype; dX act).
void LaunchDispatchBackward(const float* dx_gate, const void* d_expert_in, const int32_t* rows,
                            int64_t num_tokens, int64_t top_k, int64_t dim, bool bf16, void* dx,
                            cudaStream_t stream);

struct GateBackwardArgs {
  const float* logits;         // [T, E]
  const float* scores;         // [T, E]
  const float* lse;            // [T]
  const int32_t* experts;      // [T, k]
  const float* choice_scores;  // [T, k]
  const float* gates;          // [T, k]
  const float* weights;        // [T, k] combine weights
  const int32_t* rows;         // [T, k]
  const float* d_weights;      // [T, k]
  const Stats* stats;
  int64_t num_tokens, num_experts, top_k;
  int score;
  bool normalize, renormalize;
  float aux_scale;  // aux_coef * (E / choices), 0 without a GShard loss
  float z_coef;
  float* d_logits;  // [T, E] out
};
void LaunchGateBackward(const GateBackwardArgs& a, cudaStream_t stream);

// float32 <-> bfloat16 conversions (n elements).
void LaunchToBf16(const float* in, int64_t n, void* out, cudaStream_t stream);
void LaunchToFloat(const void* in_bf16, int64_t n, float* out, cudaStream_t stream);

}  // namespace switchyard::cuda::detail
