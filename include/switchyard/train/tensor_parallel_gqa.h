// The tensor-parallel layers of the Hugging Face Llama-style families (docs/models.md), built on
// the column- and row-parallel layers of train/tensor_parallel.h with the same conventions
// (activations in the options' layout, parameters registered as the single-rank tensors' shards
// with Parameter::tp_shard set for P > 1, Backward accumulating the local gradients):
//
// - TensorParallelGqaAttention: grouped-query attention (train/gqa_attention.h's arithmetic)
//   with the query heads and the kv heads split over the group: "<prefix>q_proj.weight"
//   [H * d / P, M], "<prefix>k_proj.weight" and "<prefix>v_proj.weight" [KV * d / P, M] (rows:
//   whole heads), "<prefix>o_proj.weight" [M, H * d / P] (columns); optional biases (q, k, v,
//   and o for AttentionBias::kAll); optional QK-norm (RMSNorm over the whole projected q and k,
//   its sums of squares all-reduced over the group: "<prefix>q_norm.weight" [H * d / P],
//   "<prefix>k_norm.weight" [KV * d / P]); RoPE with one position per gathered row. KV divides
//   by P, or P by KV: then (Megatron's rule for tp > num_kv_heads) each kv head serves P / KV
//   ranks: k_proj, v_proj (and k_norm) are replicated whole on every rank ([KV * d, M], not tp
//   shards), each rank uses the rows of kv head rank / (P / KV), and the gradients of the
//   replicas are summed over the group (without sequence parallelism in the layer; with it the
//   data-parallel reduction of replicated parameters, which spans the tp ranks, sums them).
//   The layer is split in two around the attention core, as the model runs it: ProjectQkv gives
//   the core's q | k | v layout [n, 3 * (H / P) * d] with the kv heads repeated, and the core's
//   output goes through o_proj() (row-parallel).
// - TensorParallelSwiGlu: down(silu(gate x) * up x), gate and up column-parallel
//   ("<prefix>gate_proj.weight", "<prefix>up_proj.weight" [I / P, M]), down row-parallel
//   ("<prefix>down_proj.weight" [M, I / P]); biases with `bias`.
// Thread-safety as train/tensor_parallel.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "switchyard/train/feed_forward.h"
#include "switchyard/train/tensor_parallel.h"

namespace switchyard::train {

struct TpGqaOptions {
  int64_t model_dim = 0;     // M
  int64_t num_heads = 0;     // H (divides M; head_dim d = M / H)
  int64_t num_kv_heads = 0;  // KV, divides H (0: H)
  bool rope = true;
  double rope_theta = 10000.0;
  bool qkv_bias = false;
  bool o_bias = false;
  bool qk_norm = false;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;
  float o_init_std = 0.02f;
  uint64_t seed = 0;
};

struct TpGqaCache {
  Tensor x;             // [n, M] the projections' input (gathered over tokens with SP)
  Tensor q_pre, k_pre;  // qk_norm: the projections before the norm
  Tensor q_rstd, k_rstd;
  std::vector<int64_t> positions;  // [n]
};

class TensorParallelGqaAttention {
 public:
  TensorParallelGqaAttention(ParameterSet& params, const std::string& prefix, TpGqaOptions options,
                             comm::Communicator& group, TensorParallelOptions tp_options,
                             parallel::CommStats* stats = nullptr);

  int64_t local_heads() const { return local_heads_; }
  int64_t head_dim() const { return head_dim_; }
  const RowParallelLinear& o_proj() const { return o_; }
  parallel::CommStats* stats() const { return stats_; }

  // x in the options' layout -> qkv [n, 3 * local_heads * d] (n: the gathered rows; positions
  // [n], each row's position in its sequence, global under context parallelism). Precision
  // kBFloat16: the projections' GEMMs take bfloat16 operands (the input kept as bfloat16).
  Tensor ProjectQkv(const Tensor& x, std::span<const int64_t> positions, TpGqaCache* cache,
                    int threads, Precision precision = Precision::kFloat32) const;
  // d(qkv) in ProjectQkv's layout -> dx in x's layout; accumulates the projections' gradients.
  Tensor ProjectQkvBackward(const TpGqaCache& cache, const Tensor& dqkv, int threads) const;

 private:
  // P > KV: this rank's kv columns of the full (replicated) k / v, and the sum of the replicas'
  // gradients (SumKvGradsOverReplicas).
  Tensor KvColumns(const Tensor& full) const;
  Tensor PadKvColumns(const Tensor& local) const;
  void SumKvGradsOverReplicas(const std::function<Tensor()>& backward) const;
  bool replicated_kv() const { return kv_self_ != nullptr; }

  comm::Communicator& group_;
  TensorParallelOptions tp_options_;
  TpGqaOptions options_;
  int64_t head_dim_;
  int64_t local_heads_;
  int64_t local_kv_heads_;
  // P > KV (Megatron's rule): k_proj, v_proj (and k_norm) are whole on every rank, built over
  // this one-rank group, and the rank uses kv head kv_head_ = rank / (P / KV). Null otherwise.
  std::unique_ptr<comm::Communicator> kv_self_;
  int64_t kv_head_ = 0;
  ColumnParallelLinear q_;
  ColumnParallelLinear k_;
  ColumnParallelLinear v_;
  RowParallelLinear o_;
  Parameter* q_norm_ = nullptr;
  Parameter* k_norm_ = nullptr;
  parallel::CommStats* stats_;
};

class TensorParallelSwiGlu : public FeedForward {
 public:
  TensorParallelSwiGlu(ParameterSet& params, const std::string& prefix, int64_t model_dim,
                       int64_t intermediate_size, bool bias, float init_std, float out_init_std,
                       uint64_t seed, comm::Communicator& group, TensorParallelOptions options,
                       parallel::CommStats* stats = nullptr);

  bool is_moe() const override { return false; }
  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override;
  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override;
  void SavedTensors(const FeedForwardOutput& forward, std::vector<Tensor>* out) const override;

 private:
  comm::Communicator& group_;
  TensorParallelOptions options_;
  ColumnParallelLinear gate_;
  ColumnParallelLinear up_;
  RowParallelLinear down_;
  parallel::CommStats* stats_;
};

}  // namespace switchyard::train
