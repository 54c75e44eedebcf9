// Broadcast as scatter + ring allgather (van de Geijn), for large messages.
// Steps: (W - 1) for the scatter (root sends chunk v to relative rank v) + (W - 1) ring steps.
// Bytes on the wire per rank: the root sends N (W - 1) / W in the scatter; every rank then sends
// and receives N (W - 1) / W in the ring. Total ~2N per rank instead of N log2 W at the root.
#include "comm/algorithms.h"

namespace switchyard::comm {

void BroadcastScatterAllGather(OpContext& ctx, void* buffer, size_t count, int root) {
  const int w = ctx.size();
  if (w == 1) return;
  const int v = (ctx.rank() - root + w) % w;
  const size_t es = ctx.elem_size();
  auto* base = static_cast<std::byte*>(buffer);
  auto at = [&](int c) { return base + ChunkBegin(count, w, c) * es; };
  auto bytes = [&](int c) { return (ChunkBegin(count, w, c + 1) - ChunkBegin(count, w, c)) * es; };
  auto real = [&](int relative) { return (relative + root) % w; };
  // Scatter: chunk c (by relative rank) to relative rank c.
  if (v == 0) {
    std::vector<RequestPtr> sends;
    for (int c = 1; c < w; ++c) sends.push_back(ctx.Send(real(c), at(c), bytes(c), /*phase=*/0));
    ctx.WaitAll(sends);
  } else {
    RequestPtr r = ctx.Recv(root, at(v), bytes(v), /*phase=*/0);
    ctx.Wait({r.get()});
  }
  // Ring allgather over relative ranks: at step s send chunk v - s, receive chunk v - s - 1.
  const int right = real(v + 1), left = real(v - 1 + w);
  for (int s = 0; s < w - 1; ++s) {
    int send_c = (v - s + w) % w, recv_c = (v - s - 1 + w) % w;
    ctx.SendRecv(right, at(send_c), bytes(send_c), left, at(recv_c), bytes(recv_c),
                 /*phase=*/1);
  }
}

}  // namespace switchyard::comm
