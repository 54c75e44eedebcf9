#include "parallel/exchange.h"

#include <algorithm>
#include <cstring>

#include "parallel/collectives.h"
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

TokenExchange::TokenExchange(comm::Communicator& group, const ExchangeSpec& spec,
                             const moe::DispatchPlan& plan, CommStats* stats)
    : group_(group), spec_(spec), num_rows_(plan.num_rows) {
  const int p_num = group.size(), n = spec.shards, r = spec.r;
  const int64_t el = spec.local_experts;
  SY_CHECK(r >= 1 && n % r == 0 && p_num % n == 0);
  SY_CHECK(static_cast<int64_t>(p_num / n) * el == plan.num_experts, "{} positions x {} experts",
           p_num / n, el);
  const int g = n / r;
  const int64_t slices = static_cast<int64_t>(spec.tp_shares) * g;
  if (spec.fixed) {
    const int64_t extent = plan.num_experts > 0 ? Extent(plan, 0) : 0;
    for (int64_t e = 0; e < plan.num_experts; ++e) {
      SY_CHECK(Extent(plan, e) == extent, "fixed-capacity buffer with uneven extents");
    }
    SY_CHECK(extent % slices == 0, "capacity {} not a multiple of {} slices", extent, slices);
    block_ = extent / slices;
  }
  send_.resize(static_cast<size_t>(p_num * el));
  std::vector<int64_t> send_counts(send_.size());
  send_rows_.assign(static_cast<size_t>(p_num), 0);
  for (int p = 0; p < p_num; ++p) {
    const int q = p / n, i = p % n, sigma = i % g;
    const int64_t s = static_cast<int64_t>(spec.tp_share) * g + sigma;
    for (int64_t le = 0; le < el; ++le) {
      const int64_t e = q * el + le, extent = Extent(plan, e);
      const int64_t lo = SliceBegin(s, slices, extent), hi = SliceBegin(s + 1, slices, extent);
      Piece& piece = send_[static_cast<size_t>(p * el + le)];
      piece.begin = plan.offsets[static_cast<size_t>(e)] + lo;
      piece.rows = KeptIn(plan, e, lo, hi);
      send_counts[static_cast<size_t>(p * el + le)] = piece.rows;
      send_rows_[static_cast<size_t>(p)] += piece.rows;
    }
  }
  recv_counts_ = AllToAll(group, send_counts, Traffic::kRouting, stats, spec.options);
  recv_rows_.assign(static_cast<size_t>(p_num), 0);
  groups_.begin.assign(static_cast<size_t>(el), 0);
  groups_.rows.assign(static_cast<size_t>(el), 0);
  for (int d = 0; d < p_num; ++d) {
    for (int64_t le = 0; le < el; ++le) {
      const int64_t c = recv_counts_[static_cast<size_t>(d * el + le)];
      recv_rows_[static_cast<size_t>(d)] += c;
      groups_.rows[static_cast<size_t>(le)] += c;
    }
  }
  for (int64_t le = 1; le < el; ++le) {
    groups_.begin[static_cast<size_t>(le)] =
        groups_.begin[static_cast<size_t>(le) - 1] + groups_.rows[static_cast<size_t>(le) - 1];
  }
  recv_total_ = groups_.total_rows();
}

Tensor TokenExchange::ToExperts(const Tensor& buffer, CommStats* stats) const {
  const int p_num = group_.size();
  const int64_t el = spec_.local_experts, m = buffer.size(1);
  SY_CHECK(buffer.size(0) == num_rows_);
  const float* src = buffer.data<float>();
  Tensor out = Tensor::Empty({recv_total_, m});
  float* dst = out.data<float>();
  // Where (source d, local expert le) lands in `out`: [le][d] order.
  std::vector<int64_t> at(static_cast<size_t>(p_num * el));
  for (int64_t le = 0, row = 0; le < el; ++le) {
    for (int d = 0; d < p_num; ++d) {
      at[static_cast<size_t>(d * el + le)] = row;
      row += recv_counts_[static_cast<size_t>(d * el + le)];
    }
  }
  if (spec_.fixed) {
    Tensor send = Tensor::Zeros({p_num * el * block_, m});
    for (size_t b = 0; b < send_.size(); ++b) {
      CopyRows(src + send_[b].begin * m, send.data<float>() + static_cast<int64_t>(b) * block_ * m,
               send_[b].rows, m);
    }
    Tensor recv = Tensor::Empty({p_num * el * block_, m});
    AllToAll(group_, send, recv, spec_.options, Traffic::kTokens, stats);
    for (size_t b = 0; b < at.size(); ++b) {
      CopyRows(recv.data<float>() + static_cast<int64_t>(b) * block_ * m, dst + at[b] * m,
               recv_counts_[b], m);
    }
    return out;
  }
  int64_t total = 0;
  for (int64_t v : send_rows_) total += v;
  Tensor send = Tensor::Empty({total, m});
  for (size_t b = 0, row = 0; b < send_.size(); ++b) {
    CopyRows(src + send_[b].begin * m, send.data<float>() + static_cast<int64_t>(row) * m,
             send_[b].rows, m);
    row += static_cast<size_t>(send_[b].rows);
  }
  Tensor recv = Tensor::Empty({recv_total_, m});
  AllToAllV(group_, send, send_rows_, recv, recv_rows_, Traffic::kTokens, stats);
  for (size_t b = 0, row = 0; b < at.size(); ++b) {
    CopyRows(recv.data<float>() + static_cast<int64_t>(row) * m, dst + at[b] * m, recv_counts_[b],
             m);
    row += static_cast<size_t>(recv_counts_[b]);
  }
  return out;
}

Tensor TokenExchange::FromExperts(const Tensor& rows, CommStats* stats) const {
  const int p_num = group_.size();
  const int64_t el = spec_.local_experts, m = rows.size(1);
  SY_CHECK(rows.size(0) == recv_total_);
  std::vector<int64_t> at(static_cast<size_t>(p_num * el));
  for (int64_t le = 0, row = 0; le < el; ++le) {
    for (int d = 0; d < p_num; ++d) {
      at[static_cast<size_t>(d * el + le)] = row;
      row += recv_counts_[static_cast<size_t>(d * el + le)];
    }
  }
  const float* src = rows.data<float>();
  Tensor back;  // what came back, in the layout of what was sent
  if (spec_.fixed) {
    Tensor send = Tensor::Zeros({p_num * el * block_, m});
    for (size_t b = 0; b < at.size(); ++b) {
      CopyRows(src + at[b] * m, send.data<float>() + static_cast<int64_t>(b) * block_ * m,
               recv_counts_[b], m);
    }
    back = Tensor::Empty({p_num * el * block_, m});
    AllToAll(group_, send, back, spec_.options, Traffic::kTokens, stats);
  } else {
    Tensor send = Tensor::Empty({recv_total_, m});
    for (size_t b = 0, row = 0; b < at.size(); ++b) {
      CopyRows(src + at[b] * m, send.data<float>() + static_cast<int64_t>(row) * m, recv_counts_[b],
               m);
      row += static_cast<size_t>(recv_counts_[b]);
    }
    int64_t total = 0;
    for (int64_t v : send_rows_) total += v;
    back = Tensor::Empty({total, m});
    AllToAllV(group_, send, recv_rows_, back, send_rows_, Traffic::kTokens, stats);
  }
  Tensor out = Tensor::Zeros({num_rows_, m});
  float* dst = out.data<float>();
  const float* bp = back.data<float>();
  for (size_t b = 0, row = 0; b < send_.size(); ++b) {
    const int64_t from = spec_.fixed ? static_cast<int64_t>(b) * block_ : static_cast<int64_t>(row);
    AddRows(bp + from * m, dst + send_[b].begin * m, send_[b].rows, m);
    row += static_cast<size_t>(send_[b].rows);
  }
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
