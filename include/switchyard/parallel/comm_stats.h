// What one rank spent on communication during a forward or backward of the parallel MoE layer.
//
// Bytes are those this rank puts on the wire under the bandwidth-optimal algorithm of each
// collective (the nccl-tests "bus" convention, docs/parallel.md "Bytes and time"): all-to-all(-v) =
// bytes sent to other ranks; all-gather = (P - 1) x own part; reduce-scatter = (P - 1) / P x input;
// all-reduce = 2 (P - 1) / P x size. Time is wall-clock time spent blocked in collectives; compute
// is the rest.
#pragma once

#include <cstdint>

namespace switchyard::parallel {

// What a collective moved.
enum class Traffic : uint8_t {
  kTokens,   // token rows to and from the experts (all-to-all(-v), all-gather / reduce-scatter)
  kRouting,  // counts, routing of the all-gather dispatcher, capacities, loss sums
  kWeights,  // expert weight gathers and gradient reduce-scatters (adaptive r, ZeRO-style)
  kTensor,   // tensor-parallel gathers of DeepSpeed's de-duplication
  kContext,  // context-parallel attention: Ulysses all-to-alls, ring K/V and dK/dV hops
  kCount
};

struct CommStats {
  double bytes[static_cast<int>(Traffic::kCount)] = {};
  int collectives = 0;
  double comm_seconds = 0;   // blocked in collectives
  double total_seconds = 0;  // the whole call
  double busy_seconds = 0;   // collectives running (hidden or not)
  // comm_seconds and busy_seconds split by traffic.
  double traffic_comm_seconds[static_cast<int>(Traffic::kCount)] = {};
  double traffic_busy_seconds[static_cast<int>(Traffic::kCount)] = {};

  double TotalBytes() const {
    double s = 0;
    for (double b : bytes) s += b;
    return s;
  }
  double Bytes(Traffic t) const { return bytes[static_cast<int>(t)]; }
  double compute_seconds() const { return total_seconds - comm_seconds; }
  double CommSeconds(Traffic t) const { return traffic_comm_seconds[static_cast<int>(t)]; }
  double BusySeconds(Traffic t) const { return traffic_busy_seconds[static_cast<int>(t)]; }
  CommStats& operator+=(const CommStats& o) {
    for (int i = 0; i < static_cast<int>(Traffic::kCount); ++i) {
      bytes[i] += o.bytes[i];
      traffic_comm_seconds[i] += o.traffic_comm_seconds[i];
      traffic_busy_seconds[i] += o.traffic_busy_seconds[i];
    }
    collectives += o.collectives;
    comm_seconds += o.comm_seconds;
    total_seconds += o.total_seconds;
    busy_seconds += o.busy_seconds;
    return *this;
  }
};

}  // namespace switchyard::parallel
