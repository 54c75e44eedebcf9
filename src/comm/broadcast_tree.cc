// Broadcast down a binomial tree rooted at `root`.
// Steps: ceil(log2 W). Relative rank v = (rank - root) mod W receives from v - 2^j (2^j the
// lowest set bit of v) and then sends to v + 2^i for every 2^i below that bit.
// Bytes on the wire: the root sends N * ceil(log2 W), every other rank receives N once; in total
// N * (W - 1). Latency-optimal; used for small messages.
#include "comm/algorithms.h"

namespace switchyard::comm {

void BroadcastTree(OpContext& ctx, void* buffer, size_t count, int root) {
  const int w = ctx.size();
  const int v = (ctx.rank() - root + w) % w;
  const size_t bytes = count * ctx.elem_size();
  int mask = 1;
  while (mask < w) {
    if (v & mask) {
      RequestPtr r = ctx.Recv((v - mask + root) % w, buffer, bytes);
      ctx.Wait({r.get()});
      break;
    }
    mask <<= 1;
  }
  std::vector<RequestPtr> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < w) sends.push_back(ctx.Send((v + mask + root) % w, buffer, bytes));
  }
  ctx.WaitAll(sends);
}

}  // namespace switchyard::comm
