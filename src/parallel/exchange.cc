#include "parallel/exchange.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "parallel/collectives.h"
#include "parallel/trace_context.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"

namespace switchyard::parallel::internal {
namespace {

int64_t Extent(const moe::DispatchPlan& plan, int64_t e) {
  return plan.offsets[static_cast<size_t>(e) + 1] - plan.offsets[static_cast<size_t>(e)];
}

// Kept rows of expert e within rows [lo, hi) of its extent.
int64_t KeptIn(const moe::DispatchPlan& plan, int64_t e, int64_t lo, int64_t hi) {
  return std::max<int64_t>(0, std::min(hi, plan.counts[static_cast<size_t>(e)]) - lo);
}

void CopyRows(const float* src, float* dst, int64_t rows, int64_t cols) {
  if (rows > 0) std::memcpy(dst, src, static_cast<size_t>(rows * cols) * sizeof(float));
}

void AddRows(const float* src, float* dst, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows * cols; ++i) dst[i] += src[i];
}

}  // namespace

struct TokenExchange::Phase {
  struct Copy {
    int64_t row;       // source buffer row (source side) or phase row (expert side)
    int64_t wire_row;  // row in the packed-by-peer wire buffer
    int64_t rows;
  };
  bool local_only = false;  // only traffic to itself: no collective
  bool uniform = false;     // fixed blocks to every peer: one all-to-all
  // All-to-all-v options: a smart step's few peers all at once (kLinear: a pair's two directions
  // travel together; pairwise steps would put them in different steps), else the default.
  comm::AllToAllOptions v_options;
  std::vector<int64_t> send_wire, recv_wire;  // [P] wire rows per peer (source -> experts)
  int64_t send_total = 0, recv_total = 0;
  std::vector<Copy> out;  // source buffer -> send wire
  std::vector<Copy> in;   // receive wire -> phase rows
  moe::ExpertGroups groups;
};

struct TokenExchange::Flight {
  int k = 0;
  Tensor send, recv;
  comm::Work work;
  double issued = 0;
  double bytes = 0;
};

TokenExchange::TokenExchange(comm::Communicator& group, const ExchangeSpec& spec,
                             const moe::DispatchPlan& plan, CommStats* stats)
    : group_(group), spec_(spec), num_rows_(plan.num_rows) {
  const int p_num = group.size(), n = spec.shards, r = spec.r, me = group.rank();
  const int64_t el = spec.local_experts;
  const int d_num = spec.overlap_degree;
  SY_CHECK(r >= 1 && n % r == 0 && p_num % n == 0);
  SY_CHECK(d_num >= 1);
  SY_CHECK(static_cast<int64_t>(p_num / n) * el == plan.num_experts, "{} positions x {} experts",
           p_num / n, el);
  SY_CHECK(spec.skip.empty() || static_cast<int64_t>(spec.skip.size()) == plan.num_experts);
  const int g = n / r;
  const int64_t slices = static_cast<int64_t>(spec.tp_shares) * g;
  if (spec.fixed) {
    const int64_t extent = plan.num_experts > 0 ? Extent(plan, 0) : 0;
    for (int64_t e = 0; e < plan.num_experts; ++e) {
      SY_CHECK(Extent(plan, e) == extent, "fixed-capacity buffer with uneven extents");
    }
    SY_CHECK(extent % (slices * d_num) == 0, "capacity {} not a multiple of {} slices x {} chunks",
             extent, slices, d_num);
    block_ = extent / slices;
  }
  auto skipped = [&](int64_t e) { return !spec.skip.empty() && spec.skip[static_cast<size_t>(e)]; };
  send_.resize(static_cast<size_t>(p_num * el));
  std::vector<int64_t> send_counts(send_.size());
  for (int p = 0; p < p_num; ++p) {
    const int q = p / n, i = p % n, sigma = i % g;
    const int64_t s = static_cast<int64_t>(spec.tp_share) * g + sigma;
    for (int64_t le = 0; le < el; ++le) {
      const int64_t e = q * el + le, extent = Extent(plan, e);
      const int64_t lo = SliceBegin(s, slices, extent), hi = SliceBegin(s + 1, slices, extent);
      Piece& piece = send_[static_cast<size_t>(p * el + le)];
      piece.begin = plan.offsets[static_cast<size_t>(e)] + lo;
      piece.rows = skipped(e) ? 0 : KeptIn(plan, e, lo, hi);
      send_counts[static_cast<size_t>(p * el + le)] = piece.rows;
    }
  }
  recv_counts_ = AllToAll(group, send_counts, Traffic::kRouting, stats, spec.options);

  // The phases.
  const int gs = spec.smart_group > 0 ? spec.smart_group : p_num;
  SY_CHECK(p_num % gs == 0, "smart schedule group {} does not divide {} ranks", gs, p_num);
  const int steps = p_num / gs, mine = me / gs;
  const int64_t cb = block_ / d_num;  // fixed: block rows per chunk
  // Rows [lo, lo + count) of a piece with `rows` kept rows in chunk c: an even split of the kept
  // rows (fixed capacity: at most ceil(rows / D) <= B / D of them, in a block of B / D rows).
  auto chunk = [&](int64_t rows, int c, int64_t* count) {
    const int64_t lo = c * rows / d_num;
    *count = (c + 1) * rows / d_num - lo;
    SY_CHECK(!spec.fixed || *count <= cb);
    return lo;
  };
  const int my_position = me / n;
  int64_t my_kept_experts = 0;
  for (int64_t le = 0; le < el; ++le) my_kept_experts += skipped(my_position * el + le) ? 0 : 1;
  bool any_skip = false;
  for (int64_t e = 0; e < plan.num_experts; ++e) any_skip |= skipped(e);
  phases_.resize(static_cast<size_t>(steps * d_num));
  for (int k = 0; k < steps * d_num; ++k) {
    const int step = k / d_num, c = k % d_num;
    Phase& ph = phases_[static_cast<size_t>(k)];
    ph.local_only = p_num == 1 || (spec.smart_group == 1 && step == 0);
    ph.uniform = spec.fixed && steps == 1 && !any_skip && !ph.local_only;
    if (steps > 1) ph.v_options.algorithm = comm::Algorithm::kLinear;
    ph.send_wire.assign(static_cast<size_t>(p_num), 0);
    ph.recv_wire.assign(static_cast<size_t>(p_num), 0);
    const int to_group = (mine + step) % steps, from_group = (mine - step + steps) % steps;
    int64_t wire = 0;
    for (int p = 0; p < p_num; ++p) {
      if (p / gs != to_group) continue;
      const int q = p / n;
      const int64_t begin = wire;
      for (int64_t le = 0; le < el; ++le) {
        if (skipped(q * el + le)) continue;
        const Piece& piece = send_[static_cast<size_t>(p * el + le)];
        int64_t count = 0;
        const int64_t lo = chunk(piece.rows, c, &count);
        if (count > 0) ph.out.push_back({piece.begin + lo, wire, count});
        wire += spec.fixed ? cb : count;
      }
      ph.send_wire[static_cast<size_t>(p)] = wire - begin;
    }
    ph.send_total = wire;
    // Expert side: wire packed by source (then local expert); phase rows by local expert, then
    // source.
    std::vector<int64_t> wire_at(static_cast<size_t>(p_num * el), -1), count_at(wire_at.size(), 0);
    wire = 0;
    for (int d = 0; d < p_num; ++d) {
      if (d / gs != from_group) continue;
      const int64_t begin = wire;
      for (int64_t le = 0; le < el; ++le) {
        if (skipped(my_position * el + le)) continue;
        int64_t count = 0;
        chunk(recv_counts_[static_cast<size_t>(d * el + le)], c, &count);
        wire_at[static_cast<size_t>(d * el + le)] = wire;
        count_at[static_cast<size_t>(d * el + le)] = count;
        wire += spec.fixed ? cb : count;
      }
      ph.recv_wire[static_cast<size_t>(d)] = wire - begin;
    }
    SY_CHECK(!spec.fixed || wire == static_cast<int64_t>(gs) * my_kept_experts * cb);
    ph.recv_total = wire;
    ph.groups.begin.assign(static_cast<size_t>(el), 0);
    ph.groups.rows.assign(static_cast<size_t>(el), 0);
    int64_t row = 0;
    for (int64_t le = 0; le < el; ++le) {
      ph.groups.begin[static_cast<size_t>(le)] = row;
      for (int d = 0; d < p_num; ++d) {
        const size_t b = static_cast<size_t>(d * el + le);
        if (wire_at[b] < 0 || count_at[b] == 0) continue;
        ph.in.push_back({row, wire_at[b], count_at[b]});
        row += count_at[b];
      }
      ph.groups.rows[static_cast<size_t>(le)] = row - ph.groups.begin[static_cast<size_t>(le)];
    }
  }
}

TokenExchange::~TokenExchange() = default;

int TokenExchange::phases() const { return static_cast<int>(phases_.size()); }

const moe::ExpertGroups& TokenExchange::phase_groups(int k) const {
  return phases_[static_cast<size_t>(k)].groups;
}

namespace {

// Bytes this rank puts on the wire for a packed-by-peer transfer of `rows` per peer.
double WireBytes(const std::vector<int64_t>& rows, int self, int64_t row_bytes) {
  int64_t sent = 0;
  for (size_t p = 0; p < rows.size(); ++p) {
    if (static_cast<int>(p) != self) sent += rows[p];
  }
  return static_cast<double>(sent * row_bytes);
}

}  // namespace

TokenExchange::Flight TokenExchange::Send(int k, const Tensor& buffer) const {
  const Phase& ph = phases_[static_cast<size_t>(k)];
  const int64_t m = buffer.size(1);
  SY_CHECK(buffer.size(0) == num_rows_);
  Flight f;
  f.k = k;
  f.issued = NowSeconds();
  f.send = spec_.fixed ? Tensor::Zeros({ph.send_total, m}) : Tensor::Empty({ph.send_total, m});
  const float* src = buffer.data<float>();
  float* wire = f.send.data<float>();
  for (const Phase::Copy& cp : ph.out)
    CopyRows(src + cp.row * m, wire + cp.wire_row * m, cp.rows, m);
  if (ph.local_only) {
    f.recv = f.send;
    return f;
  }
  f.recv = Tensor::Empty({ph.recv_total, m});
  const int64_t row_bytes = m * static_cast<int64_t>(sizeof(float));
  f.bytes = WireBytes(ph.send_wire, group_.rank(), row_bytes);
  if (ph.uniform) {
    f.work = group_.AllToAll(f.send, f.recv, spec_.options);
  } else {
    f.work = group_.AllToAllV(f.send, ph.send_wire, f.recv, ph.recv_wire, ph.v_options);
  }
  return f;
}

void TokenExchange::WaitFor(const Flight& f, bool on_progress_thread) const {
  if (!on_progress_thread) return f.work.Wait();
  // Never run it on this thread: the progress thread runs the pipeline's transfers back to back
  // (a transfer run here would leave the next one waiting for the progress thread to be
  // scheduled). The collective's own deadline ends it first; this bound is a backstop.
  f.work.Wait(group_.default_timeout() * 2 + comm::Milliseconds(10000));
}

Tensor TokenExchange::ReceiveAtExperts(Flight& f, bool on_progress_thread, CommStats* stats) const {
  const Phase& ph = phases_[static_cast<size_t>(f.k)];
  const int64_t m = f.recv.size(1);
  const double t0 = NowSeconds();
  WaitFor(f, on_progress_thread);
  if (!ph.local_only) {
    AccountWork(fmt::format("send c{}", f.k), f.work, stats, Traffic::kTokens, f.bytes, f.issued,
                t0, NowSeconds());
  }
  Tensor rows = Tensor::Empty({ph.groups.total_rows(), m});
  const float* wire = f.recv.data<float>();
  float* dst = rows.data<float>();
  for (const Phase::Copy& cp : ph.in)
    CopyRows(wire + cp.wire_row * m, dst + cp.row * m, cp.rows, m);
  f.send = Tensor();
  f.recv = Tensor();
  return rows;
}

TokenExchange::Flight TokenExchange::Return(int k, const Tensor& rows) const {
  const Phase& ph = phases_[static_cast<size_t>(k)];
  const int64_t m = rows.size(1);
  SY_CHECK(rows.size(0) == ph.groups.total_rows());
  Flight f;
  f.k = k;
  f.issued = NowSeconds();
  f.send = spec_.fixed ? Tensor::Zeros({ph.recv_total, m}) : Tensor::Empty({ph.recv_total, m});
  const float* src = rows.data<float>();
  float* wire = f.send.data<float>();
  for (const Phase::Copy& cp : ph.in)
    CopyRows(src + cp.row * m, wire + cp.wire_row * m, cp.rows, m);
  if (ph.local_only) {
    f.recv = f.send;
    return f;
  }
  f.recv = Tensor::Empty({ph.send_total, m});
  const int64_t row_bytes = m * static_cast<int64_t>(sizeof(float));
  f.bytes = WireBytes(ph.recv_wire, group_.rank(), row_bytes);
  if (ph.uniform) {
    f.work = group_.AllToAll(f.send, f.recv, spec_.options);
  } else {
    f.work = group_.AllToAllV(f.send, ph.recv_wire, f.recv, ph.send_wire, ph.v_options);
  }
  return f;
}

void TokenExchange::ReceiveAtSource(Flight& f, const Tensor& out, bool on_progress_thread,
                                    CommStats* stats) const {
  const Phase& ph = phases_[static_cast<size_t>(f.k)];
  const int64_t m = out.size(1);
  const double t0 = NowSeconds();
  WaitFor(f, on_progress_thread);
  if (!ph.local_only) {
    AccountWork(fmt::format("return c{}", f.k), f.work, stats, Traffic::kTokens, f.bytes, f.issued,
                t0, NowSeconds());
  }
  const float* wire = f.recv.data<float>();
  float* dst = out.data<float>();
  for (const Phase::Copy& cp : ph.out)
    AddRows(wire + cp.wire_row * m, dst + cp.row * m, cp.rows, m);
  f.send = Tensor();
  f.recv = Tensor();
}

Tensor TokenExchange::Pipeline(const Tensor& buffer, const PhaseFn& compute,
                               const std::function<void()>& local_work, CommStats* stats) const {
  const int k_num = phases();
  const int64_t m = buffer.size(1);
  Tensor out = Tensor::Zeros({num_rows_, m});
  std::vector<Flight> to(static_cast<size_t>(k_num)), back(static_cast<size_t>(k_num));
  // On an error, transfers still queued or running must be over before their buffers go.
  struct Drain {
    std::vector<Flight>* lists[2];
    bool armed = true;
    ~Drain() {
      if (!armed) return;
      for (std::vector<Flight>* list : lists) {
        for (Flight& f : *list) {
          try {
            f.work.Wait();
          } catch (...) {  // the error that unwinds us is the one to report
          }
        }
      }
    }
  } drain{{&to, &back}};
  to[0] = Send(0, buffer);
  if (k_num > 1) to[1] = Send(1, buffer);
  if (local_work) local_work();
  for (int k = 0; k < k_num; ++k) {
    Tensor rows = ReceiveAtExperts(to[static_cast<size_t>(k)], k_num > 1, stats);
    Tensor result;
    {
      TraceSpan span(Tracing() ? fmt::format("experts c{}", k) : std::string());
      span.Arg("chunk", k);
      span.Arg("rows", static_cast<double>(rows.size(0)));
      result = compute(k, rows);
    }
    // The transfer two phases ahead goes first: the next compute waits for the one in flight,
    // the one after for this; the returns are only needed at the end.
    if (k + 2 < k_num) to[static_cast<size_t>(k) + 2] = Send(k + 2, buffer);
    back[static_cast<size_t>(k)] = Return(k, result);
  }
  for (int k = 0; k < k_num; ++k) {
    ReceiveAtSource(back[static_cast<size_t>(k)], out, k_num > 1, stats);
  }
  drain.armed = false;
  return out;
}

moe::ExpertGroups ShareGroups(const moe::DispatchPlan& plan, int shares, int share) {
  moe::ExpertGroups g;
  for (int64_t e = 0; e < plan.num_experts; ++e) {
    const int64_t extent = Extent(plan, e);
    const int64_t lo = SliceBegin(share, shares, extent),
                  hi = SliceBegin(share + 1, shares, extent);
    g.begin.push_back(plan.offsets[static_cast<size_t>(e)] + lo);
    g.rows.push_back(KeptIn(plan, e, lo, hi));
  }
  return g;
}

void GatherTpShares(comm::Communicator& tp, const moe::DispatchPlan& plan, const Tensor& buffer,
                    CommStats* stats) {
  const int t = tp.size(), u = tp.rank();
  if (t == 1) return;
  const int64_t m = buffer.size(1), e_num = plan.num_experts;
  std::vector<int64_t> block(static_cast<size_t>(e_num)), at(static_cast<size_t>(e_num));
  int64_t total = 0;
  for (int64_t e = 0; e < e_num; ++e) {
    block[static_cast<size_t>(e)] = (Extent(plan, e) + t - 1) / t;
    at[static_cast<size_t>(e)] = total;
    total += block[static_cast<size_t>(e)];
  }
  float* buf = buffer.data<float>();
  auto each_share = [&](int share, auto&& fn) {
    moe::ExpertGroups g = ShareGroups(plan, t, share);
    for (int64_t e = 0; e < e_num; ++e) {
      fn(e, g.begin[static_cast<size_t>(e)], g.rows[static_cast<size_t>(e)]);
    }
  };
  Tensor own = Tensor::Zeros({total, m});
  each_share(u, [&](int64_t e, int64_t begin, int64_t rows) {
    CopyRows(buf + begin * m, own.data<float>() + at[static_cast<size_t>(e)] * m, rows, m);
  });
  Tensor all = AllGather(tp, own, Traffic::kTensor, stats);
  for (int share = 0; share < t; ++share) {
    if (share == u) continue;
    const float* part = all.data<float>() + share * total * m;
    each_share(share, [&](int64_t e, int64_t begin, int64_t rows) {
      CopyRows(part + at[static_cast<size_t>(e)] * m, buf + begin * m, rows, m);
    });
  }
}

}  // namespace switchyard::parallel::internal
