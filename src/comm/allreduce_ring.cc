// Allreduce on a ring = ring reduce-scatter + ring allgather (Patarasuk & Yuan; NCCL's ring).
// Steps: 2 (W - 1). Reduce-scatter step s: send chunk (r - s) to r + 1, receive chunk
// (r - s - 1) from r - 1 and reduce it (from this rank's input and the incoming data, so an
// out-of-place call costs no extra copy); afterwards rank r holds the reduced chunk r + 1.
// Allgather step s: send chunk (r + 1 - s), receive chunk (r - s).
// Bytes on the wire per rank: 2 N (W - 1) / W sent and as many received (bandwidth-optimal).
#include <cstring>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void RingReduceScatterChunks(OpContext& ctx, const void* send, void* work, size_t count,
                             uint32_t phase);

void AllReduceRing(OpContext& ctx, const void* send, void* recv, size_t count) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t es = ctx.elem_size();
  if (w == 1) {
    if (count > 0 && send != recv) CopyBytes(recv, send, count * es);
    return;
  }
  RingReduceScatterChunks(ctx, send, recv, count, /*phase=*/0);
  auto* out = static_cast<std::byte*>(recv);
  auto off = [&](int c) { return ChunkBegin(count, w, c) * es; };
  auto bytes = [&](int c) { return (ChunkBegin(count, w, c + 1) - ChunkBegin(count, w, c)) * es; };
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  for (int s = 0; s < w - 1; ++s) {
    int send_c = (r + 1 - s + w) % w, recv_c = (r - s + w) % w;
    ctx.SendRecv(right, out + off(send_c), bytes(send_c), left, out + off(recv_c), bytes(recv_c),
                 /*phase=*/1);
  }
}

}  // namespace switchyard::comm
