// Context parallelism: the sequence splits and the attention core across the cp group by Ulysses
// and by ring attention (docs/context_parallel.md).
#include "switchyard/train/context_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "parallel/collectives.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"
#include "train/attention_flash.h"
#include "train/parallel_for.h"

namespace switchyard::train {

using parallel::CommStats;
using parallel::Traffic;
using parallel::internal::AccountWork;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using internal::ConstMat;
using internal::Mat;

const char* SplitName(SequenceSplitKind kind) {
  return kind == SequenceSplitKind::kPlain ? "plain" : "zigzag";
}

// Column `col` of t [batch * seq_rows, cols] as the start of a matrix.
Mat At(const Tensor& t, int64_t col, int64_t seq_rows) {
  return {t.data<float>() + col, t.size(1), seq_rows};
}

// One attention problem between the query rows `q_chunks` and the key rows `k_chunks`, computed
// by the flash core (train/attention_flash.h).
struct Attend : internal::FlashProblem {
  // Score elements computed: every key tile not skipped counts whole against its query tile
  // (per sequence and head).
  int64_t ScoreElements() const {
    int64_t n = 0;
    for (const auto& qc : q_chunks)
      for (int64_t i0 = 0; i0 < qc.length; i0 += internal::kFlashQueryTile)
        for (const auto& kc : k_chunks)
          for (int64_t j0 = 0; j0 < kc.length; j0 += internal::kFlashKeyTile) {
            const int64_t tq = std::min(internal::kFlashQueryTile, qc.length - i0);
            if (!Skipped(qc, i0, tq, kc, j0))
              n += tq * std::min(internal::kFlashKeyTile, kc.length - j0);
          }
    return n * batch * heads;
  }
  void Forward(const Mat& out, float* lse, int threads) const {
    internal::FlashForward(*this, out, lse, threads);
  }
  void Backward(const float* lse, const ConstMat& dout, const float* delta, const Mat& dq,
                const Mat& dk, const Mat& dv, int threads) const {
    internal::FlashBackward(*this, lse, dout, delta, dq, dk, dv, threads);
  }
};

// delta [batch, heads, rows] = rowsum(dout * out) per head.
Tensor RowDots(const ConstMat& dout, const ConstMat& out, int64_t batch, int64_t heads,
               int64_t head_dim) {
  const int64_t rows = out.seq_rows;
  Tensor delta = Tensor::Empty({batch, heads, rows});
  float* d = delta.data<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < rows; ++i) {
        const float* x = dout.Row(b, i) + h * head_dim;
        const float* y = out.Row(b, i) + h * head_dim;
        float s = 0;
        for (int64_t c = 0; c < head_dim; ++c) s += x[c] * y[c];
        d[(b * heads + h) * rows + i] = s;
      }
  return delta;
}

// Starts one ring hop: `count` floats from `send` to rank r + 1, received from rank r - 1 into
// `recv`, as an all-to-all-v in which every rank sends to its successor only (ordered with the
// group's other collectives).
comm::Work StartHop(comm::Communicator& g, const float* send, float* recv, int64_t count) {
  const int p = g.size(), r = g.rank();
  std::vector<int64_t> send_counts(static_cast<size_t>(p), 0), recv_counts(send_counts);
  send_counts[static_cast<size_t>((r + 1) % p)] = count;
  recv_counts[static_cast<size_t>((r - 1 + p) % p)] = count;
  return g.AllToAllV(send, send_counts, {}, recv, recv_counts, {}, DType::kFloat32);
}

// A ring hop in flight: waited (and counted) by Finish, or at scope exit when the ring is left by
// an exception, so that the transport never writes into buffers that unwinding frees.
class Hop {
 public:
  Hop() = default;
  Hop(const Hop&) = delete;
  Hop& operator=(const Hop&) = delete;
  ~Hop() {
    if (work_.IsCompleted()) return;
    try {
      work_.Wait();
    } catch (...) {  // the error that unwinds us is the one to report
    }
  }
  void Start(comm::Communicator& g, const Tensor& send, const Tensor& recv) {
    issued_ = NowSeconds();
    bytes_ = static_cast<double>(send.nbytes());
    work_ = StartHop(g, send.data<float>(), recv.data<float>(), send.numel());
  }
  void Finish(CommStats* stats) {
    const double t0 = NowSeconds();
    work_.Wait();
    AccountWork("cp ring hop", work_, stats, Traffic::kContext, bytes_, issued_, t0, NowSeconds());
    work_ = comm::Work();
  }

 private:
  comm::Work work_;
  double issued_ = 0;
  double bytes_ = 0;
};

// The k | v columns of qkv [rows, 3 * D]: [rows, 2 * D] (a copy, the ring's first block).
Tensor KeysValues(const Tensor& qkv) {
  const int64_t rows = qkv.size(0), d = qkv.size(1) / 3;
  Tensor kv = Tensor::Empty({rows, 2 * d});
  for (int64_t i = 0; i < rows; ++i)
    std::copy_n(qkv.data<float>() + i * 3 * d + d, 2 * d, kv.data<float>() + i * 2 * d);
  return kv;
}

int64_t Bytes(std::initializer_list<const Tensor*> tensors) {
  int64_t n = 0;
  for (const Tensor* t : tensors)
    if (t->defined()) n += static_cast<int64_t>(t->nbytes());
  return n;
}

void Note(CpWork* work, int64_t score_elements, int64_t held_bytes) {
  if (work == nullptr) return;
  work->score_elements += score_elements;
  work->peak_bytes = std::max(work->peak_bytes, held_bytes);
}

// The chunks of every rank of the group laid end to end (rank p's rows at p * local_len): the
// full sequence as Ulysses gathers it.
std::vector<SequenceChunk> GatheredChunks(const SequenceSplit& split) {
  std::vector<SequenceChunk> out;
  for (int p = 0; p < split.cp(); ++p) {
    const SequenceSplit sp(split.kind(), split.seq_len(), split.cp(), p);
    for (SequenceChunk c : sp.chunks()) {
      c.row += p * split.local_len();
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

// ---- SequenceSplit ----

int64_t SequenceSplit::Multiple(SequenceSplitKind kind, int cp) {
  return kind == SequenceSplitKind::kPlain ? cp : 2 * static_cast<int64_t>(cp);
}

SequenceSplit::SequenceSplit(SequenceSplitKind kind, int64_t seq_len, int cp, int rank)
    : kind_(kind), seq_len_(seq_len), cp_(cp), rank_(rank) {
  SY_REQUIRE(cp >= 1 && rank >= 0 && rank < cp, InvalidArgument,
             "sequence split: rank {} is not in a context-parallel group of {} ranks", rank, cp);
  const int64_t m = Multiple(kind, cp);
  SY_REQUIRE(seq_len > 0 && seq_len % m == 0, InvalidArgument,
             "sequence split: sequence length {} does not divide into {} equal chunks ({} split "
             "over a context-parallel group of {}; pad the sequences to a multiple of {})",
             seq_len, m, SplitName(kind), cp, m);
  if (kind == SequenceSplitKind::kPlain) {
    chunks_.push_back({0, rank * (seq_len / cp), seq_len / cp});
  } else {
    const int64_t c = seq_len / m;
    chunks_.push_back({0, rank * c, c});
    chunks_.push_back({c, (m - 1 - rank) * c, c});
  }
}

int64_t SequenceSplit::Position(int64_t local_row) const {
  SY_REQUIRE(local_row >= 0 && local_row < local_len(), InvalidArgument,
             "sequence split: local row {} is not in [0, {})", local_row, local_len());
  for (const SequenceChunk& c : chunks_)
    if (local_row < c.row + c.length) return c.position + local_row - c.row;
  return -1;  // unreachable
}

std::vector<int64_t> SequenceSplit::Positions() const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(local_len()));
  for (const SequenceChunk& c : chunks_)
    for (int64_t i = 0; i < c.length; ++i) out.push_back(c.position + i);
  return out;
}

namespace {

// Copies the rows of `chunks` between full [batch * seq_len, ...] and local [batch * local_len,
// ...]; to_local selects the direction.
void CopyChunks(const SequenceSplit& s, const Tensor& full, const Tensor& local, int64_t batch,
                bool to_local) {
  SY_REQUIRE(full.dim() >= 1 && full.size(0) == batch * s.seq_len(), InvalidArgument,
             "sequence split: full tensor has {} rows, expected batch_size x sequence length = "
             "{} x {}",
             full.dim() >= 1 ? full.size(0) : 0, batch, s.seq_len());
  SY_REQUIRE(local.dim() >= 1 && local.size(0) == batch * s.local_len() &&
                 local.numel() / std::max<int64_t>(local.size(0), 1) ==
                     full.numel() / std::max<int64_t>(full.size(0), 1) &&
                 local.dtype() == full.dtype(),
             InvalidArgument,
             "sequence split: local tensor has {} rows, expected batch_size x local length = {} "
             "x {} with the full tensor's row size and dtype",
             local.dim() >= 1 ? local.size(0) : 0, batch, s.local_len());
  const size_t row_bytes =
      full.size(0) == 0 ? 0 : full.nbytes() / static_cast<size_t>(full.size(0));
  auto* f = static_cast<char*>(full.raw());
  auto* l = static_cast<char*>(local.raw());
  for (int64_t b = 0; b < batch; ++b)
    for (const SequenceChunk& c : s.chunks()) {
      char* fp = f + static_cast<size_t>(b * s.seq_len() + c.position) * row_bytes;
      char* lp = l + static_cast<size_t>(b * s.local_len() + c.row) * row_bytes;
      const size_t n = static_cast<size_t>(c.length) * row_bytes;
      if (to_local) {
        std::memcpy(lp, fp, n);
      } else {
        std::memcpy(fp, lp, n);
      }
    }
}

}  // namespace

Tensor SequenceSplit::Shard(const Tensor& full, int64_t batch_size) const {
  SY_REQUIRE(full.dim() >= 1, InvalidArgument, "sequence split: a scalar has no rows to shard");
  Shape shape = full.shape();
  shape[0] = batch_size * local_len();
  Tensor local = Tensor::Empty(shape, full.dtype());
  CopyChunks(*this, full, local, batch_size, /*to_local=*/true);
  return local;
}

void SequenceSplit::Unshard(const Tensor& local, const Tensor& full, int64_t batch_size) const {
  CopyChunks(*this, full, local, batch_size, /*to_local=*/false);
}

// ---- ContextParallelAttention ----

ContextParallelAttention::ContextParallelAttention(comm::Communicator& group, int64_t num_heads,
                                                   int64_t seq_len, ContextParallelOptions options)
    : group_(&group),
      num_heads_(num_heads),
      options_(options),
      split_(options.split, seq_len, group.size(), group.rank()) {
  SY_REQUIRE(num_heads > 0, InvalidArgument,
             "context-parallel attention: num_heads must be positive, got {}", num_heads);
  SY_REQUIRE(options.algorithm != CpAlgorithm::kUlysses || num_heads % group.size() == 0,
             InvalidArgument,
             "Ulysses attention: {} heads do not divide by the context-parallel size {} (group "
             "'{}'); each rank attends over num_heads / cp heads",
             num_heads, group.size(), group.name());
}

ContextParallelAttention::ContextParallelAttention(int64_t num_heads, int64_t seq_len,
                                                   ContextParallelOptions options)
    : group_(nullptr),
      num_heads_(num_heads),
      options_(options),
      split_(options.split, seq_len, 1, 0) {
  SY_REQUIRE(num_heads > 0, InvalidArgument,
             "context-parallel attention: num_heads must be positive, got {}", num_heads);
  options_.algorithm = CpAlgorithm::kRing;  // one rank: nothing travels
}

namespace {

// qkv [rows, 3 * D] or att [rows, D]: D's head_dim; InvalidArgument naming `what` otherwise.
int64_t HeadDim(const char* what, const Tensor& t, int64_t parts, int64_t rows, int64_t heads) {
  ExpectDType(what, t, DType::kFloat32);
  SY_REQUIRE(t.dim() == 2 && t.size(0) == rows && t.size(1) > 0 && t.size(1) % (parts * heads) == 0,
             InvalidArgument,
             "context-parallel attention: {} has shape {}, expected [{}, {} x num_heads ({}) x "
             "head_dim]",
             what, fmt::join(t.shape(), "x"), rows, parts, heads);
  return t.size(1) / (parts * heads);
}

}  // namespace

Tensor ContextParallelAttention::Forward(const Tensor& qkv, int64_t batch_size,
                                         ContextParallelCache* cache, int threads, CommStats* stats,
                                         CpWork* work) const {
  SY_REQUIRE(batch_size > 0 && cache != nullptr, InvalidArgument,
             "context-parallel attention: batch_size must be positive and cache non-null");
  HeadDim("qkv", qkv, 3, batch_size * split_.local_len(), num_heads_);
  parallel::internal::ScopedTotal total(stats);
  return options_.algorithm == CpAlgorithm::kRing
             ? RingForward(qkv, batch_size, cache, threads, stats, work)
             : UlyssesForward(qkv, batch_size, cache, threads, stats, work);
}

Tensor ContextParallelAttention::Backward(const ContextParallelCache& cache, const Tensor& datt,
                                          int threads, CommStats* stats, CpWork* work) const {
  HeadDim("datt", datt, 1, cache.batch_size * split_.local_len(), num_heads_);
  parallel::internal::ScopedTotal total(stats);
  return options_.algorithm == CpAlgorithm::kRing
             ? RingBackward(cache, datt, threads, stats, work)
             : UlyssesBackward(cache, datt, threads, stats, work);
}

// ---- Ring ----
//
// Step s (0 <= s < P) of rank r attends its queries to the K/V block of rank (r - s) mod P; the
// block of step s + 1 travels from the predecessor while step s computes.

Tensor ContextParallelAttention::RingForward(const Tensor& qkv, int64_t batch,
                                             ContextParallelCache* cache, int threads,
                                             CommStats* stats, CpWork* work) const {
  const int p = split_.cp(), r = split_.rank();
  const int64_t n = split_.local_len(), d = qkv.size(1) / 3, hd = d / num_heads_;
  Tensor out = Tensor::Zeros({batch * n, d});
  Tensor lse = Tensor::Full({batch, num_heads_, n}, kNegInf);
  // kv[s % 2] holds the block of step s: [batch * n, 2 * D] = k | v.
  Tensor kv[2] = {KeysValues(qkv), Tensor()};
  if (p > 1) kv[1] = Tensor::Empty({batch * n, 2 * d});
  Attend a;
  a.batch = batch;
  a.heads = num_heads_;
  a.head_dim = hd;
  a.causal = options_.causal;
  a.q = At(qkv, 0, n);
  a.q_chunks = split_.chunks();
  Hop hop;
  for (int s = 0; s < p; ++s) {
    const Tensor& cur = kv[s % 2];
    if (s + 1 < p) hop.Start(*group_, cur, kv[(s + 1) % 2]);
    a.k = At(cur, 0, n);
    a.v = At(cur, d, n);
    a.k_chunks = SequenceSplit(split_.kind(), split_.seq_len(), p, ((r - s) % p + p) % p).chunks();
    a.Forward(At(out, 0, n), lse.data<float>(), threads);
    Note(work, a.ScoreElements(),
         Bytes({&qkv, &out, &lse, &kv[0], &kv[1]}) +
             static_cast<int64_t>(sizeof(float)) * threads * a.ScratchFloats());
    if (s + 1 < p) hop.Finish(stats);
  }
  cache->qkv = qkv;
  cache->out = out;
  cache->lse = lse;
  cache->batch_size = batch;
  return out;
}

Tensor ContextParallelAttention::RingBackward(const ContextParallelCache& cache, const Tensor& datt,
                                              int threads, CommStats* stats, CpWork* work) const {
  const int p = split_.cp(), r = split_.rank();
  const Tensor& qkv = cache.qkv;
  const int64_t batch = cache.batch_size, n = split_.local_len(), d = qkv.size(1) / 3,
                hd = d / num_heads_;
  Tensor delta = RowDots(At(datt, 0, n), At(cache.out, 0, n), batch, num_heads_, hd);
  Tensor dqkv = Tensor::Zeros({batch * n, 3 * d});
  // K/V blocks as in the forward. The gradient of block (r - s)'s k | v accumulates along the
  // ring behind it: dacc[s % 2] is this rank's share plus the predecessors', sent on to the
  // successor; the block's own rank adds its share (step 0) last.
  Tensor kv[2] = {KeysValues(qkv), Tensor()}, dacc[2], drecv;
  if (p > 1) {
    kv[1] = Tensor::Empty({batch * n, 2 * d});
    dacc[0] = Tensor::Empty({batch * n, 2 * d});
    dacc[1] = Tensor::Empty({batch * n, 2 * d});
    drecv = Tensor::Empty({batch * n, 2 * d});
  }
  Attend a;
  a.batch = batch;
  a.heads = num_heads_;
  a.head_dim = hd;
  a.causal = options_.causal;
  a.q = At(qkv, 0, n);
  a.q_chunks = split_.chunks();
  Hop kv_hop, grad_hop;
  for (int s = 0; s < p; ++s) {
    const Tensor& cur = kv[s % 2];
    if (s > 0) kv_hop.Finish(stats);
    if (s + 1 < p) kv_hop.Start(*group_, cur, kv[(s + 1) % 2]);
    a.k = At(cur, 0, n);
    a.v = At(cur, d, n);
    a.k_chunks = SequenceSplit(split_.kind(), split_.seq_len(), p, ((r - s) % p + p) % p).chunks();
    const Mat dq = At(dqkv, 0, n);
    Note(work, a.ScoreElements(),
         Bytes({&qkv, &cache.out, &cache.lse, &datt, &delta, &dqkv, &kv[0], &kv[1], &dacc[0],
                &dacc[1], &drecv}) +
             static_cast<int64_t>(sizeof(float)) * threads * a.ScratchFloats());
    if (s == 0) {
      a.Backward(cache.lse.data<float>(), At(datt, 0, n), delta.data<float>(), dq, At(dqkv, d, n),
                 At(dqkv, 2 * d, n), threads);
      continue;
    }
    const Tensor& acc = dacc[s % 2];
    acc.Fill(0.0f);
    a.Backward(cache.lse.data<float>(), At(datt, 0, n), delta.data<float>(), dq, At(acc, 0, n),
               At(acc, d, n), threads);
    if (s > 1) {
      grad_hop.Finish(stats);
      float* x = acc.data<float>();
      const float* y = drecv.data<float>();
      for (int64_t i = 0; i < acc.numel(); ++i) x[i] += y[i];
    }
    grad_hop.Start(*group_, acc, drecv);
  }
  if (p > 1) {
    grad_hop.Finish(stats);
    const float* y = drecv.data<float>();
    float* x = dqkv.data<float>();
    for (int64_t i = 0; i < batch * n; ++i)
      for (int64_t c = 0; c < 2 * d; ++c) x[i * 3 * d + d + c] += y[i * 2 * d + c];
  }
  return dqkv;
}

// ---- Ulysses ----
//
// Rank r's all-to-all sends block p = its rows of head group p (heads [p * H / P, (p + 1) * H /
// P)) of every part; the received blocks, rank p's rows at p * local_len of each sequence, are
// the full sequence (in the split's row order) for head group r.

namespace {

// local [batch * n, parts * D] (sequence-sharded, all heads) -> [batch * P * n, parts * D / P]
// (this rank's head group, every rank's rows).
Tensor ToHeads(comm::Communicator& g, const Tensor& local, int64_t batch, int64_t parts,
               CommStats* stats) {
  const int64_t p = g.size(), rows = local.size(0), n = rows / batch, w = local.size(1) / parts,
                wl = w / p, cols = parts * wl;
  Tensor send = Tensor::Empty({p * rows, cols}), recv = Tensor::Empty({p * rows, cols});
  const float* x = local.data<float>();
  float* sp = send.data<float>();
  for (int64_t q = 0; q < p; ++q)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t f = 0; f < parts; ++f)
        std::copy_n(x + i * parts * w + f * w + q * wl, wl, sp + (q * rows + i) * cols + f * wl);
  parallel::internal::AllToAll(g, send, recv, {}, Traffic::kContext, stats);
  Tensor out = Tensor::Empty({batch * p * n, cols});
  const float* rp = recv.data<float>();
  float* o = out.data<float>();
  for (int64_t q = 0; q < p; ++q)
    for (int64_t b = 0; b < batch; ++b)
      std::copy_n(rp + (q * rows + b * n) * cols, n * cols, o + (b * p * n + q * n) * cols);
  return out;
}

// Inverse of ToHeads: gathered [batch * P * n, parts * Dl] -> [batch * n, parts * P * Dl].
Tensor ToSequence(comm::Communicator& g, const Tensor& gathered, int64_t batch, int64_t parts,
                  CommStats* stats) {
  const int64_t p = g.size(), n = gathered.size(0) / (batch * p), rows = batch * n,
                cols = gathered.size(1), wl = cols / parts, w = wl * p;
  Tensor send = Tensor::Empty({p * rows, cols}), recv = Tensor::Empty({p * rows, cols});
  const float* x = gathered.data<float>();
  float* sp = send.data<float>();
  for (int64_t q = 0; q < p; ++q)
    for (int64_t b = 0; b < batch; ++b)
      std::copy_n(x + (b * p * n + q * n) * cols, n * cols, sp + (q * rows + b * n) * cols);
  parallel::internal::AllToAll(g, send, recv, {}, Traffic::kContext, stats);
  Tensor out = Tensor::Empty({rows, parts * w});
  const float* rp = recv.data<float>();
  float* o = out.data<float>();
  for (int64_t q = 0; q < p; ++q)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t f = 0; f < parts; ++f)
        std::copy_n(rp + (q * rows + i) * cols + f * wl, wl, o + i * parts * w + f * w + q * wl);
  return out;
}

}  // namespace

Tensor ContextParallelAttention::UlyssesForward(const Tensor& qkv, int64_t batch,
                                                ContextParallelCache* cache, int threads,
                                                CommStats* stats, CpWork* work) const {
  const int64_t p = group_->size(), s = split_.seq_len(), d = qkv.size(1) / 3,
                heads = num_heads_ / p, hd = d / num_heads_, dl = d / p;
  Tensor g = ToHeads(*group_, qkv, batch, 3, stats);
  Tensor out = Tensor::Zeros({batch * s, dl});
  Tensor lse = Tensor::Full({batch, heads, s}, kNegInf);
  Attend a;
  a.batch = batch;
  a.heads = heads;
  a.head_dim = hd;
  a.causal = options_.causal;
  a.q = At(g, 0, s);
  a.k = At(g, dl, s);
  a.v = At(g, 2 * dl, s);
  a.q_chunks = GatheredChunks(split_);
  a.k_chunks = a.q_chunks;
  a.Forward(At(out, 0, s), lse.data<float>(), threads);
  Tensor att = ToSequence(*group_, out, batch, 1, stats);
  Note(work, a.ScoreElements(),
       Bytes({&qkv, &g, &out, &lse, &att}) +
           static_cast<int64_t>(sizeof(float)) * threads * a.ScratchFloats());
  cache->qkv = g;
  cache->out = out;
  cache->lse = lse;
  cache->batch_size = batch;
  return att;
}

Tensor ContextParallelAttention::UlyssesBackward(const ContextParallelCache& cache,
                                                 const Tensor& datt, int threads, CommStats* stats,
                                                 CpWork* work) const {
  const int64_t p = group_->size(), s = split_.seq_len(), batch = cache.batch_size,
                dl = cache.qkv.size(1) / 3, heads = num_heads_ / p, hd = dl / heads;
  Tensor dout = ToHeads(*group_, datt, batch, 1, stats);
  Tensor delta = RowDots(At(dout, 0, s), At(cache.out, 0, s), batch, heads, hd);
  Tensor dg = Tensor::Zeros({batch * s, 3 * dl});
  Attend a;
  a.batch = batch;
  a.heads = heads;
  a.head_dim = hd;
  a.causal = options_.causal;
  a.q = At(cache.qkv, 0, s);
  a.k = At(cache.qkv, dl, s);
  a.v = At(cache.qkv, 2 * dl, s);
  a.q_chunks = GatheredChunks(split_);
  a.k_chunks = a.q_chunks;
  a.Backward(cache.lse.data<float>(), At(dout, 0, s), delta.data<float>(), At(dg, 0, s),
             At(dg, dl, s), At(dg, 2 * dl, s), threads);
  Tensor dqkv = ToSequence(*group_, dg, batch, 3, stats);
  Note(work, a.ScoreElements(),
       Bytes({&cache.qkv, &cache.out, &cache.lse, &datt, &dout, &delta, &dg, &dqkv}) +
           static_cast<int64_t>(sizeof(float)) * threads * a.ScratchFloats());
  return dqkv;
}

}  // namespace switchyard::train
