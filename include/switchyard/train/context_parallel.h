// Context-parallel building blocks: the sequence split over the context-parallel (cp) group (plain
// or zigzag/load-balanced), and the attention core across it by Ulysses (DeepSpeed: all-to-all
// from sequence-sharded to head-sharded and back) or by ring attention (Megatron CP: K/V blocks
// circulate the ring, partial results merged by log-sum-exp, transfers overlapped with compute).
// docs/context_parallel.md has the diagrams, the bytes each call moves and the load balance.
//
// Conventions (as train/layers.h and train/tensor_parallel.h):
// - `group` is the context-parallel group: P = group.size() ranks, this rank r = group.rank().
//   Every member holds the same attention and makes the same calls in the same order.
// - A batch of batch_size sequences of seq_len tokens is split along the sequence: rank r holds
//   local_len = seq_len / P rows of every sequence (SequenceSplit says which), stored
//   [batch_size * local_len, cols] sequence after sequence. Local row i of a sequence is the
//   token at global position split.Position(i) (for position embeddings and masks).
// - seq_len must divide by P (plain split) or 2P (zigzag): InvalidArgument naming the length and
//   P otherwise; the caller pads (for a causal model, padding at the end of a sequence leaves the
//   real tokens' attention unchanged).
// - qkv is [batch_size * local_len, 3 * D] laid out q | k | v, head h at columns
//   [h * head_dim, (h + 1) * head_dim) of each part (the layout of CausalAttentionForward). The
//   attention output is [batch_size * local_len, D], the rows of the single-rank output of the
//   tokens this rank holds. Forward fills the cache; Backward returns d(qkv) in qkv's layout.
// - The core never materializes the [seq_len, seq_len] softmax: it keeps each row's log-sum-exp
//   and recomputes the probabilities in Backward (FlashAttention's recipe).
// - Bytes are counted in `stats` (may be null) under Traffic::kContext, in the bus convention of
//   parallel/comm_stats.h.
// Thread-safety: the calls run collectives on `group`, one at a time, in the same order on every
// rank; Forward and Backward do not write the object.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"
#include "switchyard/parallel/comm_stats.h"

namespace switchyard::train {

enum class SequenceSplitKind : uint8_t {
  kPlain,   // rank r holds chunk r of P equal chunks
  kZigzag,  // 2P equal chunks; rank r holds chunks r and 2P - 1 - r (causal load balance)
};

// One contiguous run of a rank's rows: local rows [row, row + length) are global positions
// [position, position + length).
struct SequenceChunk {
  int64_t row = 0;
  int64_t position = 0;
  int64_t length = 0;
};

// Which positions of a sequence each rank of the cp group holds.
class SequenceSplit {
 public:
  // InvalidArgument unless cp >= 1, 0 <= rank < cp, seq_len > 0 and seq_len divides by
  // Multiple(kind, cp) (the message names seq_len, cp and the split).
  SequenceSplit(SequenceSplitKind kind, int64_t seq_len, int cp, int rank);

  // The sequence lengths a split accepts are the multiples of this (P or 2P).
  static int64_t Multiple(SequenceSplitKind kind, int cp);

  SequenceSplitKind kind() const { return kind_; }
  int64_t seq_len() const { return seq_len_; }
  int cp() const { return cp_; }
  int rank() const { return rank_; }
  int64_t local_len() const { return seq_len_ / cp_; }
  // In local row order (one chunk for kPlain, two for kZigzag).
  const std::vector<SequenceChunk>& chunks() const { return chunks_; }
  // Global position of local row i (0 <= i < local_len).
  int64_t Position(int64_t local_row) const;
  // Position(i) for every local row.
  std::vector<int64_t> Positions() const;
  // This rank's rows of full [batch_size * seq_len, ...] (a copy): [batch_size * local_len, ...].
  Tensor Shard(const Tensor& full, int64_t batch_size) const;
  // Writes local [batch_size * local_len, ...] into this rank's rows of full [batch_size * seq_len,
  // ...] (the inverse of Shard).
  void Unshard(const Tensor& local, const Tensor& full, int64_t batch_size) const;

 private:
  SequenceSplitKind kind_;
  int64_t seq_len_;
  int cp_;
  int rank_;
  std::vector<SequenceChunk> chunks_;
};

enum class CpAlgorithm : uint8_t {
  kUlysses,  // all-to-all to head-sharded, local attention, all-to-all back; heads % P == 0
  kRing,     // K/V blocks circulate the ring, log-sum-exp merge, transfers overlapped
};

struct ContextParallelOptions {
  CpAlgorithm algorithm = CpAlgorithm::kRing;
  SequenceSplitKind split = SequenceSplitKind::kZigzag;
  bool causal = true;
};

// What one call computed and held on this rank (deterministic for given shapes).
struct CpWork {
  // Attention score elements computed (q·k products of head_dim), summed over heads and batch;
  // key tiles (of 64 keys, against query tiles of 64 rows; train/attention_flash.h) entirely in
  // the future are skipped and not counted, partially masked ones are counted whole.
  int64_t score_elements = 0;
  // Largest sum of the bytes of the tensors the call held at once (its input and output, cache,
  // communication buffers and per-thread scratch).
  int64_t peak_bytes = 0;
};

struct ContextParallelCache {
  Tensor qkv;  // the input as attention used it (Ulysses: head-sharded, full sequence)
  Tensor out;  // the attention output in the same layout
  Tensor lse;  // [batch_size, heads used, rows] log-sum-exp of each row's scores
  int64_t batch_size = 0;
};

// The attention core (softmax(q k^T / sqrt(head_dim), causal or not) v per sequence and head) with
// the sequence split over `group`.
class ContextParallelAttention {
 public:
  // InvalidArgument for num_heads <= 0, a seq_len the split does not accept (as SequenceSplit),
  // or (Ulysses) num_heads not divisible by P (the message names the group).
  ContextParallelAttention(comm::Communicator& group, int64_t num_heads, int64_t seq_len,
                           ContextParallelOptions options = {});
  // The same core on one rank without a group (cp 1: the memory-lean core of a one-rank model;
  // the algorithm is ring, which with one rank sends nothing).
  ContextParallelAttention(int64_t num_heads, int64_t seq_len, ContextParallelOptions options = {});

  const SequenceSplit& split() const { return split_; }
  const ContextParallelOptions& options() const { return options_; }
  int64_t num_heads() const { return num_heads_; }

  // qkv [batch_size * local_len, 3 * D] -> att [batch_size * local_len, D].
  Tensor Forward(const Tensor& qkv, int64_t batch_size, ContextParallelCache* cache,
                 int threads = 1, parallel::CommStats* stats = nullptr,
                 CpWork* work = nullptr) const;
  // datt [batch_size * local_len, D] -> d(qkv) [batch_size * local_len, 3 * D].
  Tensor Backward(const ContextParallelCache& cache, const Tensor& datt, int threads = 1,
                  parallel::CommStats* stats = nullptr, CpWork* work = nullptr) const;

 private:
  Tensor RingForward(const Tensor& qkv, int64_t batch, ContextParallelCache* cache, int threads,
                     parallel::CommStats* stats, CpWork* work) const;
  Tensor RingBackward(const ContextParallelCache& cache, const Tensor& datt, int threads,
                      parallel::CommStats* stats, CpWork* work) const;
  Tensor UlyssesForward(const Tensor& qkv, int64_t batch, ContextParallelCache* cache, int threads,
                        parallel::CommStats* stats, CpWork* work) const;
  Tensor UlyssesBackward(const ContextParallelCache& cache, const Tensor& datt, int threads,
                         parallel::CommStats* stats, CpWork* work) const;

  comm::Communicator* group_;  // null: one rank
  int64_t num_heads_;
  ContextParallelOptions options_;
  SequenceSplit split_;
};

}  // namespace switchyard::train
