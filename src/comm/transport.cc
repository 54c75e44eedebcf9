// Transport operations every implementation shares, written over Isend/Irecv.
#include "switchyard/comm/transport.h"

#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::comm {

// Dissemination barrier (Hensgen, Finkel, Manber 1988): in round k rank r signals r + 2^k and
// waits for r - 2^k; after ceil(log2 W) rounds every rank has heard, transitively, from all.
void Transport::Barrier(uint64_t tag, Deadline deadline) {
  const int w = size();
  const int r = rank();
  for (int k = 1; k < w; k <<= 1) {
    RequestPtr recv = Irecv((r - k + w) % w, tag, nullptr, 0);
    RequestPtr send = Isend((r + k) % w, tag, nullptr, 0, MessageHeader{});
    Request* both[] = {recv.get(), send.get()};
    Wait(both, deadline);
  }
}

std::vector<std::array<int, 2>> Transport::ExchangeSplitKeys(int color, int key, uint64_t tag,
                                                             Deadline deadline) {
  const int w = size();
  const int r = rank();
  std::vector<std::array<int, 2>> keys(static_cast<size_t>(w));
  keys[static_cast<size_t>(r)] = {color, key};
  std::vector<RequestPtr> requests;
  for (int p = 0; p < w; ++p) {
    if (p == r) continue;
    requests.push_back(Irecv(p, tag, keys[static_cast<size_t>(p)].data(), sizeof(keys[0])));
  }
  for (int p = 0; p < w; ++p) {
    if (p == r) continue;
    requests.push_back(
        Isend(p, tag, keys[static_cast<size_t>(r)].data(), sizeof(keys[0]), MessageHeader{}));
  }
  std::vector<Request*> raw;
  for (auto& q : requests) raw.push_back(q.get());
  Wait(raw, deadline);
  for (int p = 0; p < w; ++p) {
    if (p == r) continue;
    SY_REQUIRE(
        requests[static_cast<size_t>(p < r ? p : p - 1)]->received_bytes() == sizeof(keys[0]),
        PeerError, "split: rank {} sent a malformed (color, key) message", p);
  }
  return keys;
}

}  // namespace switchyard::comm
