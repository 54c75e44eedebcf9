// Allgather, linear: every rank posts W - 1 receives and sends its own block to the W - 1 others
// at once (to r + 1, r + 2, ... to spread the load).
// Steps: 1 (W - 1 messages in flight each way). Bytes on the wire per rank: B (W - 1) sent and
// received, as the ring, but without its W - 1 dependent steps: better where ranks are threads
// or oversubscribed processes; the ring is kinder to a network's links.
#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void AllGatherLinear(OpContext& ctx, const void* send, void* recv, size_t count) {
  const int w = ctx.size(), r = ctx.rank();
  const size_t block = count * ctx.elem_size();
  auto* out = static_cast<std::byte*>(recv);
  auto at = [&](int b) { return out + static_cast<size_t>(b) * block; };
  std::vector<RequestPtr> requests;
  requests.reserve(2 * static_cast<size_t>(w));
  for (int s = 1; s < w; ++s) {
    int from = (r - s + w) % w;
    requests.push_back(ctx.Recv(from, at(from), block));
  }
  for (int s = 1; s < w; ++s) requests.push_back(ctx.Send((r + s) % w, send, block));
  if (block > 0 && send != at(r)) CopyBytes(at(r), send, block);
  ctx.WaitAll(requests);
}

}  // namespace switchyard::comm
