// Allgather on a ring: at step s send the block received at step s - 1 (own block first) to
// r + 1 and receive block (r - s - 1) from r - 1.
// Steps: W - 1. Bytes on the wire per rank: N (W - 1) sent and received, N = one block.
#include <cstring>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void AllGatherRing(OpContext& ctx, const void* send, void* recv, size_t count) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t block = count * ctx.elem_size();
  auto* out = static_cast<std::byte*>(recv);
  auto at = [&](int b) { return out + static_cast<size_t>(b) * block; };
  if (w == 1) {
    if (block > 0 && send != at(r)) CopyBytes(at(r), send, block);
    return;
  }
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  // Step 0 sends straight from the input while the own block is copied into place.
  RequestPtr rq = ctx.Recv(left, at(left), block);
  RequestPtr sq = ctx.Send(right, send, block);
  if (block > 0 && send != at(r)) CopyBytes(at(r), send, block);
  ctx.Wait({rq.get(), sq.get()});
  for (int s = 1; s < w - 1; ++s) {
    int send_b = (r - s + w) % w, recv_b = (r - s - 1 + w) % w;
    ctx.SendRecv(right, at(send_b), block, left, at(recv_b), block);
  }
}

}  // namespace switchyard::comm
