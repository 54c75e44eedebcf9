// Reduce up a binomial tree to `root`.
// Steps: ceil(log2 W). Relative rank v receives from v + 2^i for 2^i below its lowest set bit
// (reducing each into its accumulator), then sends the accumulator to v - 2^j.
// Bytes on the wire: every non-root rank sends N once; the root receives N ceil(log2 W).
// Latency-optimal; used for small messages.
#include <cstring>
#include <vector>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

// The reduction half of a tree, shared with AllReduceTree: leaves the result in `acc` at root.
// `acc` is [count] (may equal send); returns without touching acc if this rank has no children.
void ReduceTreeInto(OpContext& ctx, const void* send, void* acc, size_t count, int root) {
  const int w = ctx.size();
  const int v = (ctx.rank() - root + w) % w;
  const size_t bytes = count * ctx.elem_size();
  const void* current = send;  // this rank's partial result so far
  for (int mask = 1; mask < w; mask <<= 1) {
    if (v & mask) {
      RequestPtr s = ctx.Send((v - mask + root) % w, current, bytes);
      ctx.Wait({s.get()});
      return;
    }
    if (v + mask < w) {
      RequestPtr r = ctx.RecvReduce((v + mask + root) % w, acc, current, bytes);
      ctx.Wait({r.get()});
      current = acc;
    }
  }
  if (current != acc && count > 0) CopyBytes(acc, current, bytes);  // root without children
}

void ReduceTree(OpContext& ctx, const void* send, void* recv, size_t count, int root) {
  void* acc = recv;
  if (ctx.rank() != root) {
    acc = Scratch(0, count * ctx.elem_size());
  }
  ReduceTreeInto(ctx, send, acc, count, root);
}

}  // namespace switchyard::comm
