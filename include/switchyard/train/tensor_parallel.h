// Tensor-parallel building blocks (Megatron-LM): column- and row-parallel linear layers with their
// conjugate communication operators, the sequence-parallel variant, the vocab-parallel embedding
// and cross-entropy, and the ring schedules that overlap the sequence-parallel all-gather and
// reduce-scatter with the GEMM (TransformerEngine's userbuffers idea). docs/tensor_parallel.md
// has the diagrams and the bytes each call moves.
//
// Conventions (as train/layers.h):
// - `group` is the tensor-parallel group: P = group.size() ranks, this rank r = group.rank(). Every
//   member holds the same layer and makes the same calls in the same order.
// - Activations are float32 [num_tokens, dim]. Without sequence parallelism the input of a
//   column-parallel layer and the output of a row-parallel layer are replicated (equal on every
//   rank, all num_tokens rows). With sequence parallelism they are sharded along tokens: rank r
//   holds rows [r * n, (r + 1) * n) of the full [P * n, dim] activation (SequenceShard).
// - Parameters keep the single-rank names ("<prefix>weight") with the local shape of the shard.
//   Their initial values are the single-rank Linear's/Embedding's for the same seed and name,
//   sliced: the concatenation over ranks equals the single-rank tensor.
// - Forward returns the output and fills the cache; Backward *accumulates* the local parameter
//   gradients and returns the input's gradient in the input's layout.
// - Bytes are counted in `stats` (may be null) under Traffic::kTensor, in the bus convention of
//   parallel/comm_stats.h; the per-call formulas are in docs/tensor_parallel.md.
// - Dimensions that must divide by P (out_dim of a column-parallel layer, in_dim of a row-parallel
//   one, the vocabulary) are checked at construction: InvalidArgument naming the layer.
// - With a one-rank group every layer here is the single-rank layer of train/layers.h bit for bit
//   (same arithmetic, float32 and bfloat16): the pairs return their argument, a parameter is the
//   whole tensor (Parameter::tp_shard stays kReplicated) and VocabParallelLoss is
//   SoftmaxCrossEntropy.
//   train/model.h builds its model only from these layers, over a one-rank group at tp 1.
// - Mixed precision (Precision::kBFloat16, mixed_precision.h) as the single-rank layers: the
//   GEMMs take bfloat16 operands and accumulate in float32; the communicated tensors stay
//   float32. Not with comm_overlap (InvalidArgument naming the layer).
// Thread-safety: the calls run collectives on `group`, so the calls of all the layers sharing a
// group must be made in the same order on every rank, one at a time; Forward does not write the
// layer and Backward writes the shared gradients (one Backward at a time per layer).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/train/feed_forward.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

struct TensorParallelOptions {
  // Activations outside the tensor-parallel region sharded along tokens (all-gather before the
  // column-parallel GEMM, reduce-scatter after the row-parallel one).
  bool sequence_parallel = false;
  // With sequence_parallel: the all-gather / reduce-scatter run as rings of P steps overlapped
  // with per-chunk GEMMs (RingAllGatherGemm, RingGemmReduceScatter). Same results within float
  // rounding (the ring adds the partial sums in another order). InvalidArgument without
  // sequence_parallel.
  bool comm_overlap = false;
};

// Rows [r * n / P, (r + 1) * n / P) of x [n, ...] (a view); InvalidArgument naming `what` unless n
// divides by P (the caller pads the sequence to a multiple of P).
Tensor SequenceShard(std::string_view what, const Tensor& x, const comm::Communicator& group);
// All-gather along tokens: part [n, dim] -> [P * n, dim], block p = rank p's part.
Tensor GatherSequence(comm::Communicator& group, const Tensor& part,
                      parallel::CommStats* stats = nullptr);

// Reduce-scatter along tokens: full [P * n, dim] (this rank's partial sums) -> [n, dim], the sum
// over ranks of block r. InvalidArgument naming `what` unless the rows divide by P.
Tensor ReduceScatterSequence(std::string_view what, comm::Communicator& group, const Tensor& full,
                             parallel::CommStats* stats = nullptr);
// The f of the options' layout, on the way into a column-parallel GEMM (or the output head):
// CopyToTp (forward identity, backward all-reduce), or with sequence_parallel GatherFromSp
// (forward all-gather of the tokens, backward reduce-scatter). x replicated [num_tokens, dim] or
// sharded [num_tokens / P, dim]; the forward returns [num_tokens, dim] and the backward takes the
// per-rank gradient [num_tokens, dim] and returns it in x's layout. One rank: both return their
// argument.
Tensor EnterTensorParallel(comm::Communicator& group, const TensorParallelOptions& options,
                           const Tensor& x, parallel::CommStats* stats = nullptr);
Tensor EnterTensorParallelBackward(comm::Communicator& group, const TensorParallelOptions& options,
                                   const Tensor& dy, parallel::CommStats* stats = nullptr);

// Sums t over the group in place (float32).
void AllReduceTensor(comm::Communicator& group, const Tensor& t,
                     parallel::CommStats* stats = nullptr);
// All-gather along columns: local [n, c] (this rank's columns [r * c, (r + 1) * c)) -> [n, P * c].
// One rank: returns `local`.
Tensor GatherColumns(comm::Communicator& group, const Tensor& local,
                     parallel::CommStats* stats = nullptr);

// Computes one chunk of a ring-overlapped GEMM: `block` is the index (in [0, P)) of the token
// block, `rows` its rows ([n, ...], a view the callback must not keep).
using BlockGemm = std::function<void(int block, const Tensor& rows)>;
// All-gather of part [n, dim] into gathered [P * n, dim] as a ring of P - 1 shifts (every rank
// sends the block it received last to rank r + 1); compute(b, block b) runs on each block as soon
// as it is present, while the next one travels. Blocks are visited in the order r, r - 1, ...
void RingAllGatherGemm(comm::Communicator& group, const Tensor& part, const Tensor& gathered,
                       const BlockGemm& compute, parallel::CommStats* stats = nullptr);
// Reduce-scatter of a product computed block by block: partial(b, out) writes this rank's
// partial sum of token block b ([n, dim], fully overwritten) into out. The accumulator travels
// the ring (P - 1 shifts), each hop overlapped with the next block's partial; output [n, dim]
// receives the sum over ranks of block r.
void RingGemmReduceScatter(comm::Communicator& group, const Tensor& output,
                           const BlockGemm& partial, parallel::CommStats* stats = nullptr);

// A parameter of a tensor-parallel layer and how it is split.
struct TpParameter {
  Parameter* param;
  TpShard shard;
};
// Rank `rank`'s shard (a copy) of the single-rank tensor `full` for a group of `size` ranks;
// InvalidArgument naming `what` when the split dimension does not divide.
Tensor ShardOf(std::string_view what, const Tensor& full, const TpShard& shard, int rank, int size);
// Inverse of ShardOf over the group: the single-rank tensor from every rank's shard `local` (an
// all-gather except for kReplicated), equal on every rank.
Tensor GatherFull(comm::Communicator& group, const Tensor& local, const TpShard& shard,
                  parallel::CommStats* stats = nullptr);

struct ColumnParallelCache {
  Tensor x;  // [num_tokens, in_dim] the GEMM's input (gathered over tokens with sequence_parallel)
};

// y = x · W_r^T + b_r, with W_r = rows [r * out_dim / P, (r + 1) * out_dim / P) of the single-rank
// weight [out_dim, in_dim] (and b_r of the bias). "<prefix>weight" [out_dim / P, in_dim],
// "<prefix>bias" [out_dim / P].
// fused_parts F > 1: the output is F equal parts fused in one weight (attention's q | k | v, F = 3)
// and each part is split on its own: W_r = rows [f * S + r * S / P, f * S + (r + 1) * S / P) for
// f = 0..F-1, S = out_dim / F, in that order (so y holds this rank's q | k | v). out_dim must
// divide by F * P.
// x: [num_tokens, in_dim] replicated, or [num_tokens / P, in_dim] with sequence_parallel.
// y: [num_tokens, out_dim / P] (this rank's output columns, all tokens).
// Backward(dy [num_tokens, out_dim / P]) returns dx in x's layout: all-reduced over the group, or
// reduce-scattered along tokens with sequence_parallel.
// Forward with Precision::kBFloat16 (as Linear::Forward): the gathered input is kept as bfloat16
// in the cache and Backward runs the bfloat16 products.
class ColumnParallelLinear {
 public:
  ColumnParallelLinear(ParameterSet& params, const std::string& prefix, int64_t in_dim,
                       int64_t out_dim, bool bias, float init_std, uint64_t seed,
                       comm::Communicator& group, TensorParallelOptions options = {},
                       int64_t fused_parts = 1);

  int64_t in_dim() const { return local_.in_dim(); }
  int64_t out_dim() const { return out_dim_; }
  int64_t local_out_dim() const { return local_.out_dim(); }
  const Linear& local() const { return local_; }
  // weight and bias: kRows with fused_parts.
  std::vector<TpParameter> parameters() const;

  Tensor Forward(const Tensor& x, ColumnParallelCache* cache, int threads = 1,
                 parallel::CommStats* stats = nullptr,
                 Precision precision = Precision::kFloat32) const;
  Tensor Backward(const ColumnParallelCache& cache, const Tensor& dy, int threads = 1,
                  parallel::CommStats* stats = nullptr) const;

 private:
  comm::Communicator& group_;
  TensorParallelOptions options_;
  int64_t out_dim_;
  int64_t fused_parts_;
  Linear local_;
};

struct RowParallelCache {
  Tensor x;  // [num_tokens, in_dim / P] input
};

// y = sum over ranks of x_r · W_r^T, then + bias once, with W_r = columns [r * in_dim / P,
// (r + 1) * in_dim / P) of the single-rank weight [out_dim, in_dim]. "<prefix>weight"
// [out_dim, in_dim / P], "<prefix>bias" [out_dim] (replicated).
// x: [num_tokens, in_dim / P] (the column-parallel layer's output layout).
// y: [num_tokens, out_dim] all-reduced (replicated), or with sequence_parallel reduce-scattered
// along tokens: [num_tokens / P, out_dim] (num_tokens must divide by P).
// Backward(dy in y's layout) returns dx [num_tokens, in_dim / P]. The bias gradient is complete on
// every rank without sequence_parallel; with it, it is this rank's tokens' part, to be summed over
// the group (AllReduceGrads) as for every parameter of the sequence-parallel region.
// With one rank there is nothing to reduce and the bias enters the GEMM as in Linear (the same
// arithmetic: the plain layer bit for bit). x may be bfloat16, or Forward given
// Precision::kBFloat16 (as Linear).
class RowParallelLinear {
 public:
  RowParallelLinear(ParameterSet& params, const std::string& prefix, int64_t in_dim,
                    int64_t out_dim, bool bias, float init_std, uint64_t seed,
                    comm::Communicator& group, TensorParallelOptions options = {});

  int64_t in_dim() const { return in_dim_; }
  int64_t out_dim() const { return local_.out_dim(); }
  int64_t local_in_dim() const { return local_.in_dim(); }
  const Linear& local() const { return local_; }
  Parameter* bias() const { return bias_; }
  // weight kColumns, bias kReplicated.
  std::vector<TpParameter> parameters() const;

  Tensor Forward(const Tensor& x, RowParallelCache* cache, int threads = 1,
                 parallel::CommStats* stats = nullptr,
                 Precision precision = Precision::kFloat32) const;
  Tensor Backward(const RowParallelCache& cache, const Tensor& dy, int threads = 1,
                  parallel::CommStats* stats = nullptr) const;

 private:
  // The bias is added after the reduction (not by local_): more than one rank.
  bool bias_after_reduce() const { return bias_ != nullptr && local_.bias() == nullptr; }

  comm::Communicator& group_;
  TensorParallelOptions options_;
  int64_t in_dim_;
  Linear local_;  // holds the bias only with one rank
  Parameter* bias_ = nullptr;
};

// Embedding with rows [r * V / P, (r + 1) * V / P) of the single-rank table [V, dim] on rank r:
// "<prefix>weight" [V / P, dim]. Each rank looks up the ids in its range (zeros elsewhere) and
// the rows are summed over the group: all-reduce, or reduce-scatter along tokens with
// sequence_parallel (output [num_tokens / P, dim], this rank's tokens).
// ids int32 [num_tokens] replicated, each in [0, V) (InvalidArgument naming the position).
// Backward(ids, dy in the output's layout) accumulates weight.grad for the ids in range (dy is
// all-gathered first with sequence_parallel), except for positions holding `skip_id` (the
// padding token, whose row gets no gradient; -1: none).
class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(ParameterSet& params, const std::string& prefix, int64_t num_embeddings,
                         int64_t dim, float init_std, uint64_t seed, comm::Communicator& group,
                         TensorParallelOptions options = {});

  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t vocab_start() const { return vocab_start_; }
  int64_t local_num_embeddings() const { return local_rows_; }
  Parameter& weight() const { return *weight_; }
  // weight kRows.
  std::vector<TpParameter> parameters() const;

  Tensor Forward(const Tensor& ids, parallel::CommStats* stats = nullptr) const;
  void Backward(const Tensor& ids, const Tensor& dy, parallel::CommStats* stats = nullptr,
                int64_t skip_id = -1) const;

 private:
  comm::Communicator& group_;
  TensorParallelOptions options_;
  int64_t num_embeddings_;
  int64_t dim_;
  int64_t vocab_start_;
  int64_t local_rows_;
  Parameter* weight_;
};

// SoftmaxCrossEntropy (train/layers.h) over logits split along the vocabulary: logits
// [num_tokens, V / P] are the columns [r * V / P, (r + 1) * V / P) of the full logits, targets
// int32 [num_tokens] replicated (< vocab_size, < 0 ignored). Communicates only per-token scalars:
// an all-reduce (max) of the row maxima and one all-reduce (sum) of the sums of exponentials and
// the target logits. The result is equal on every rank. With `dlogits` non-null it is set to this
// rank's columns of scale * d(loss)/d(logits) ([num_tokens, V / P]; no communication).
CrossEntropyResult VocabParallelCrossEntropy(comm::Communicator& group, const Tensor& logits,
                                             const Tensor& targets, int64_t vocab_size,
                                             Tensor* dlogits, float scale = 1.0f, int threads = 1,
                                             parallel::CommStats* stats = nullptr);
// The loss of the vocab-parallel output head (the model's): VocabParallelCrossEntropy over P > 1
// ranks, and over one rank SoftmaxCrossEntropy itself (its kernels compute the log-sum-exp and the
// softmax in another order than the per-token scalars above: this keeps the plain loss's bits).
// Arguments and result as VocabParallelCrossEntropy.
CrossEntropyResult VocabParallelLoss(comm::Communicator& group, const Tensor& logits,
                                     const Tensor& targets, int64_t vocab_size, Tensor* dlogits,
                                     float scale = 1.0f, int threads = 1,
                                     parallel::CommStats* stats = nullptr);

// Causal self-attention with its heads split over the group (Megatron-LM): QKV column-parallel
// with fused_parts 3 (rank r holds q | k | v of heads [r * H / P, (r + 1) * H / P)), the attention
// core (CausalAttentionForward) on those H / P heads, the output projection row-parallel.
// Parameters as CausalSelfAttention's ("<prefix>qkv.weight" [3 * d / P, d], "<prefix>qkv.bias",
// "<prefix>proj.weight" [d, d / P], "<prefix>proj.bias" [d]), initial values its own sliced.
// num_heads must divide by P (InvalidArgument naming the layer). x and y in the options' layout:
// replicated [batch_size * seq_len, d], or [batch_size * seq_len / P, d] with sequence_parallel
// (batch_size counts whole sequences either way). The cache holds the gathered input (x), this
// rank's qkv, probs and att; with Precision::kBFloat16 all four as bfloat16, as
// CausalSelfAttention keeps them (the same products and roundings).
class TensorParallelAttention {
 public:
  TensorParallelAttention(ParameterSet& params, const std::string& prefix, int64_t model_dim,
                          int64_t num_heads, float init_std, float proj_init_std, uint64_t seed,
                          comm::Communicator& group, TensorParallelOptions options,
                          parallel::CommStats* stats = nullptr);

  int64_t local_heads() const { return local_heads_; }
  // The projections and the stats they count into, for a caller that runs another attention
  // core between them on the same local_heads() (context parallelism, train/model.h).
  const ColumnParallelLinear& qkv() const { return qkv_; }
  const RowParallelLinear& proj() const { return proj_; }
  parallel::CommStats* stats() const { return stats_; }
  Tensor Forward(const Tensor& x, int64_t batch_size, int threads, AttentionCache* cache,
                 Precision precision = Precision::kFloat32) const;
  Tensor Backward(const AttentionCache& cache, const Tensor& dy, int threads) const;

 private:
  int64_t local_heads_;
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
  parallel::CommStats* stats_;
};

// The dense MLP of DenseFeedForward with fc1 column-parallel and fc2 row-parallel: the hidden
// activation stays on its rank ([num_tokens, hidden_dim / P]). Same parameter names, shards of
// the same initial values. x and y in the options' layout (as TensorParallelAttention).
// context.precision bf16 keeps bfloat16 activations as DenseFeedForward does.
class TensorParallelFeedForward : public FeedForward {
 public:
  TensorParallelFeedForward(ParameterSet& params, const std::string& prefix, int64_t model_dim,
                            int64_t hidden_dim, kernels::Activation activation, float init_std,
                            float out_init_std, uint64_t seed, comm::Communicator& group,
                            TensorParallelOptions options, parallel::CommStats* stats = nullptr);

  bool is_moe() const override { return false; }
  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override;
  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override;
  void SavedTensors(const FeedForwardOutput& forward, std::vector<Tensor>* out) const override;

 private:
  kernels::Activation activation_;
  ColumnParallelLinear fc1_;
  RowParallelLinear fc2_;
  parallel::CommStats* stats_;
};

// Sums each parameter's gradient over the group in place (the parameters of the sequence-parallel
// region: norms, the row-parallel bias), one all-reduce for all of them.
void AllReduceGrads(comm::Communicator& group, std::span<Parameter* const> params,
                    parallel::CommStats* stats = nullptr);

}  // namespace switchyard::train
