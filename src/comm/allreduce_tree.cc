// Allreduce as binomial-tree reduce to rank 0 + binomial-tree broadcast from it.
// Steps: 2 ceil(log2 W) (latency-optimal, for small messages).
// Bytes on the wire: every rank but 0 sends N up and receives N down; rank 0 receives and sends
// N ceil(log2 W).
#include "comm/algorithms.h"

namespace switchyard::comm {

void ReduceTreeInto(OpContext& ctx, const void* send, void* acc, size_t count, int root);

void AllReduceTree(OpContext& ctx, const void* send, void* recv, size_t count) {
  ReduceTreeInto(ctx, send, recv, count, /*root=*/0);
  // Down the same tree shape; phase 1 keeps these messages apart from the reduction's.
  const int w = ctx.size(), v = ctx.rank();
  const size_t bytes = count * ctx.elem_size();
  int mask = 1;
  while (mask < w) {
    if (v & mask) {
      RequestPtr r = ctx.Recv(v - mask, recv, bytes, /*phase=*/1);
      ctx.Wait({r.get()});
      break;
    }
    mask <<= 1;
  }
  std::vector<RequestPtr> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < w) sends.push_back(ctx.Send(v + mask, recv, bytes, /*phase=*/1));
  }
  ctx.WaitAll(sends);
}

}  // namespace switchyard::comm
