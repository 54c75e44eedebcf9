// Blocking collectives of the parallel layer, each counted in CommStats (bytes on the wire in the
// bus convention of comm_stats.h, time blocked). Private to src/parallel.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/tensor.h"
#include "switchyard/parallel/comm_stats.h"

namespace switchyard::parallel::internal {

// Adds the wall time of its scope to stats->total_seconds.
class ScopedTotal {
 public:
  explicit ScopedTotal(CommStats* stats) : stats_(stats), start_(NowSeconds()) {}
  ~ScopedTotal() {
    if (stats_) stats_->total_seconds += NowSeconds() - start_;
  }
  ScopedTotal(const ScopedTotal&) = delete;
  ScopedTotal& operator=(const ScopedTotal&) = delete;

 private:
  CommStats* stats_;
  double start_;
};

// "tokens", "routing", "weights", "tensor".
std::string_view TrafficName(Traffic traffic);

// Counts a completed collective in `stats` (bytes, blocked time [wait_begin_s, wait_end_s], busy
// time from the Work's own start and finish, else from issued_s) and records it on the comm track
// of the current trace context as `name`.
void AccountWork(std::string_view name, const comm::Work& work, CommStats* stats, Traffic traffic,
                 double bytes, double issued_s, double wait_begin_s, double wait_end_s);

// In place over the group.
void AllReduceSum(comm::Communicator& c, std::span<double> values, Traffic traffic,
                  CommStats* stats);
// Float tensor summed in place (the communicator's all-reduce: equal on every rank).
void AllReduceSum(comm::Communicator& c, const Tensor& tensor, Traffic traffic, CommStats* stats);
void AllReduceSum(comm::Communicator& c, std::span<int64_t> values, Traffic traffic,
                  CommStats* stats);
void AllReduceMax(comm::Communicator& c, std::span<int64_t> values, Traffic traffic,
                  CommStats* stats);
// part [n, ...] -> [P * n, ...], block p = rank p's part.
Tensor AllGather(comm::Communicator& c, const Tensor& part, Traffic traffic, CommStats* stats);
// Int64 form: part [n] -> [P * n].
std::vector<int64_t> AllGather(comm::Communicator& c, std::span<const int64_t> part,
                               Traffic traffic, CommStats* stats);
// input [P * n, ...] -> [n, ...] = sum over ranks of their block rank().
Tensor ReduceScatter(comm::Communicator& c, const Tensor& input, Traffic traffic, CommStats* stats);
// input, output [P * n, ...]: block p goes to / comes from rank p.
void AllToAll(comm::Communicator& c, const Tensor& input, const Tensor& output,
              const comm::AllToAllOptions& options, Traffic traffic, CommStats* stats);
std::vector<int64_t> AllToAll(comm::Communicator& c, std::span<const int64_t> input,
                              Traffic traffic, CommStats* stats,
                              const comm::AllToAllOptions& options = {});
// Rows packed by peer: input [sum(send_rows), ...], output [sum(recv_rows), ...].
void AllToAllV(comm::Communicator& c, const Tensor& input, std::span<const int64_t> send_rows,
               const Tensor& output, std::span<const int64_t> recv_rows, Traffic traffic,
               CommStats* stats);

// dst[a][c][b][d] = src[a][b][c][d] for float blocks of d elements (moves dimension b past c).
void SwapMiddle(const float* src, float* dst, int64_t a, int64_t b, int64_t c, int64_t d);

}  // namespace switchyard::parallel::internal
