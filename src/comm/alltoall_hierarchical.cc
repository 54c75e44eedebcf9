// Hierarchical (2DH) all-to-all (Tutel; docs/algorithms.md), for W = N nodes x L ranks per node
// (rank r = node n * L + local l):
//   1. stride copy: the blocks for local rank j of every node become contiguous,
//      a[j][m] = send[m L + j]
//   2. all-to-all inside the node (L ranks, linear): b[j][m] = block from (n, j) for (m, l)
//   3. stride copy: c[m][j] = b[j][m], the blocks for node m contiguous
//   4. all-to-all across nodes among the ranks with local index l (N ranks, linear): the part
//      from (m, l) is c[n] of that rank = the blocks of ranks (m, 0..L-1) for this rank, which
//      land at recv[m L .. m L + L) -- exactly the flat all-to-all's output, byte for byte.
// Steps: 2 (each exchange posts all its messages at once); messages per rank (L - 1) + (N - 1)
// instead of W - 1, of N resp. L blocks.
// Bytes on the wire per rank: B (L - 1) N within the node and B (N - 1) L across nodes (B = one
// block), i.e. up to 2 N_bytes in all, but only (N - 1) messages cross the slow network.
// Two scratch buffers of the whole message (reused, see Scratch).
#include <cstring>
#include <vector>

#include "comm/algorithms.h"
#include "comm/copy.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {

void AllToAllHierarchical(OpContext& ctx, const void* send, void* recv, size_t count,
                          int ranks_per_node) {
  const int w = ctx.size(), r = ctx.rank(), per = ranks_per_node;
  SY_CHECK(per >= 1 && w % per == 0, "ranks_per_node {} does not divide {}", per, w);
  const int nodes = w / per, n = r / per, l = r % per;
  const size_t block = count * ctx.elem_size();
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  std::byte* a = Scratch(0, block * static_cast<size_t>(w));
  std::byte* b = Scratch(1, block * static_cast<size_t>(w));
  auto blk = [&](auto* base, int i) { return base + static_cast<size_t>(i) * block; };
  if (block > 0) {
    for (int j = 0; j < per; ++j) {
      for (int m = 0; m < nodes; ++m) CopyBytes(blk(a, j * nodes + m), blk(in, m * per + j), block);
    }
  }
  // 2. Intra-node exchange with local rank j: a[j] (N blocks) out, b[j] in.
  const size_t row = block * static_cast<size_t>(nodes);
  if (row > 0) CopyBytes(blk(b, l * nodes), blk(a, l * nodes), row);
  std::vector<RequestPtr> requests;
  for (int j = 0; j < per; ++j) {
    if (j != l) requests.push_back(ctx.Recv(n * per + j, blk(b, j * nodes), row, /*phase=*/0));
  }
  for (int s = 1; s < per; ++s) {
    int to = (l + s) % per;
    requests.push_back(ctx.Send(n * per + to, blk(a, to * nodes), row, /*phase=*/0));
  }
  ctx.WaitAll(requests);
  requests.clear();
  // 3. c[m][j] = b[j][m], into a.
  if (block > 0) {
    for (int j = 0; j < per; ++j) {
      for (int m = 0; m < nodes; ++m) CopyBytes(blk(a, m * per + j), blk(b, j * nodes + m), block);
    }
  }
  // 4. Inter-node exchange with (m, l): c[m] (L blocks) out, recv[m L ..) in.
  const size_t col = block * static_cast<size_t>(per);
  if (col > 0) CopyBytes(blk(out, n * per), blk(a, n * per), col);
  for (int m = 0; m < nodes; ++m) {
    if (m != n) requests.push_back(ctx.Recv(m * per + l, blk(out, m * per), col, /*phase=*/1));
  }
  for (int s = 1; s < nodes; ++s) {
    int to = (n + s) % nodes;
    requests.push_back(ctx.Send(to * per + l, blk(a, to * per), col, /*phase=*/1));
  }
  ctx.WaitAll(requests);
}

}  // namespace switchyard::comm
