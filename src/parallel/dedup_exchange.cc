#include "parallel/dedup_exchange.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <tuple>

#include "parallel/collectives.h"
#include "parallel/trace_context.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"
#include "switchyard/core/thread_pool.h"
#include "switchyard/kernels/reduce.h"

namespace switchyard::parallel::internal {
namespace {

// Words of a sent row's routing record: per choice (local expert or -1, slot, weight bits).
constexpr int64_t kWordsPerChoice = 3;
// Rows per chunk of the threaded row loops (each row is written by one thread).
constexpr int64_t kRowGrain = 64;

// dst = s * src, or dst += s * src, over n floats.
void Scale(float* __restrict dst, const float* __restrict src, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = s * src[i];
}
void Axpy(float* __restrict dst, const float* __restrict src, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += s * src[i];
}

// Bytes a packed-by-peer transfer of `rows` per peer puts on the wire (its own block stays).
double WireBytes(const std::vector<int64_t>& rows, int self, int64_t row_bytes) {
  int64_t sent = 0;
  for (size_t p = 0; p < rows.size(); ++p) {
    if (static_cast<int>(p) != self) sent += rows[p];
  }
  return static_cast<double>(sent * row_bytes);
}

// The token all-to-all-v of `send` [sum(send_rows), M] as the exchange's transfers ("send c0" /
// "return c0" on the comm track, Traffic::kTokens).
Tensor TokenAllToAllV(comm::Communicator& group, const Tensor& send,
                      const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                      const char* name, CommStats* stats) {
  int64_t total = 0;
  for (int64_t n : recv_rows) total += n;
  Tensor recv = Tensor::Empty({total, send.size(1)});
  const double issued = NowSeconds();
  const double bytes = WireBytes(send_rows, group.rank(), send.size(1) * 4);
  comm::Work work = group.AllToAllV(send, send_rows, recv, recv_rows);
  const double t0 = NowSeconds();
  work.Wait();
  AccountWork(name, work, stats, Traffic::kTokens, bytes, issued, t0, NowSeconds());
  return recv;
}

}  // namespace

DedupExchange::DedupExchange(comm::Communicator& group, int64_t local_experts, bool prescore,
                             int threads, const moe::DispatchPlan& plan, const Tensor& x,
                             CommStats* stats)
    : group_(group), prescore_(prescore), threads_(std::max(1, threads)) {
  const int p_num = group.size();
  const int64_t el = local_experts, k = plan.top_k, m = x.size(1);
  SY_CHECK(el * p_num == plan.num_experts, "{} ranks x {} experts", p_num, el);
  num_tokens_ = plan.num_tokens;
  top_k_ = k;
  model_dim_ = m;
  // 1. Source: which ranks each token goes to, and its routing record there.
  auto expert_of = [&](int32_t row) {
    return static_cast<int64_t>(std::upper_bound(plan.offsets.begin(), plan.offsets.end(), row) -
                                plan.offsets.begin() - 1);
  };
  std::vector<std::vector<int32_t>> tokens_to(static_cast<size_t>(p_num));
  std::vector<std::vector<int32_t>> records_to(static_cast<size_t>(p_num));
  std::vector<int32_t> record(static_cast<size_t>(k * kWordsPerChoice));
  {
    TraceSpan span("encode");
    for (int64_t t = 0; t < num_tokens_; ++t) {
      for (int d = 0; d < p_num; ++d) {
        bool any = false;
        for (int64_t j = 0; j < k; ++j) {
          const auto i = static_cast<size_t>(t * k + j);
          int32_t* rec = record.data() + j * kWordsPerChoice;
          rec[0] = -1;
          rec[1] = 0;
          rec[2] = 0;
          const int32_t row = plan.rows[i];
          if (row < 0) continue;
          const int64_t e = expert_of(row);
          if (e / el != d) continue;
          any = true;
          rec[0] = static_cast<int32_t>(e - d * el);
          rec[1] = plan.slots[i];
          rec[2] = std::bit_cast<int32_t>(plan.weights[i]);
        }
        if (!any) continue;
        tokens_to[static_cast<size_t>(d)].push_back(static_cast<int32_t>(t));
        auto& recs = records_to[static_cast<size_t>(d)];
        recs.insert(recs.end(), record.begin(), record.end());
      }
    }
  }
  send_rows_.assign(static_cast<size_t>(p_num), 0);
  std::vector<int32_t> records;
  for (int d = 0; d < p_num; ++d) {
    const auto& toks = tokens_to[static_cast<size_t>(d)];
    send_rows_[static_cast<size_t>(d)] = static_cast<int64_t>(toks.size());
    sent_tokens_.insert(sent_tokens_.end(), toks.begin(), toks.end());
    const auto& recs = records_to[static_cast<size_t>(d)];
    records.insert(records.end(), recs.begin(), recs.end());
  }
  recv_rows_ = AllToAll(group, send_rows_, Traffic::kRouting, stats);
  int64_t r_num = 0;
  for (int64_t n : recv_rows_) r_num += n;

  // 2. The tokens and their records.
  const auto sent = static_cast<int64_t>(sent_tokens_.size());
  Tensor send = Tensor::Empty({sent, m});
  const float* xp = x.data<float>();
  for (int64_t s = 0; s < sent; ++s) {
    std::memcpy(send.data<float>() + s * m, xp + int64_t{sent_tokens_[static_cast<size_t>(s)]} * m,
                static_cast<size_t>(m) * sizeof(float));
  }
  Tensor rec_send = Tensor::FromVector(records, {sent, k * kWordsPerChoice});
  Tensor rec_recv = Tensor::Empty({r_num, k * kWordsPerChoice}, DType::kInt32);
  AllToAllV(group, rec_send, send_rows_, rec_recv, recv_rows_, Traffic::kRouting, stats);
  x_recv_ = TokenAllToAllV(group, send, send_rows_, recv_rows_, "send c0", stats);

  // 3. Destination: the expert rows ordered by (local expert, source rank, slot), as the per-pair
  // exchange delivers them.
  const int32_t* rp = rec_recv.data<int32_t>();
  std::vector<std::tuple<int32_t, int32_t, int32_t, int32_t>> rows;  // (le, source, slot, pair)
  recv_weights_.assign(static_cast<size_t>(r_num * k), 0.0f);
  int64_t i = 0;
  for (int src = 0; src < p_num; ++src) {
    for (int64_t n = 0; n < recv_rows_[static_cast<size_t>(src)]; ++n, ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t* rec = rp + (i * k + j) * kWordsPerChoice;
        if (rec[0] < 0) continue;
        SY_CHECK(rec[0] < el, "local expert {} of {}", rec[0], el);
        rows.emplace_back(rec[0], src, rec[1], static_cast<int32_t>(i * k + j));
        recv_weights_[static_cast<size_t>(i * k + j)] = std::bit_cast<float>(rec[2]);
      }
    }
  }
  std::sort(rows.begin(), rows.end());
  row_of_.assign(static_cast<size_t>(r_num * k), -1);
  groups_.begin.assign(static_cast<size_t>(el), 0);
  groups_.rows.assign(static_cast<size_t>(el), 0);
  input_ = Tensor::Empty({static_cast<int64_t>(rows.size()), m});
  float* in = input_.data<float>();
  const float* xr = x_recv_.data<float>();
  for (size_t row = 0; row < rows.size(); ++row) {
    const auto [le, src, slot, pair] = rows[row];
    if (groups_.rows[static_cast<size_t>(le)] == 0) {
      groups_.begin[static_cast<size_t>(le)] = static_cast<int64_t>(row);
    }
    ++groups_.rows[static_cast<size_t>(le)];
    row_of_[static_cast<size_t>(pair)] = static_cast<int32_t>(row);
    const float* token = xr + pair / k * m;
    float* dst = in + static_cast<int64_t>(row) * m;
    if (prescore) {
      Scale(dst, token, recv_weights_[static_cast<size_t>(pair)], m);
    } else {
      std::memcpy(dst, token, static_cast<size_t>(m) * sizeof(float));
    }
  }
  // An empty group starts where the rows of the next local experts would.
  int64_t at = 0;
  for (int64_t le = 0; le < el; ++le) {
    if (groups_.rows[static_cast<size_t>(le)] == 0) groups_.begin[static_cast<size_t>(le)] = at;
    at = groups_.begin[static_cast<size_t>(le)] + groups_.rows[static_cast<size_t>(le)];
  }
}

void DedupExchange::ForEachPair(
    const std::function<void(int64_t i, size_t pair, int32_t row)>& fn) const {
  const int64_t k = top_k_;
  ParallelFor(x_recv_.size(0), threads_, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const auto pair = static_cast<size_t>(i * k + j);
        if (row_of_[pair] >= 0) fn(i, pair, row_of_[pair]);
      }
    }
  });
}

Tensor DedupExchange::ToDestinations(const Tensor& rows_by_token, const char* name,
                                     CommStats* stats) const {
  const int64_t m = rows_by_token.size(1);
  Tensor send = Tensor::Empty({static_cast<int64_t>(sent_tokens_.size()), m});
  const float* src = rows_by_token.data<float>();
  for (size_t s = 0; s < sent_tokens_.size(); ++s) {
    std::memcpy(send.data<float>() + static_cast<int64_t>(s) * m,
                src + int64_t{sent_tokens_[s]} * m, static_cast<size_t>(m) * sizeof(float));
  }
  return TokenAllToAllV(group_, send, send_rows_, recv_rows_, name, stats);
}

Tensor DedupExchange::ToSources(const Tensor& partial, const char* name, CommStats* stats) const {
  return TokenAllToAllV(group_, partial, recv_rows_, send_rows_, name, stats);
}

void DedupExchange::AddAtSource(const Tensor& returned, const Tensor& out) const {
  const int64_t c = out.size(1);
  const float* src = returned.data<float>();
  float* dst = out.data<float>();
  // Packed by destination rank: a token's partials are added in rank order.
  for (size_t s = 0; s < sent_tokens_.size(); ++s) {
    Axpy(dst + int64_t{sent_tokens_[s]} * c, src + static_cast<int64_t>(s) * c, 1.0f, c);
  }
}

Tensor DedupExchange::Combine(const Tensor& expert_out, CommStats* stats) const {
  const int64_t m = model_dim_, r_num = x_recv_.size(0);
  Tensor partial = Tensor::Zeros({r_num, m});
  const float* ep = expert_out.data<float>();
  float* pp = partial.data<float>();
  {
    TraceSpan span("local combine");
    ForEachPair([&](int64_t i, size_t pair, int32_t row) {
      Axpy(pp + i * m, ep + int64_t{row} * m, prescore_ ? 1.0f : recv_weights_[pair], m);
    });
  }
  Tensor back = ToSources(partial, "return c0", stats);
  TraceSpan span("decode");
  Tensor y = Tensor::Zeros({num_tokens_, m});
  AddAtSource(back, y);
  return y;
}

Tensor DedupExchange::CombineBackward(const Tensor& dy, const Tensor& expert_out,
                                      CommStats* stats) {
  const int64_t m = model_dim_, k = top_k_, r_num = x_recv_.size(0);
  Tensor dy_recv = ToDestinations(dy, "send c0", stats);
  TraceSpan span("decode backward");
  d_weights_.assign(static_cast<size_t>(r_num * k), 0.0f);
  Tensor d_out = Tensor::Empty({input_.size(0), m});
  const float* dp = dy_recv.data<float>();
  const float* ep = expert_out.data<float>();
  float* op = d_out.data<float>();
  ForEachPair([&](int64_t i, size_t pair, int32_t row) {
    float* dst = op + int64_t{row} * m;
    if (prescore_) {
      std::memcpy(dst, dp + i * m, static_cast<size_t>(m) * sizeof(float));
    } else {
      Scale(dst, dp + i * m, recv_weights_[pair], m);
      d_weights_[pair] = kernels::Dot(dp + i * m, ep + int64_t{row} * m, m);
    }
  });
  return d_out;
}

DedupExchange::Grads DedupExchange::DispatchBackward(const Tensor& d_expert_in, CommStats* stats) {
  const int64_t m = model_dim_, k = top_k_, r_num = x_recv_.size(0);
  Tensor dx_partial = Tensor::Zeros({r_num, m});
  {
    TraceSpan span("encode backward");
    const float* dp = d_expert_in.data<float>();
    const float* xr = x_recv_.data<float>();
    float* dxp = dx_partial.data<float>();
    ForEachPair([&](int64_t i, size_t pair, int32_t row) {
      const float* src = dp + int64_t{row} * m;
      Axpy(dxp + i * m, src, prescore_ ? recv_weights_[pair] : 1.0f, m);
      if (prescore_) d_weights_[pair] += kernels::Dot(xr + i * m, src, m);
    });
  }
  Grads g;
  g.x = Tensor::Zeros({num_tokens_, m});
  AddAtSource(ToSources(dx_partial, "return c0", stats), g.x);
  // The weight gradients [R, k] back to their sources: each (token, choice) is non-zero on the
  // one rank holding its expert.
  Tensor dw = Tensor::FromVector(d_weights_, {r_num, k});
  int64_t sent = 0;
  for (int64_t n : send_rows_) sent += n;
  Tensor dw_back = Tensor::Empty({sent, k});
  AllToAllV(group_, dw, recv_rows_, dw_back, send_rows_, Traffic::kRouting, stats);
  Tensor weights = Tensor::Zeros({num_tokens_, k});
  AddAtSource(dw_back, weights);
  const float* wp = weights.data<float>();
  g.weights.assign(wp, wp + num_tokens_ * k);
  return g;
}

}  // namespace switchyard::parallel::internal
