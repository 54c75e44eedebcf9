// FastMoE's two-phase all-to-all-v, for receivers that do not know their counts:
//   phase 0: all-to-all of the int64 row counts (pairwise, W - 1 steps of 8 bytes);
//   phase 1: the rows themselves, all-to-all-v (pairwise: W - 1 steps, or linear: 1).
// Bytes on the wire per rank: 8 (W - 1) for the counts + the rows for the other ranks.
#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/algorithms.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

// Allocates args.result->output as [total_rows, row_shape...] of the collective's dtype.
void* AllocateRows(OpContext& ctx, const CollectiveArgs& args, int64_t total_rows) {
  Shape shape{total_rows};
  shape.insert(shape.end(), args.row_shape.begin(), args.row_shape.end());
  args.result->output = Tensor::Empty(shape, ctx.info().dtype);
  return args.result->output.raw();
}

// Records the rows received from each peer and where each peer's part starts.
void FinishResult(const CollectiveArgs& args, const std::vector<int64_t>& recv_rows) {
  AllToAllVResult& result = *args.result;
  result.recv_counts = recv_rows;
  result.recv_displs.assign(recv_rows.size(), 0);
  for (size_t p = 1; p < recv_rows.size(); ++p) {
    result.recv_displs[p] = result.recv_displs[p - 1] + recv_rows[p - 1];
  }
}

}  // namespace

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

void AllToAllVDynamicTwoPhase(OpContext& ctx, const CollectiveArgs& args,
                              Algorithm data_algorithm) {
  const size_t row_bytes = static_cast<size_t>(args.row_elems) * ctx.elem_size();
  FinishResult(args,
               AllToAllVTwoPhase(ctx, args.send, args.send_rows, row_bytes, data_algorithm,
                                 [&](int64_t rows) { return AllocateRows(ctx, args, rows); }));
}

// Counts through the transport's all-to-all, rows through its all-to-all-v (in elements).
void AllToAllVDynamicNative(OpContext& ctx, const CollectiveArgs& args) {
  NativeCollectives& native = *ctx.transport().native();
  const auto w = static_cast<size_t>(ctx.size());
  std::vector<int64_t> recv_rows(w, 0);
  native.AllToAll(args.send_rows.data(), recv_rows.data(), 1, DType::kInt64, ctx.deadline());
  std::vector<int64_t> sc, sd, rc, rd;
  int64_t s_off = 0, r_off = 0;
  for (size_t p = 0; p < w; ++p) {
    sc.push_back(args.send_rows[p] * args.row_elems);
    sd.push_back(s_off);
    s_off += sc.back();
    rc.push_back(recv_rows[p] * args.row_elems);
    rd.push_back(r_off);
    r_off += rc.back();
  }
  void* recv = AllocateRows(ctx, args, r_off / std::max<int64_t>(args.row_elems, 1));
  native.AllToAllV(args.send, sc, sd, recv, rc, rd, ctx.info().dtype, ctx.deadline());
  FinishResult(args, recv_rows);
}

}  // namespace switchyard::comm
