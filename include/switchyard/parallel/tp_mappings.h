// Tensor- and sequence-parallel communication as forward/backward pairs (Megatron-Core's
// tensor_parallel/mappings.py; the table with bytes is in docs/tensor_parallel.md). Each pair is
// a struct with a static Forward and the Backward that differentiates it: Backward is the adjoint
// of Forward, so a layer built on the pairs writes its backward as its own math plus the pairs'
// Backward calls in reverse order, never a collective by hand.
//
// Conventions:
// - `group` is the group the tensor is split over (the tensor-parallel group; for UlyssesSwap the
//   one the sequence is split over): P = group.size(), this rank r = group.rank(). Every member
//   makes the same calls in the same order, one at a time.
// - Tensors are float32 with the token (sequence) dimension first: [rows, cols] for the
//   activations, [rows, ...] in general. "Sequence-sharded" means rank r holds rows
//   [r * rows / P, (r + 1) * rows / P) of the full [rows, ...] tensor; the pairs that split or
//   reduce-scatter along rows need rows % P == 0 (InvalidArgument naming the pair, the rows and P:
//   the caller pads the sequence).
// - Three kinds of value cross the pairs. Replicated: equal on every rank, the value counted once.
//   Per-rank: each rank's own tensor (partial sums of a row-parallel GEMM, the gradients of a
//   replicated input). Sequence-sharded: as above. Forward and Backward map between them so that
//   <Forward(x), y> = <x, Backward(y)>, where <a, b> sums over the ranks for per-rank and sharded
//   values and is taken once for replicated ones (tests/parallel/tp_mappings_test.cc checks it).
// - With a one-rank group every Forward and Backward returns its input (no collective, no copy),
//   so a layer built on the pairs is exactly the single-rank layer at tp 1.
// - "in place" results share storage with the argument; the others are new tensors (or, for a
//   split, a view of the argument's rows).
// - Bytes are counted in `stats` (may be null) under Traffic::kTensor (UlyssesSwap: kContext), in
//   the bus convention of parallel/comm_stats.h, with the time blocked in the collective.
#pragma once

#include <cstdint>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"
#include "switchyard/parallel/comm_stats.h"

namespace switchyard::parallel {

// Megatron's f: enters the tensor-parallel region (before a column-parallel GEMM).
// Forward: x replicated [rows, ...] -> the same x on every rank (returns x; no communication).
// Backward: dy per-rank [rows, ...] -> all-reduce, in place: replicated sum over ranks.
// Bytes: forward 0; backward 2 (P - 1) / P * size(dy).
struct CopyToTp {
  static Tensor Forward(comm::Communicator& group, const Tensor& x, CommStats* stats = nullptr);
  static Tensor Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats = nullptr);
};

// Megatron's g: leaves the tensor-parallel region (after a row-parallel GEMM).
// Forward: x per-rank partial sums [rows, ...] -> all-reduce, in place: replicated sum.
// Backward: dy replicated [rows, ...] -> dy on every rank (returns dy; no communication).
// Bytes: forward 2 (P - 1) / P * size(x); backward 0.
struct ReduceFromTp {
  static Tensor Forward(comm::Communicator& group, const Tensor& x, CommStats* stats = nullptr);
  static Tensor Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats = nullptr);
};

// Splits a replicated tensor along the sequence (e.g. the embedding's output entering a
// sequence-parallel region without a reduction).
// Forward: x replicated [rows, ...] -> this rank's rows [rows / P, ...] (a view; no
// communication). Backward: dy sharded [rows / P, ...] -> all-gather: replicated [rows, ...].
// Bytes: forward 0; backward (P - 1) * size(dy).
struct ScatterToSp {
  static Tensor Forward(comm::Communicator& group, const Tensor& x, CommStats* stats = nullptr);
  static Tensor Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats = nullptr);
};

// Sequence parallelism's f: all-gathers the tokens before a column-parallel GEMM (or the head).
// Forward: x sharded [rows / P, ...] -> all-gather: [rows, ...] on every rank (block p = rank p's
// rows). Backward: dy per-rank [rows, ...] (each rank's gradient of its copy) -> reduce-scatter:
// sharded [rows / P, ...], the sum over ranks of this rank's rows.
// Bytes: forward (P - 1) * size(x); backward (P - 1) / P * size(dy).
struct GatherFromSp {
  static Tensor Forward(comm::Communicator& group, const Tensor& x, CommStats* stats = nullptr);
  static Tensor Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats = nullptr);
};

// Sequence parallelism's g: reduce-scatters a row-parallel GEMM's partial sums to the tokens.
// Forward: x per-rank partial sums [rows, ...] -> reduce-scatter: sharded [rows / P, ...].
// Backward: dy sharded [rows / P, ...] -> all-gather: [rows, ...] on every rank.
// Bytes: forward (P - 1) / P * size(x); backward (P - 1) * size(dy).
struct ReduceScatterToSp {
  static Tensor Forward(comm::Communicator& group, const Tensor& x, CommStats* stats = nullptr);
  static Tensor Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats = nullptr);
};

// Ulysses (DeepSpeed) sequence <-> head swap for attention over a sequence-sharded batch.
// x is `batch` sequences of n local rows each, the rows of a sequence being rank r's block of it
// ([r * n, (r + 1) * n) of P * n), and `parts` equal column parts (q | k | v: parts = 3) of width
// W each, W % P == 0 (head group p = columns [p * W / P, (p + 1) * W / P) of every part).
// Forward: x sharded [batch * n, parts * W] -> all-to-all: [batch * P * n, parts * W / P], head
// group r of every part for the full sequences (sequence b's rows at [b * P * n, (b + 1) * P * n)
// in rank order). Backward: the inverse all-to-all, dy [batch * P * n, parts * W / P] ->
// [batch * n, parts * W]. Both are permutations across ranks (the adjoint is the inverse).
// Bytes: (P - 1) / P * size(input), forward and backward. InvalidArgument (naming the pair) when
// the rows do not divide by batch (forward: batch; backward: batch * P) or the columns by parts
// (and P).
struct UlyssesSwap {
  static Tensor Forward(comm::Communicator& group, const Tensor& x, int64_t batch, int64_t parts,
                        CommStats* stats = nullptr);
  static Tensor Backward(comm::Communicator& group, const Tensor& dy, int64_t batch, int64_t parts,
                         CommStats* stats = nullptr);
};

}  // namespace switchyard::parallel
