// All-to-all(-v) by pairwise exchange: at step s = 1 .. W-1 send to (r + s) mod W and receive
// from (r - s) mod W; the block for this rank itself is a local copy, done while step 1 travels.
// Steps: W - 1, one message each way per step (per-peer sizes may differ, zeros allowed).
// Bytes on the wire per rank: sum of the blocks for the other ranks, N (W - 1) / W for equal
// blocks of a buffer of N bytes.
#include <cstring>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void AllToAllPairwise(OpContext& ctx, const void* send, void* recv, const AllToAllLayout& layout,
                      uint32_t phase) {
  const int w = ctx.size(), r = ctx.rank();
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  const auto ur = static_cast<size_t>(r);
  auto self_copy = [&] {
    if (layout.send_bytes[ur] > 0) {
      CopyBytes(out + layout.recv_offsets[ur], in + layout.send_offsets[ur], layout.send_bytes[ur]);
    }
  };
  if (w == 1) return self_copy();
  for (int s = 1; s < w; ++s) {
    const auto to = static_cast<size_t>((r + s) % w), from = static_cast<size_t>((r - s + w) % w);
    RequestPtr rq = ctx.Recv(static_cast<int>(from), out + layout.recv_offsets[from],
                             layout.recv_bytes[from], phase);
    RequestPtr sq =
        ctx.Send(static_cast<int>(to), in + layout.send_offsets[to], layout.send_bytes[to], phase);
    if (s == 1) self_copy();
    ctx.Wait({rq.get(), sq.get()});
  }
}

}  // namespace switchyard::comm
