// All-to-all(-v), linear: every receive and send is posted at once (receives first, sends in the
// order r + 1, r + 2, ... to spread the load), then all are awaited.
// Steps: 1 (W - 1 messages in flight each way). Bytes on the wire per rank: as pairwise,
// N (W - 1) / W for equal blocks. Lowest latency for small blocks; many messages at once.
#include <cstring>

#include "comm/algorithms.h"
#include "comm/copy.h"

namespace switchyard::comm {

void AllToAllLinear(OpContext& ctx, const void* send, void* recv, const AllToAllLayout& layout,
                    uint32_t phase) {
  const int w = ctx.size(), r = ctx.rank();
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  std::vector<RequestPtr> requests;
  requests.reserve(2 * static_cast<size_t>(w));
  for (int s = 1; s < w; ++s) {
    const auto from = static_cast<size_t>((r - s + w) % w);
    requests.push_back(ctx.Recv(static_cast<int>(from), out + layout.recv_offsets[from],
                                layout.recv_bytes[from], phase));
  }
  for (int s = 1; s < w; ++s) {
    const auto to = static_cast<size_t>((r + s) % w);
    requests.push_back(
        ctx.Send(static_cast<int>(to), in + layout.send_offsets[to], layout.send_bytes[to], phase));
  }
  const auto ur = static_cast<size_t>(r);
  if (layout.send_bytes[ur] > 0) {
    CopyBytes(out + layout.recv_offsets[ur], in + layout.send_offsets[ur], layout.send_bytes[ur]);
  }
  ctx.WaitAll(requests);
}

}  // namespace switchyard::comm
