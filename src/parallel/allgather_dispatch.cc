#include "parallel/allgather_dispatch.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "parallel/collectives.h"
#include "parallel/exchange.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/reduce.h"

namespace switchyard::parallel::internal {
namespace {

// [rows, M] padded with zero rows to [padded_rows, M].
Tensor PadRows(const Tensor& t, int64_t padded_rows) {
  Tensor out = Tensor::Zeros({padded_rows, t.size(1)});
  if (t.numel() > 0) std::memcpy(out.raw(), t.raw(), t.nbytes());
  return out;
}

}  // namespace

AllGatherDispatch::AllGatherDispatch(comm::Communicator& group, const AllGatherSpec& spec,
                                     const moe::DispatchPlan& plan, const Tensor& x,
                                     CommStats* stats)
    : group_(group), spec_(spec) {
  const int p_num = group.size(), n = spec.shards, g = n / spec.r;
  const int q = group.rank() / n, sigma = (group.rank() % n) % g;
  const int64_t el = spec.local_experts, k = plan.top_k;
  num_tokens_ = plan.num_tokens;
  top_k_ = k;
  model_dim_ = x.size(1);
  std::vector<int64_t> counts =
      AllGather(group, std::vector<int64_t>{num_tokens_}, Traffic::kRouting, stats);
  t_max_ = *std::max_element(counts.begin(), counts.end());
  x_all_ = AllGather(group, PadRows(x, t_max_), Traffic::kTokens, stats);

  // Routing per pair: (expert or -1 if dropped, position among the expert's kept pairs, weight).
  Tensor routing = Tensor::Full({t_max_, 3 * k}, 0.0, DType::kInt32);
  int32_t* rp = routing.data<int32_t>();
  for (int64_t i = 0; i < num_tokens_ * k; ++i) {
    const bool kept = plan.rows[static_cast<size_t>(i)] >= 0;
    rp[3 * i] = -1;
    if (kept) {
      const int64_t row = plan.rows[static_cast<size_t>(i)];
      int64_t expert = std::upper_bound(plan.offsets.begin(), plan.offsets.end(), row) -
                       plan.offsets.begin() - 1;
      rp[3 * i] = static_cast<int32_t>(expert);
      rp[3 * i + 1] = plan.slots[static_cast<size_t>(i)];
      rp[3 * i + 2] = std::bit_cast<int32_t>(plan.weights[static_cast<size_t>(i)]);
    }
  }
  Tensor all = AllGather(group, routing, Traffic::kRouting, stats);
  const int32_t* ap = all.data<int32_t>();

  // The rows of this rank: per local expert, per source, the slice sigma of the kept pairs.
  std::vector<std::vector<Row>> by_source_expert(static_cast<size_t>(p_num * el));
  for (int d = 0; d < p_num; ++d) {
    for (int64_t t = 0; t < counts[static_cast<size_t>(d)]; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t* rec = ap + ((d * t_max_ + t) * k + j) * 3;
        const int64_t le = rec[0] - q * el;
        if (rec[0] < 0 || le < 0 || le >= el) continue;
        auto& list = by_source_expert[static_cast<size_t>(d * el + le)];
        const auto pos = static_cast<size_t>(rec[1]);
        if (list.size() <= pos) list.resize(pos + 1);
        list[pos] =
            Row{d, static_cast<int32_t>(t), static_cast<int32_t>(j), std::bit_cast<float>(rec[2])};
      }
    }
  }
  groups_.begin.assign(static_cast<size_t>(el), 0);
  groups_.rows.assign(static_cast<size_t>(el), 0);
  for (int64_t le = 0; le < el; ++le) {
    groups_.begin[static_cast<size_t>(le)] = static_cast<int64_t>(rows_.size());
    for (int d = 0; d < p_num; ++d) {
      const auto& list = by_source_expert[static_cast<size_t>(d * el + le)];
      const auto cnt = static_cast<int64_t>(list.size());
      const int64_t lo = SliceBegin(sigma, g, cnt), hi = SliceBegin(sigma + 1, g, cnt);
      rows_.insert(rows_.end(), list.begin() + lo, list.begin() + hi);
    }
    groups_.rows[static_cast<size_t>(le)] =
        static_cast<int64_t>(rows_.size()) - groups_.begin[static_cast<size_t>(le)];
  }
  const int64_t m = model_dim_;
  input_ = Tensor::Empty({static_cast<int64_t>(rows_.size()), m});
  float* in = input_.data<float>();
  const float* xa = x_all_.data<float>();
  for (size_t i = 0; i < rows_.size(); ++i) {
    const Row& row = rows_[i];
    const float* src = xa + (row.source * t_max_ + row.token) * m;
    float* dst = in + static_cast<int64_t>(i) * m;
    if (spec.prescore) {
      for (int64_t c = 0; c < m; ++c) dst[c] = row.weight * src[c];
    } else {
      std::memcpy(dst, src, static_cast<size_t>(m) * sizeof(float));
    }
  }
}

Tensor AllGatherDispatch::Combine(const Tensor& expert_out, CommStats* stats) const {
  const int64_t m = model_dim_;
  Tensor partial = Tensor::Zeros({group_.size() * t_max_, m});
  float* pp = partial.data<float>();
  const float* ep = expert_out.data<float>();
  for (size_t i = 0; i < rows_.size(); ++i) {
    const Row& row = rows_[i];
    float* dst = pp + (row.source * t_max_ + row.token) * m;
    const float* src = ep + static_cast<int64_t>(i) * m;
    const float w = spec_.prescore ? 1.0f : row.weight;
    for (int64_t c = 0; c < m; ++c) dst[c] += w * src[c];
  }
  Tensor mine = ReduceScatter(group_, partial, Traffic::kTokens, stats);
  return mine.Slice(0, num_tokens_).Clone();
}

Tensor AllGatherDispatch::CombineBackward(const Tensor& dy, const Tensor& expert_out,
                                          CommStats* stats) {
  const int64_t m = model_dim_, k = top_k_;
  Tensor dy_all = AllGather(group_, PadRows(dy, t_max_), Traffic::kTokens, stats);
  d_weights_all_.assign(static_cast<size_t>(group_.size() * t_max_ * k), 0.0f);
  Tensor d_out = Tensor::Empty({static_cast<int64_t>(rows_.size()), m});
  const float* dp = dy_all.data<float>();
  const float* ep = expert_out.data<float>();
  float* op = d_out.data<float>();
  for (size_t i = 0; i < rows_.size(); ++i) {
    const Row& row = rows_[i];
    const int64_t tok = row.source * t_max_ + row.token;
    const float* g = dp + tok * m;
    float* dst = op + static_cast<int64_t>(i) * m;
    if (spec_.prescore) {
      std::memcpy(dst, g, static_cast<size_t>(m) * sizeof(float));
    } else {
      for (int64_t c = 0; c < m; ++c) dst[c] = row.weight * g[c];
      d_weights_all_[static_cast<size_t>(tok * k + row.choice)] +=
          kernels::Dot(g, ep + static_cast<int64_t>(i) * m, m);
    }
  }
  return d_out;
}

AllGatherDispatch::Grads AllGatherDispatch::DispatchBackward(const Tensor& d_expert_in,
                                                             CommStats* stats) {
  const int64_t m = model_dim_, k = top_k_;
  Tensor dx_all = Tensor::Zeros({group_.size() * t_max_, m});
  float* dxp = dx_all.data<float>();
  const float* dp = d_expert_in.data<float>();
  const float* xa = x_all_.data<float>();
  for (size_t i = 0; i < rows_.size(); ++i) {
    const Row& row = rows_[i];
    const int64_t tok = row.source * t_max_ + row.token;
    const float* src = dp + static_cast<int64_t>(i) * m;
    float* dst = dxp + tok * m;
    const float w = spec_.prescore ? row.weight : 1.0f;
    for (int64_t c = 0; c < m; ++c) dst[c] += w * src[c];
    if (spec_.prescore) {
      d_weights_all_[static_cast<size_t>(tok * k + row.choice)] +=
          kernels::Dot(xa + tok * m, src, m);
    }
  }
  Grads g;
  g.x = ReduceScatter(group_, dx_all, Traffic::kTokens, stats).Slice(0, num_tokens_).Clone();
  Tensor dw = Tensor::FromVector(d_weights_all_, {group_.size() * t_max_, k});
  Tensor mine = ReduceScatter(group_, dw, Traffic::kRouting, stats);
  const float* wp = mine.data<float>();
  g.weights.assign(wp, wp + num_tokens_ * k);
  return g;
}

}  // namespace switchyard::parallel::internal
