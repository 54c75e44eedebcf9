// Scatter, linear: the root posts W - 1 sends at once (block p to rank p) and copies its own.
// Steps: 1 (W - 1 messages from the root). Bytes on the wire: N (W - 1) from the root (N = one
// block), N into every other rank.
#include <cstring>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void ScatterLinear(OpContext& ctx, const void* send, void* recv, size_t count, int root) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t block = count * ctx.elem_size();
  if (r != root) {
    RequestPtr rq = ctx.Recv(root, recv, block);
    ctx.Wait({rq.get()});
    return;
  }
  const auto* in = static_cast<const std::byte*>(send);
  std::vector<RequestPtr> sends;
  for (int s = 1; s < w; ++s) {
    int p = (r + s) % w;
    sends.push_back(ctx.Send(p, in + static_cast<size_t>(p) * block, block));
  }
  if (block > 0 && recv != in + static_cast<size_t>(r) * block) {
    CopyBytes(recv, in + static_cast<size_t>(r) * block, block);
  }
  ctx.WaitAll(sends);
}

}  // namespace switchyard::comm
