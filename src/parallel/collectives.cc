#include "parallel/collectives.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "parallel/trace_context.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"

namespace switchyard::parallel::internal {

namespace {

template <typename Fn>
void Timed(const char* name, CommStats* stats, Traffic traffic, double bytes, Fn&& start) {
  double t0 = NowSeconds();
  comm::Work work = start();
  work.Wait();
  const double t1 = NowSeconds();
  AccountWork(Tracing() ? fmt::format("{} {}", name, TrafficName(traffic)) : std::string(), work,
              stats, traffic, bytes, t0, t0, t1);
}

Shape WithRows(const Tensor& t, int64_t rows) {
  Shape s = t.shape();
  s[0] = rows;
  return s;
}

}  // namespace

std::string_view TrafficName(Traffic traffic) {
  switch (traffic) {
    case Traffic::kTokens: return "tokens";
    case Traffic::kRouting: return "routing";
    case Traffic::kWeights: return "weights";
    case Traffic::kTensor: return "tensor";
    case Traffic::kContext: return "context";
    case Traffic::kCount: break;
  }
  return "?";
}

void AccountWork(std::string_view name, const comm::Work& work, CommStats* stats, Traffic traffic,
                 double bytes, double issued_s, double wait_begin_s, double wait_end_s) {
  double busy = wait_end_s - issued_s;
  comm::Clock::time_point started, finished;
  const bool timed = work.Times(&started, &finished);
  if (timed) busy = Seconds(finished) - Seconds(started);
  if (stats) {
    stats->bytes[static_cast<int>(traffic)] += bytes;
    stats->collectives += 1;
    stats->comm_seconds += wait_end_s - wait_begin_s;
    stats->busy_seconds += busy;
    stats->traffic_comm_seconds[static_cast<int>(traffic)] += wait_end_s - wait_begin_s;
    stats->traffic_busy_seconds[static_cast<int>(traffic)] += busy;
  }
  if (Tracing()) {
    RecordEvent(std::string(name), TraceStream::kComm, timed ? Seconds(started) : issued_s,
                timed ? Seconds(finished) : wait_end_s,
                {{"bytes", bytes}, {"traffic", static_cast<double>(traffic)}});
  }
}

void AllReduceSum(comm::Communicator& c, std::span<double> values, Traffic traffic,
                  CommStats* stats) {
  // Doubles travel as their int64 bit patterns (the collectives have no float64) and every rank
  // adds the parts in rank order, so the sums are equal on every rank and independent of the
  // reduction algorithm.
  const size_t n = values.size();
  std::vector<int64_t> bits(n);
  std::memcpy(bits.data(), values.data(), n * sizeof(double));
  std::vector<int64_t> all = AllGather(c, bits, traffic, stats);
  std::vector<double> sum(n, 0.0);
  for (int p = 0; p < c.size(); ++p) {
    for (size_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, &all[static_cast<size_t>(p) * n + i], sizeof(double));
      sum[i] += v;
    }
  }
  std::copy(sum.begin(), sum.end(), values.begin());
}

void AllReduceSum(comm::Communicator& c, const Tensor& tensor, Traffic traffic, CommStats* stats) {
  const double p = c.size();
  Timed("allreduce", stats, traffic, 2.0 * (p - 1) / p * static_cast<double>(tensor.nbytes()),
        [&] { return c.AllReduce(tensor); });
}

void AllReduceSum(comm::Communicator& c, std::span<int64_t> values, Traffic traffic,
                  CommStats* stats) {
  const double p = c.size();
  Timed("allreduce", stats, traffic, 2.0 * (p - 1) / p * static_cast<double>(values.size_bytes()),
        [&] { return c.AllReduce(values.data(), values.data(), values.size(), DType::kInt64); });
}

void AllReduceMax(comm::Communicator& c, std::span<int64_t> values, Traffic traffic,
                  CommStats* stats) {
  const double p = c.size();
  comm::AllReduceOptions o;
  o.reduce_op = comm::ReduceOp::kMax;
  Timed("allreduce max", stats, traffic,
        2.0 * (p - 1) / p * static_cast<double>(values.size_bytes()),
        [&] { return c.AllReduce(values.data(), values.data(), values.size(), DType::kInt64, o); });
}

Tensor AllGather(comm::Communicator& c, const Tensor& part, Traffic traffic, CommStats* stats) {
  Tensor out = Tensor::Empty(WithRows(part, part.size(0) * c.size()), part.dtype());
  Timed("allgather", stats, traffic,
        static_cast<double>(c.size() - 1) * static_cast<double>(part.nbytes()),
        [&] { return c.AllGather(part, out); });
  return out;
}

std::vector<int64_t> AllGather(comm::Communicator& c, std::span<const int64_t> part,
                               Traffic traffic, CommStats* stats) {
  std::vector<int64_t> out(part.size() * static_cast<size_t>(c.size()));
  Timed("allgather", stats, traffic,
        static_cast<double>(c.size() - 1) * static_cast<double>(part.size_bytes()),
        [&] { return c.AllGather(part.data(), out.data(), part.size(), DType::kInt64); });
  return out;
}

Tensor ReduceScatter(comm::Communicator& c, const Tensor& input, Traffic traffic,
                     CommStats* stats) {
  const int64_t p = c.size();
  SY_CHECK(input.size(0) % p == 0, "reduce-scatter of {} rows over {} ranks", input.size(0), p);
  Tensor out = Tensor::Empty(WithRows(input, input.size(0) / p), input.dtype());
  Timed("reduce_scatter", stats, traffic,
        static_cast<double>(p - 1) / static_cast<double>(p) * static_cast<double>(input.nbytes()),
        [&] { return c.ReduceScatter(input, out); });
  return out;
}

void AllToAll(comm::Communicator& c, const Tensor& input, const Tensor& output,
              const comm::AllToAllOptions& options, Traffic traffic, CommStats* stats) {
  const double p = c.size();
  Timed("alltoall", stats, traffic, (p - 1) / p * static_cast<double>(input.nbytes()),
        [&] { return c.AllToAll(input, output, options); });
}

std::vector<int64_t> AllToAll(comm::Communicator& c, std::span<const int64_t> input,
                              Traffic traffic, CommStats* stats,
                              const comm::AllToAllOptions& options) {
  const size_t p = static_cast<size_t>(c.size());
  SY_CHECK(input.size() % p == 0);
  std::vector<int64_t> out(input.size());
  Timed(
      "alltoall", stats, traffic,
      static_cast<double>(p - 1) / static_cast<double>(p) * static_cast<double>(input.size_bytes()),
      [&] {
        return c.AllToAll(input.data(), out.data(), input.size() / p, DType::kInt64, options);
      });
  return out;
}

void AllToAllV(comm::Communicator& c, const Tensor& input, std::span<const int64_t> send_rows,
               const Tensor& output, std::span<const int64_t> recv_rows, Traffic traffic,
               CommStats* stats) {
  auto row_bytes = static_cast<int64_t>(DTypeSize(input.dtype()));
  for (int64_t d = 1; d < input.dim(); ++d) row_bytes *= input.size(d);
  int64_t sent = 0;
  for (int p = 0; p < c.size(); ++p) {
    if (p != c.rank()) sent += send_rows[static_cast<size_t>(p)];
  }
  Timed("alltoallv", stats, traffic, static_cast<double>(sent * row_bytes),
        [&] { return c.AllToAllV(input, send_rows, output, recv_rows); });
}

void SwapMiddle(const float* src, float* dst, int64_t a, int64_t b, int64_t c, int64_t d) {
  const size_t block = static_cast<size_t>(d) * sizeof(float);
  for (int64_t i = 0; i < a; ++i) {
    for (int64_t j = 0; j < b; ++j) {
      for (int64_t k = 0; k < c; ++k) {
        std::memcpy(dst + ((i * c + k) * b + j) * d, src + ((i * b + j) * c + k) * d, block);
      }
    }
  }
}

}  // namespace switchyard::parallel::internal
