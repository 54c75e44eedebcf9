// Tensor-parallel linear layers, vocab-parallel embedding and cross-entropy, and the ring
// schedules overlapping the sequence-parallel collectives with the GEMMs
// (docs/tensor_parallel.md).
#include "switchyard/train/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

#include "switchyard/core/clock.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/reduce.h"
#include "switchyard/kernels/vec_math.h"
#include "switchyard/parallel/tp_mappings.h"
#include "train/parallel_for.h"

namespace switchyard::train {

using kernels::Trans;
using parallel::CommStats;
using parallel::CopyToTp;
using parallel::GatherFromSp;
using parallel::ReduceFromTp;
using parallel::ReduceScatterToSp;
using parallel::Traffic;

namespace {

double Seconds(comm::Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// Counts a completed collective: bytes on the wire (bus convention), time blocked in Wait and
// time the collective ran (hidden or not).
void Account(CommStats* stats, const comm::Work& work, double bytes, double issued_s,
             double wait_begin_s, double wait_end_s) {
  if (stats == nullptr) return;
  double busy = wait_end_s - issued_s;
  comm::Clock::time_point started, finished;
  if (work.Times(&started, &finished)) busy = Seconds(finished) - Seconds(started);
  const int t = static_cast<int>(Traffic::kTensor);
  stats->bytes[t] += bytes;
  stats->collectives += 1;
  stats->comm_seconds += wait_end_s - wait_begin_s;
  stats->busy_seconds += busy;
  stats->traffic_comm_seconds[t] += wait_end_s - wait_begin_s;
  stats->traffic_busy_seconds[t] += busy;
}

// Runs a collective to completion and counts it.
template <typename Start>
void Blocking(CommStats* stats, double bytes, Start&& start) {
  const double t0 = NowSeconds();
  comm::Work work = start();
  work.Wait();
  Account(stats, work, bytes, t0, t0, NowSeconds());
}

double AllReduceBytes(const comm::Communicator& g, double bytes) {
  const double p = g.size();
  return 2.0 * (p - 1) / p * bytes;
}

void AllReduceInPlace(comm::Communicator& g, const Tensor& t, CommStats* stats) {
  Blocking(stats, AllReduceBytes(g, static_cast<double>(t.nbytes())),
           [&] { return g.AllReduce(t); });
}

// InvalidArgument naming `what` unless `tokens` divides by the group's size.
void RequireTokensDivide(std::string_view what, int64_t tokens, const comm::Communicator& g) {
  SY_REQUIRE(tokens % g.size() == 0, InvalidArgument,
             "{}: {} tokens do not divide by the tensor-parallel size {} (sequence parallelism "
             "needs the token count padded to a multiple of it)",
             what, tokens, g.size());
}

Tensor ReduceScatterTokens(std::string_view what, comm::Communicator& g, const Tensor& full,
                           CommStats* stats) {
  const int64_t p = g.size();
  RequireTokensDivide(what, full.size(0), g);
  Shape s = full.shape();
  s[0] /= p;
  Tensor out = Tensor::Empty(s);
  Blocking(stats,
           static_cast<double>(p - 1) / static_cast<double>(p) * static_cast<double>(full.nbytes()),
           [&] { return g.ReduceScatter(full, out); });
  return out;
}

// A float32 tensor [rows, cols] (any rows; any cols for kAnySize); returns rows.
int64_t Rows(std::string_view what, const Tensor& t, int64_t cols) {
  ExpectShape(what, t, {kAnySize, cols});
  ExpectDType(what, t, DType::kFloat32);
  return t.size(0);
}

// dim / P, or InvalidArgument naming the layer and the dimension.
int64_t Split(std::string_view layer, std::string_view dim_name, int64_t dim,
              const comm::Communicator& g) {
  SY_REQUIRE(dim > 0 && dim % g.size() == 0, InvalidArgument,
             "{}: {} {} does not divide by the tensor-parallel size {} (group '{}')", layer,
             dim_name, dim, g.size(), g.name());
  return dim / g.size();
}

// out_dim / P for a column-parallel layer of `fused_parts` parts each split over the group.
int64_t FusedSplit(const std::string& prefix, int64_t out_dim, int64_t fused_parts,
                   const comm::Communicator& g) {
  const std::string layer = prefix + " column-parallel linear";
  if (fused_parts == 1) return Split(layer, "out_dim", out_dim, g);
  SY_REQUIRE(fused_parts > 1 && out_dim > 0 && out_dim % (fused_parts * g.size()) == 0,
             InvalidArgument,
             "{}: out_dim {} of {} fused parts does not divide by parts x tensor-parallel size "
             "({} x {}; group '{}')",
             layer, out_dim, fused_parts, fused_parts, g.size(), g.name());
  return out_dim / g.size();
}

void CheckOptions(std::string_view layer, const TensorParallelOptions& o) {
  SY_REQUIRE(!o.comm_overlap || o.sequence_parallel, InvalidArgument,
             "{}: communication-GEMM overlap needs sequence parallelism (it overlaps the "
             "sequence all-gather and reduce-scatter)",
             layer);
}

void CheckPrecision(std::string_view layer, const TensorParallelOptions& o, Precision precision) {
  SY_REQUIRE(precision == Precision::kFloat32 || !o.comm_overlap, InvalidArgument,
             "{}: the communication-GEMM overlap rings run float32 GEMMs only; 'precision' bf16 "
             "needs tp_comm_overlap off",
             layer);
}

// Marks the layer's parameters as split over the group; with one rank each is the whole tensor
// and stays kReplicated (reduced and checkpointed as a plain parameter).
void MarkShards(const std::vector<TpParameter>& params, const comm::Communicator& g) {
  if (g.size() == 1) return;
  for (const TpParameter& p : params) p.param->tp_shard = p.shard;
}

// The single-rank initial weight [rows, cols] for (seed, name).
Tensor FullInit(int64_t rows, int64_t cols, float init_std, uint64_t seed,
                const std::string& name) {
  Tensor w = Tensor::Empty({rows, cols});
  InitNormal(w, init_std, seed, name);
  return w;
}

// Starts one ring hop: `count` floats from `send` to rank r + 1, received from rank r - 1 into
// `recv`. The communicator has no point-to-point calls, so a hop is an all-to-all-v in which
// every rank sends to its successor only.
comm::Work StartShift(comm::Communicator& g, const float* send, float* recv, int64_t count) {
  const int p = g.size(), r = g.rank();
  std::vector<int64_t> send_counts(static_cast<size_t>(p), 0), recv_counts(send_counts);
  send_counts[static_cast<size_t>((r + 1) % p)] = count;
  recv_counts[static_cast<size_t>((r - 1 + p) % p)] = count;
  return g.AllToAllV(send, send_counts, {}, recv, recv_counts, {}, DType::kFloat32);
}

// Waits for a hop still in flight when the ring is left by an exception, so that the transport
// never writes into buffers that unwinding frees (the hop's own error is dropped: the exception
// in flight is the one reported).
class HopGuard {
 public:
  explicit HopGuard(const comm::Work& hop) : hop_(hop) {}
  HopGuard(const HopGuard&) = delete;
  HopGuard& operator=(const HopGuard&) = delete;
  ~HopGuard() {
    if (hop_.IsCompleted()) return;
    try {
      hop_.Wait();
    } catch (...) {  // the error that unwinds us is the one to report
    }
  }

 private:
  const comm::Work& hop_;
};

// Each row of y [n, cols] = bias.
void FillRows(const Tensor& y, const Parameter& bias) {
  const int64_t n = y.size(0), cols = y.size(1);
  const float* b = bias.value.data<float>();
  float* yp = y.data<float>();
  for (int64_t i = 0; i < n; ++i) std::copy_n(b, cols, yp + i * cols);
}

// bias.grad += column sums of dy [n, cols].
void AddColumnSums(const Tensor& dy, const Parameter& bias) {
  const int64_t n = dy.size(0), cols = dy.size(1);
  const float* d = dy.data<float>();
  float* g = bias.grad.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < cols; ++j) g[j] += d[i * cols + j];
  }
}

// The parameter gradients of y = x · W^T + b: W.grad += dy^T x, b.grad += column sums of dy.

}  // namespace

// ---- Sequence shards and the rings ----

Tensor SequenceShard(std::string_view what, const Tensor& x, const comm::Communicator& group) {
  SY_REQUIRE(x.defined() && x.dim() >= 1, InvalidArgument, "{}: expected [num_tokens, ...], got {}",
             what, x.defined() ? ShapeToString(x.shape()) : "undefined");
  const int64_t p = group.size(), n = x.size(0);
  RequireTokensDivide(what, n, group);
  return x.Slice(group.rank() * (n / p), (group.rank() + 1) * (n / p));
}

Tensor GatherSequence(comm::Communicator& group, const Tensor& part, CommStats* stats) {
  SY_REQUIRE(part.defined() && part.dim() >= 1, InvalidArgument,
             "sequence all-gather: expected [num_tokens, ...], got {}",
             part.defined() ? ShapeToString(part.shape()) : "undefined");
  Shape s = part.shape();
  s[0] *= group.size();
  Tensor out = Tensor::Empty(s, part.dtype());
  Blocking(stats, static_cast<double>(group.size() - 1) * static_cast<double>(part.nbytes()),
           [&] { return group.AllGather(part, out); });
  return out;
}

Tensor ReduceScatterSequence(std::string_view what, comm::Communicator& group, const Tensor& full,
                             CommStats* stats) {
  SY_REQUIRE(full.defined() && full.dim() >= 1, InvalidArgument,
             "{}: expected [num_tokens, ...], got {}", what,
             full.defined() ? ShapeToString(full.shape()) : "undefined");
  return ReduceScatterTokens(what, group, full, stats);
}

void AllReduceTensor(comm::Communicator& group, const Tensor& t, CommStats* stats) {
  ExpectDType("tensor-parallel all-reduce", t, DType::kFloat32);
  AllReduceInPlace(group, t, stats);
}

Tensor EnterTensorParallel(comm::Communicator& group, const TensorParallelOptions& options,
                           const Tensor& x, CommStats* stats) {
  return options.sequence_parallel ? GatherFromSp::Forward(group, x, stats)
                                   : CopyToTp::Forward(group, x, stats);
}

Tensor EnterTensorParallelBackward(comm::Communicator& group, const TensorParallelOptions& options,
                                   const Tensor& dy, CommStats* stats) {
  return options.sequence_parallel ? GatherFromSp::Backward(group, dy, stats)
                                   : CopyToTp::Backward(group, dy, stats);
}

Tensor GatherColumns(comm::Communicator& group, const Tensor& local, CommStats* stats) {
  const int64_t n = Rows("column all-gather", local, kAnySize), c = local.size(1);
  const int64_t p = group.size();
  if (p == 1) return local;
  Tensor blocks = GatherSequence(group, local, stats);  // [P * n, c], block q = rank q's columns
  Tensor out = Tensor::Empty({n, p * c});
  const float* src = blocks.data<float>();
  float* dst = out.data<float>();
  for (int64_t q = 0; q < p; ++q) {
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(src + (q * n + i) * c, c, dst + i * p * c + q * c);
    }
  }
  return out;
}

void RingAllGatherGemm(comm::Communicator& group, const Tensor& part, const Tensor& gathered,
                       const BlockGemm& compute, CommStats* stats) {
  const int p = group.size(), r = group.rank();
  const int64_t n = Rows("ring all-gather part", part, kAnySize);
  ExpectShape("ring all-gather output", gathered, {p * n, part.size(1)});
  ExpectDType("ring all-gather output", gathered, DType::kFloat32);
  gathered.Slice(r * n, (r + 1) * n).CopyFrom(part);
  const int64_t count = part.numel();
  float* base = gathered.data<float>();
  comm::Work hop;
  HopGuard guard(hop);
  for (int s = 0; s < p; ++s) {
    const int block = (r - s + p) % p;
    double issued = 0;
    if (s + 1 < p) {
      const int next = (block - 1 + p) % p;
      issued = NowSeconds();
      hop = StartShift(group, base + block * count, base + next * count, count);
    }
    compute(block, gathered.Slice(block * n, (block + 1) * n));
    if (s + 1 < p) {
      const double t0 = NowSeconds();
      hop.Wait();
      Account(stats, hop, static_cast<double>(count) * sizeof(float), issued, t0, NowSeconds());
    }
  }
}

void RingGemmReduceScatter(comm::Communicator& group, const Tensor& output,
                           const BlockGemm& partial, CommStats* stats) {
  const int p = group.size(), r = group.rank();
  Rows("ring reduce-scatter output", output, kAnySize);
  const int64_t count = output.numel();
  // Two accumulators: the one in flight and the one being computed; recv gets the predecessor's.
  Tensor acc[2], recv;
  if (p > 1) {
    acc[0] = Tensor::Empty(output.shape());
    acc[1] = Tensor::Empty(output.shape());
    recv = Tensor::Empty(output.shape());
  }
  comm::Work hop;
  HopGuard guard(hop);
  double issued = 0;
  for (int s = 0; s < p; ++s) {
    // Block b's accumulator starts at rank b + 1 and ends, after p - 1 hops, at rank b.
    const int block = ((r - s - 1) % p + p) % p;
    const Tensor& cur = s + 1 == p ? output : acc[s % 2];
    partial(block, cur);
    if (s > 0) {
      const double t0 = NowSeconds();
      hop.Wait();
      Account(stats, hop, static_cast<double>(count) * sizeof(float), issued, t0, NowSeconds());
      float* c = cur.data<float>();
      const float* in = recv.data<float>();
      for (int64_t i = 0; i < count; ++i) c[i] += in[i];
    }
    if (s + 1 < p) {
      issued = NowSeconds();
      hop = StartShift(group, cur.data<float>(), recv.data<float>(), count);
    }
  }
}

// ---- Shards of the single-rank tensors ----

Tensor ShardOf(std::string_view what, const Tensor& full, const TpShard& shard, int rank,
               int size) {
  SY_REQUIRE(full.defined() && full.dim() >= 1, InvalidArgument, "{}: expected a tensor, got {}",
             what, full.defined() ? ShapeToString(full.shape()) : "undefined");
  ExpectDType(what, full, DType::kFloat32);
  if (shard.dim == TpShard::Dim::kReplicated) return full.Clone();
  if (shard.dim == TpShard::Dim::kColumns) {
    SY_REQUIRE(full.dim() == 2 && full.size(1) % size == 0, InvalidArgument,
               "{}: columns of {} do not divide by the tensor-parallel size {}", what,
               ShapeToString(full.shape()), size);
    const int64_t rows = full.size(0), cols = full.size(1), local = cols / size;
    Tensor out = Tensor::Empty({rows, local});
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(full.data<float>() + i * cols + rank * local, local,
                  out.data<float>() + i * local);
    }
    return out;
  }
  const int64_t parts = shard.fused_parts;
  SY_REQUIRE(parts >= 1 && full.size(0) % (parts * size) == 0, InvalidArgument,
             "{}: rows of {} do not divide into {} fused parts x tensor-parallel size {}", what,
             ShapeToString(full.shape()), parts, size);
  // Rows [f * part + r * local, f * part + (r + 1) * local) of every fused part f.
  const int64_t part = full.size(0) / parts, local = part / size;
  Shape s = full.shape();
  s[0] = parts * local;
  Tensor out = Tensor::Empty(s);
  for (int64_t f = 0; f < parts; ++f) {
    out.Slice(f * local, (f + 1) * local)
        .CopyFrom(full.Slice(f * part + rank * local, f * part + (rank + 1) * local));
  }
  return out;
}

Tensor GatherFull(comm::Communicator& group, const Tensor& local, const TpShard& shard,
                  CommStats* stats) {
  SY_REQUIRE(local.defined() && local.dim() >= 1, InvalidArgument,
             "tensor-parallel gather: expected a shard, got {}",
             local.defined() ? ShapeToString(local.shape()) : "undefined");
  ExpectDType("tensor-parallel gather", local, DType::kFloat32);
  if (shard.dim == TpShard::Dim::kReplicated) return local.Clone();
  const int p = group.size();
  if (shard.dim == TpShard::Dim::kColumns) {
    SY_REQUIRE(local.dim() == 2, InvalidArgument,
               "tensor-parallel gather: a column shard must be 2-d, got {}",
               ShapeToString(local.shape()));
  }
  const int64_t parts = shard.dim == TpShard::Dim::kRows ? shard.fused_parts : 1;
  SY_REQUIRE(parts >= 1 && local.size(0) % parts == 0, InvalidArgument,
             "tensor-parallel gather: {} rows do not hold {} fused parts", local.size(0), parts);
  Tensor all = GatherSequence(group, local, stats);  // block q = rank q's shard
  if (shard.dim == TpShard::Dim::kColumns) {
    const int64_t rows = local.size(0), lc = local.size(1);
    Tensor full = Tensor::Empty({rows, p * lc});
    for (int q = 0; q < p; ++q) {
      for (int64_t i = 0; i < rows; ++i) {
        std::copy_n(all.data<float>() + (q * rows + i) * lc, lc,
                    full.data<float>() + i * p * lc + q * lc);
      }
    }
    return full;
  }
  const int64_t lr = local.size(0) / parts, part = lr * p;
  Shape s = local.shape();
  s[0] = parts * part;
  Tensor full = Tensor::Empty(s);
  for (int q = 0; q < p; ++q) {
    for (int64_t f = 0; f < parts; ++f) {
      const int64_t src = q * parts * lr + f * lr, dst = f * part + q * lr;
      full.Slice(dst, dst + lr).CopyFrom(all.Slice(src, src + lr));
    }
  }
  return full;
}

// ---- ColumnParallelLinear ----

ColumnParallelLinear::ColumnParallelLinear(ParameterSet& params, const std::string& prefix,
                                           int64_t in_dim, int64_t out_dim, bool bias,
                                           float init_std, uint64_t seed, comm::Communicator& group,
                                           TensorParallelOptions options, int64_t fused_parts)
    : group_(group),
      options_(options),
      out_dim_(out_dim),
      fused_parts_(fused_parts),
      local_(params, prefix, in_dim, FusedSplit(prefix, out_dim, fused_parts, group), bias,
             init_std, seed) {
  CheckOptions(prefix + " column-parallel linear", options);
  local_.weight().value.CopyFrom(
      ShardOf(prefix + "weight", FullInit(out_dim, in_dim, init_std, seed, prefix + "weight"),
              {TpShard::Dim::kRows, fused_parts}, group.rank(), group.size()));
  MarkShards(parameters(), group);
}

std::vector<TpParameter> ColumnParallelLinear::parameters() const {
  std::vector<TpParameter> out = {{&local_.weight(), {TpShard::Dim::kRows, fused_parts_}}};
  if (local_.bias() != nullptr) out.push_back({local_.bias(), {TpShard::Dim::kRows, fused_parts_}});
  return out;
}

Tensor ColumnParallelLinear::Forward(const Tensor& x, ColumnParallelCache* cache, int threads,
                                     CommStats* stats, Precision precision) const {
  const int64_t in = in_dim(), lo = local_out_dim();
  const int64_t n = Rows("column-parallel linear x", x, in);
  CheckPrecision("column-parallel linear", options_, precision);
  Tensor input;
  Tensor y;
  if (!options_.comm_overlap) {
    // f: x enters the tensor-parallel region (with sequence parallelism: gathered over tokens).
    input = EnterTensorParallel(group_, options_, x, stats);
    // Mixed precision: the GEMM's operand, kept for backward (bfloat16 values either way).
    if (precision == Precision::kBFloat16) input = ToBFloat16(input, threads);
    y = local_.Forward(input, threads);
  } else {
    const int64_t p = group_.size();
    input = Tensor::Empty({p * n, in});
    y = Tensor::Empty({p * n, lo});
    float beta = 0.0f;
    if (local_.bias() != nullptr) {
      FillRows(y, *local_.bias());
      beta = 1.0f;
    }
    const float* w = local_.weight().value.data<float>();
    RingAllGatherGemm(
        group_, x, input,
        [&](int b, const Tensor& rows) {
          ParallelGemm(Trans::kNo, Trans::kYes, n, lo, in, 1.0f, rows.data<float>(), in, w, in,
                       beta, y.data<float>() + b * n * lo, lo, threads);
        },
        stats);
  }
  if (cache != nullptr) cache->x = input;
  return y;
}

Tensor ColumnParallelLinear::Backward(const ColumnParallelCache& cache, const Tensor& dy,
                                      int threads, CommStats* stats) const {
  const int64_t in = in_dim(), lo = local_out_dim();
  ExpectShape("column-parallel linear cache.x", cache.x, {kAnySize, in});
  const int64_t n = cache.x.size(0);
  ExpectShape("column-parallel linear dy", dy, {n, lo});
  ExpectDType("column-parallel linear dy", dy, DType::kFloat32);
  if (!options_.comm_overlap) {
    Tensor dx = local_.Backward(cache.x, dy, threads);  // partial over the output columns
    return EnterTensorParallelBackward(group_, options_, dx, stats);
  }
  const int64_t p = group_.size(), part = n / p;
  Tensor dx = Tensor::Empty({part, in});
  const float* w = local_.weight().value.data<float>();
  float* dw = local_.weight().grad.data<float>();
  // Each token block's share of the weight gradient is computed inside the ring too, so that it
  // also runs while the accumulator travels.
  RingGemmReduceScatter(
      group_, dx,
      [&](int b, const Tensor& out) {
        const float* dy_b = dy.data<float>() + b * part * lo;
        ParallelGemm(Trans::kNo, Trans::kNo, part, in, lo, 1.0f, dy_b, lo, w, in, 0.0f,
                     out.data<float>(), in, threads);
        ParallelGemm(Trans::kYes, Trans::kNo, lo, in, part, 1.0f, dy_b, lo,
                     cache.x.data<float>() + b * part * in, in, 1.0f, dw, in, threads);
      },
      stats);
  if (local_.bias() != nullptr) AddColumnSums(dy, *local_.bias());
  return dx;
}

// ---- RowParallelLinear ----

RowParallelLinear::RowParallelLinear(ParameterSet& params, const std::string& prefix,
                                     int64_t in_dim, int64_t out_dim, bool bias, float init_std,
                                     uint64_t seed, comm::Communicator& group,
                                     TensorParallelOptions options)
    : group_(group),
      options_(options),
      in_dim_(in_dim),
      local_(params, prefix, Split(prefix + " row-parallel linear", "in_dim", in_dim, group),
             out_dim, /*bias=*/bias && group.size() == 1, init_std, seed) {
  CheckOptions(prefix + " row-parallel linear", options);
  local_.weight().value.CopyFrom(
      ShardOf(prefix + "weight", FullInit(out_dim, in_dim, init_std, seed, prefix + "weight"),
              {TpShard::Dim::kColumns}, group.rank(), group.size()));
  bias_ = local_.bias();
  if (bias && bias_ == nullptr) bias_ = &params.Add(prefix + "bias", Tensor::Zeros({out_dim}));
  MarkShards(parameters(), group);
}

std::vector<TpParameter> RowParallelLinear::parameters() const {
  std::vector<TpParameter> out = {{&local_.weight(), {TpShard::Dim::kColumns}}};
  if (bias_ != nullptr) out.push_back({bias_, {TpShard::Dim::kReplicated}});
  return out;
}

Tensor RowParallelLinear::Forward(const Tensor& x, RowParallelCache* cache, int threads,
                                  CommStats* stats, Precision precision) const {
  const int64_t li = local_in_dim(), out = out_dim();
  ExpectShape("row-parallel linear x", x, {kAnySize, li});
  const int64_t n = x.size(0);
  if (options_.sequence_parallel) RequireTokensDivide("row-parallel linear x", n, group_);
  CheckPrecision("row-parallel linear", options_,
                 x.dtype() == DType::kBFloat16 ? Precision::kBFloat16 : precision);
  Tensor y;
  if (!options_.comm_overlap) {
    // g: the partial sums leave the tensor-parallel region (sequence parallelism: scattered).
    Tensor partial = local_.Forward(x, threads, precision);
    y = options_.sequence_parallel ? ReduceScatterToSp::Forward(group_, partial, stats)
                                   : ReduceFromTp::Forward(group_, partial, stats);
  } else {
    const int64_t part = n / group_.size();
    y = Tensor::Empty({part, out});
    const float* w = local_.weight().value.data<float>();
    RingGemmReduceScatter(
        group_, y,
        [&](int b, const Tensor& dst) {
          ParallelGemm(Trans::kNo, Trans::kYes, part, out, li, 1.0f,
                       x.data<float>() + b * part * li, li, w, li, 0.0f, dst.data<float>(), out,
                       threads);
        },
        stats);
  }
  if (bias_after_reduce() || (options_.comm_overlap && bias_ != nullptr)) {
    const float* b = bias_->value.data<float>();
    float* yp = y.data<float>();
    for (int64_t i = 0; i < y.size(0); ++i) {
      for (int64_t j = 0; j < out; ++j) yp[i * out + j] += b[j];
    }
  }
  if (cache != nullptr) cache->x = x;
  return y;
}

Tensor RowParallelLinear::Backward(const RowParallelCache& cache, const Tensor& dy, int threads,
                                   CommStats* stats) const {
  const int64_t li = local_in_dim(), out = out_dim();
  ExpectShape("row-parallel linear cache.x", cache.x, {kAnySize, li});
  const int64_t n = cache.x.size(0);
  const int64_t p = group_.size();
  const int64_t dy_rows = options_.sequence_parallel ? n / p : n;
  ExpectShape("row-parallel linear dy", dy, {dy_rows, out});
  ExpectDType("row-parallel linear dy", dy, DType::kFloat32);
  // With one rank local_ holds the bias and its Backward adds the gradient (as Linear).
  if (bias_after_reduce() || (options_.comm_overlap && bias_ != nullptr)) {
    AddColumnSums(dy, *bias_);
  }
  if (!options_.comm_overlap) {
    const Tensor full = options_.sequence_parallel ? ReduceScatterToSp::Backward(group_, dy, stats)
                                                   : ReduceFromTp::Backward(group_, dy, stats);
    return local_.Backward(cache.x, full, threads);
  }
  Tensor dy_full = Tensor::Empty({n, out});
  Tensor dx = Tensor::Empty({n, li});
  const float* w = local_.weight().value.data<float>();
  float* dw = local_.weight().grad.data<float>();
  // dx and the weight gradient of each token block as soon as its dy has arrived.
  RingAllGatherGemm(
      group_, dy, dy_full,
      [&](int b, const Tensor& rows) {
        ParallelGemm(Trans::kNo, Trans::kNo, dy_rows, li, out, 1.0f, rows.data<float>(), out, w, li,
                     0.0f, dx.data<float>() + b * dy_rows * li, li, threads);
        ParallelGemm(Trans::kYes, Trans::kNo, out, li, dy_rows, 1.0f, rows.data<float>(), out,
                     cache.x.data<float>() + b * dy_rows * li, li, 1.0f, dw, li, threads);
      },
      stats);
  return dx;
}

// ---- VocabParallelEmbedding ----

VocabParallelEmbedding::VocabParallelEmbedding(ParameterSet& params, const std::string& prefix,
                                               int64_t num_embeddings, int64_t dim, float init_std,
                                               uint64_t seed, comm::Communicator& group,
                                               TensorParallelOptions options)
    : group_(group),
      options_(options),
      num_embeddings_(num_embeddings),
      dim_(dim),
      local_rows_(Split(prefix + " vocab-parallel embedding", "num_embeddings (vocabulary)",
                        num_embeddings, group)) {
  CheckOptions(prefix + " vocab-parallel embedding", options);
  SY_REQUIRE(dim > 0, InvalidArgument, "{}: Embedding dim must be positive, got {}", prefix, dim);
  vocab_start_ = group.rank() * local_rows_;
  weight_ = &params.Add(
      prefix + "weight",
      ShardOf(prefix + "weight", FullInit(num_embeddings, dim, init_std, seed, prefix + "weight"),
              {TpShard::Dim::kRows}, group.rank(), group.size()),
      {.weight_decay = true});
  MarkShards(parameters(), group);
}

std::vector<TpParameter> VocabParallelEmbedding::parameters() const {
  return {{weight_, {TpShard::Dim::kRows}}};
}

namespace {

void CheckIds(std::string_view what, const Tensor& ids, int64_t vocab) {
  SY_REQUIRE(ids.defined() && ids.dim() == 1, InvalidArgument,
             "{}: expected a 1-d int32 tensor [num_tokens], got {}", what,
             ids.defined() ? ids.ToString() : "undefined");
  ExpectDType(what, ids, DType::kInt32);
  const int32_t* id = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    SY_REQUIRE(id[i] >= 0 && id[i] < vocab, InvalidArgument,
               "{}[{}] = {}: expected a value in [0, {})", what, i, id[i], vocab);
  }
}

}  // namespace

Tensor VocabParallelEmbedding::Forward(const Tensor& ids, CommStats* stats) const {
  CheckIds("vocab-parallel embedding ids", ids, num_embeddings_);
  const int64_t n = ids.numel();
  Tensor y = Tensor::Zeros({n, dim_});
  const int32_t* id = ids.data<int32_t>();
  const float* w = weight_->value.data<float>();
  float* yp = y.data<float>();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = id[t] - vocab_start_;
    if (row >= 0 && row < local_rows_) std::copy_n(w + row * dim_, dim_, yp + t * dim_);
  }
  if (!options_.sequence_parallel) return ReduceFromTp::Forward(group_, y, stats);
  RequireTokensDivide("vocab-parallel embedding output", n, group_);
  return ReduceScatterToSp::Forward(group_, y, stats);
}

void VocabParallelEmbedding::Backward(const Tensor& ids, const Tensor& dy, CommStats* stats,
                                      int64_t skip_id) const {
  CheckIds("vocab-parallel embedding ids", ids, num_embeddings_);
  const int64_t n = ids.numel();
  if (options_.sequence_parallel) {
    ExpectShape("vocab-parallel embedding dy", dy, {n / group_.size(), dim_});
  }
  const Tensor full = options_.sequence_parallel ? ReduceScatterToSp::Backward(group_, dy, stats)
                                                 : ReduceFromTp::Backward(group_, dy, stats);
  ExpectShape("vocab-parallel embedding dy", full, {n, dim_});
  ExpectDType("vocab-parallel embedding dy", full, DType::kFloat32);
  const int32_t* id = ids.data<int32_t>();
  const float* d = full.data<float>();
  float* g = weight_->grad.data<float>();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = id[t] - vocab_start_;
    if (row < 0 || row >= local_rows_ || id[t] == skip_id) continue;
    for (int64_t j = 0; j < dim_; ++j) g[row * dim_ + j] += d[t * dim_ + j];
  }
}

// ---- Vocab-parallel cross-entropy ----

CrossEntropyResult VocabParallelCrossEntropy(comm::Communicator& group, const Tensor& logits,
                                             const Tensor& targets, int64_t vocab_size,
                                             Tensor* dlogits, float scale, int threads,
                                             CommStats* stats) {
  const int64_t lv = Split("vocab-parallel cross-entropy", "vocab_size", vocab_size, group);
  const int64_t n = Rows("vocab-parallel cross-entropy logits", logits, lv);
  ExpectShape("vocab-parallel cross-entropy targets", targets, {n});
  ExpectDType("vocab-parallel cross-entropy targets", targets, DType::kInt32);
  const int32_t* tp = targets.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    SY_REQUIRE(tp[i] < vocab_size, InvalidArgument,
               "vocab-parallel cross-entropy targets[{}] = {}: expected < {}", i, tp[i],
               vocab_size);
  }
  const int64_t start = group.rank() * lv;
  const float* lp = logits.data<float>();
  // Per-token maximum over the whole vocabulary.
  Tensor row_max = Tensor::Empty({n});
  float* mx = row_max.data<float>();
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) mx[i] = kernels::Max(lp + i * lv, lv);
  });
  comm::AllReduceOptions max_op;
  max_op.reduce_op = comm::ReduceOp::kMax;
  Blocking(stats, AllReduceBytes(group, static_cast<double>(row_max.nbytes())), [&] {
    return group.AllReduce(mx, mx, static_cast<size_t>(n), DType::kFloat32, max_op);
  });
  // [sum of exp(logit - max) | target logit] per token, summed over the ranks.
  Tensor sums = Tensor::Empty({2 * n});
  float* se = sums.data<float>();
  float* target_logit = se + n;
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = lp + i * lv;
      const float m = mx[i];
      se[i] = kernels::SumOver(lv, [&](int64_t j) { return kernels::vec::Exp(row[j] - m); });
      const int64_t local = static_cast<int64_t>(tp[i]) - start;
      target_logit[i] = tp[i] >= 0 && local >= 0 && local < lv ? row[local] : 0.0f;
    }
  });
  AllReduceInPlace(group, sums, stats);
  CrossEntropyResult r;
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (tp[i] < 0) continue;
    ++r.count;
    total += static_cast<double>(mx[i]) + std::log(static_cast<double>(se[i])) - target_logit[i];
  }
  r.loss = r.count > 0 ? total / static_cast<double>(r.count) : 0.0;
  if (dlogits == nullptr) return r;
  // d(loss)/d(logits) = coef * (softmax - onehot), this rank's columns.
  const float coef = r.count > 0 ? scale / static_cast<float>(r.count) : 0.0f;
  *dlogits = Tensor::Empty({n, lv});
  float* d = dlogits->data<float>();
  ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* dr = d + i * lv;
      if (tp[i] < 0) {
        std::fill_n(dr, lv, 0.0f);
        continue;
      }
      const float* row = lp + i * lv;
      const float inv = coef / se[i], m = mx[i];
      for (int64_t j = 0; j < lv; ++j) dr[j] = kernels::vec::Exp(row[j] - m) * inv;
      const int64_t local = static_cast<int64_t>(tp[i]) - start;
      if (local >= 0 && local < lv) dr[local] -= coef;
    }
  });
  return r;
}

CrossEntropyResult VocabParallelLoss(comm::Communicator& group, const Tensor& logits,
                                     const Tensor& targets, int64_t vocab_size, Tensor* dlogits,
                                     float scale, int threads, CommStats* stats) {
  if (group.size() > 1) {
    return VocabParallelCrossEntropy(group, logits, targets, vocab_size, dlogits, scale, threads,
                                     stats);
  }
  ExpectShape("cross-entropy logits", logits, {kAnySize, vocab_size});
  return SoftmaxCrossEntropy(logits, targets, dlogits, scale, threads);  // one rank: every column
}

}  // namespace switchyard::train
