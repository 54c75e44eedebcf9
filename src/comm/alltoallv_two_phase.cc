// FastMoE's two-phase all-to-all-v, for receivers that do not know their counts:
//   phase 0: all-to-all of the int64 row counts (pairwise, W - 1 steps of 8 bytes);
//   phase 1: the rows themselves, all-to-all-v (pairwise: W - 1 steps, or linear: 1).
// Bytes on the wire per rank: 8 (W - 1) for the counts + the rows for the other ranks.
#include <cstring>
#include <vector>

#include "comm/algorithms.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {

std::vector<int64_t> AllToAllVTwoPhase(OpContext& ctx, const void* send,
                                       const std::vector<int64_t>& send_rows, size_t row_bytes,
                                       Algorithm data_algorithm,
                                       const std::function<void*(int64_t)>& allocate) {
  const int w = ctx.size();
  const auto uw = static_cast<size_t>(w);
  std::vector<int64_t> recv_rows(uw, 0);
  AllToAllLayout counts;
  counts.send_bytes.assign(uw, sizeof(int64_t));
  counts.recv_bytes.assign(uw, sizeof(int64_t));
  for (size_t p = 0; p < uw; ++p) {
    counts.send_offsets.push_back(p * sizeof(int64_t));
    counts.recv_offsets.push_back(p * sizeof(int64_t));
  }
  AllToAllPairwise(ctx, send_rows.data(), recv_rows.data(), counts, /*phase=*/0);

  AllToAllLayout data;
  int64_t total = 0;
  size_t send_offset = 0;
  for (size_t p = 0; p < uw; ++p) {
    SY_REQUIRE(recv_rows[p] >= 0, PeerError, "rank {} announced {} rows for this rank", p,
               recv_rows[p]);
    data.send_bytes.push_back(static_cast<size_t>(send_rows[p]) * row_bytes);
    data.send_offsets.push_back(send_offset);
    send_offset += data.send_bytes.back();
    data.recv_bytes.push_back(static_cast<size_t>(recv_rows[p]) * row_bytes);
    data.recv_offsets.push_back(static_cast<size_t>(total) * row_bytes);
    total += recv_rows[p];
  }
  void* recv = allocate(total);
  if (data_algorithm == Algorithm::kLinear) {
    AllToAllLinear(ctx, send, recv, data, /*phase=*/1);
  } else {
    AllToAllPairwise(ctx, send, recv, data, /*phase=*/1);
  }
  return recv_rows;
}

}  // namespace switchyard::comm
