// Reduce as ring reduce-scatter + gather to root (Rabenseifner), for large messages.
// Steps: (W - 1) ring steps + 1 gather step (root receives W - 1 chunks at once).
// Bytes on the wire per rank: N (W - 1) / W sent in the ring, N / W sent to the root; the root
// receives N (W - 1) / W in the gather. ~2N in all instead of N log2 W at the root.
#include <cstring>
#include <vector>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

// Ring reduce-scatter over chunks of the whole buffer (shared with AllReduceRing): afterwards
// chunk (rank + 1) mod W of `work` holds the full reduction. Every chunk received is reduced
// from `send` and the incoming data into `work` (send may equal work).
void RingReduceScatterChunks(OpContext& ctx, const void* send, void* work, size_t count,
                             uint32_t phase) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t es = ctx.elem_size();
  auto* out = static_cast<std::byte*>(work);
  const auto* in = static_cast<const std::byte*>(send);
  auto off = [&](int c) { return ChunkBegin(count, w, c) * es; };
  auto bytes = [&](int c) { return (ChunkBegin(count, w, c + 1) - ChunkBegin(count, w, c)) * es; };
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  for (int s = 0; s < w - 1; ++s) {
    int send_c = (r - s + w) % w, recv_c = (r - s - 1 + w) % w;
    // Step 0 sends this rank's own data; later steps forward the chunk reduced at step s - 1.
    const std::byte* src = (s == 0 ? in : out) + off(send_c);
    RequestPtr rq = ctx.RecvReduce(left, out + off(recv_c), in + off(recv_c), bytes(recv_c), phase);
    RequestPtr sq = ctx.Send(right, src, bytes(send_c), phase);
    ctx.Wait({rq.get(), sq.get()});
  }
}

void ReduceScatterGather(OpContext& ctx, const void* send, void* recv, size_t count, int root) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t es = ctx.elem_size();
  void* work = recv;
  if (r != root) {
    work = Scratch(0, count * es);
  }
  if (w == 1) {
    if (count > 0 && work != send) CopyBytes(work, send, count * es);
    return;
  }
  RingReduceScatterChunks(ctx, send, work, count, /*phase=*/0);
  // Rank p holds the reduced chunk (p + 1) mod W.
  auto* base = static_cast<std::byte*>(work);
  auto off = [&](int c) { return ChunkBegin(count, w, c) * es; };
  auto bytes = [&](int c) { return (ChunkBegin(count, w, c + 1) - ChunkBegin(count, w, c)) * es; };
  if (r == root) {
    std::vector<RequestPtr> recvs;
    for (int p = 0; p < w; ++p) {
      if (p == r) continue;
      int c = (p + 1) % w;
      recvs.push_back(ctx.Recv(p, base + off(c), bytes(c), /*phase=*/1));
    }
    ctx.WaitAll(recvs);
  } else {
    int c = (r + 1) % w;
    RequestPtr s = ctx.Send(root, base + off(c), bytes(c), /*phase=*/1);
    ctx.Wait({s.get()});
  }
}

}  // namespace switchyard::comm
