// Reduce-scatter on a ring: at step s send block (r - s - 1) to r + 1 and receive block
// (r - s - 2) from r - 1, reducing it with this rank's own block; the block received at the last
// step, block r, is the result.
// Steps: W - 1. Bytes on the wire per rank: N (W - 1) sent and received, N = one block.
// Partial sums alternate between two scratch blocks; the last step reduces straight into recv.
#include <cstring>
#include <vector>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void ReduceScatterRing(OpContext& ctx, const void* send, void* recv, size_t count) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t block = count * ctx.elem_size();
  const auto* in = static_cast<const std::byte*>(send);
  auto own = [&](int b) { return in + static_cast<size_t>(b) * block; };
  if (w == 1) {
    if (block > 0 && recv != send) CopyBytes(recv, send, block);
    return;
  }
  std::byte* scratch = Scratch(0, w > 2 ? 2 * block : 0);
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  const std::byte* outgoing = own((r - 1 + w) % w);  // step 0: own data for block r - 1
  for (int s = 0; s < w - 1; ++s) {
    int recv_b = (r - s - 2 + 2 * w) % w;
    std::byte* dst =
        s == w - 2 ? static_cast<std::byte*>(recv) : scratch + static_cast<size_t>(s % 2) * block;
    RequestPtr rq = ctx.RecvReduce(left, dst, own(recv_b), block);
    RequestPtr sq = ctx.Send(right, outgoing, block);
    ctx.Wait({rq.get(), sq.get()});
    outgoing = dst;
  }
}

}  // namespace switchyard::comm
