// Gather, linear: the root posts W - 1 receives at once (rank p's block into block p) and copies
// its own. Steps: 1 (W - 1 messages into the root). Bytes on the wire: N (W - 1) into the root
// (N = one block), N from every other rank.
#include <cstring>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void GatherLinear(OpContext& ctx, const void* send, void* recv, size_t count, int root) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t block = count * ctx.elem_size();
  if (r != root) {
    RequestPtr sq = ctx.Send(root, send, block);
    ctx.Wait({sq.get()});
    return;
  }
  auto* out = static_cast<std::byte*>(recv);
  std::vector<RequestPtr> recvs;
  for (int s = 1; s < w; ++s) {
    int p = (r + s) % w;
    recvs.push_back(ctx.Recv(p, out + static_cast<size_t>(p) * block, block));
  }
  if (block > 0 && send != out + static_cast<size_t>(r) * block) {
    CopyBytes(out + static_cast<size_t>(r) * block, send, block);
  }
  ctx.WaitAll(recvs);
}

}  // namespace switchyard::comm
