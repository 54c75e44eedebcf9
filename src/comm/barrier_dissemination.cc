// Barrier by dissemination (Hensgen, Finkel, Manber 1988).
// Steps: ceil(log2 W). In round k rank r sends an empty message to r + 2^k and receives one from
// r - 2^k. Bytes on the wire per rank: 0 payload (headers only).
#include "comm/algorithms.h"

namespace switchyard::comm {

void BarrierDissemination(OpContext& ctx) {
  const int w = ctx.size(), r = ctx.rank();
  for (int k = 1; k < w; k <<= 1) {
    ctx.SendRecv((r + k) % w, nullptr, 0, (r - k + w) % w, nullptr, 0);
  }
}

}  // namespace switchyard::comm
