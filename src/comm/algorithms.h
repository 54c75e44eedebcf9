// The collective algorithms, one file each (gloo style), all written over OpContext's
// point-to-point sends and receives. Every function runs on one rank inside one collective;
// arguments are as in switchyard/comm/communicator.h (counts in elements of ctx.info().dtype).
// docs/algorithms.md lists their step counts and bytes on the wire.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "comm/op_context.h"

namespace switchyard::comm {

// Chunk c of n elements split into `parts` balanced chunks: [ChunkBegin(c), ChunkBegin(c + 1)).
inline size_t ChunkBegin(size_t n, int parts, int c) {
  size_t base = n / static_cast<size_t>(parts), extra = n % static_cast<size_t>(parts);
  size_t uc = static_cast<size_t>(c);
  return uc * base + std::min(uc, extra);
}

// Scratch memory for an algorithm: `slot` (0 or 1; 2 and 3 hold the float32 copies of a
// bfloat16 reduction around the algorithm) of the calling thread, at least `bytes` long, contents
// undefined. Grow-only and reused across collectives, so large collectives do not pay for page
// faults and zero-filling on every call (threads keep their largest scratch).
constexpr int kScratchSlots = 4;
std::byte* Scratch(int slot, size_t bytes);

// Byte layout of an all-to-all(-v): what goes to / comes from each peer.
struct AllToAllLayout {
  std::vector<size_t> send_bytes, send_offsets;  // [W]
  std::vector<size_t> recv_bytes, recv_offsets;  // [W]
};

void BarrierDissemination(OpContext& ctx);

void BroadcastTree(OpContext& ctx, void* buffer, size_t count, int root);
void BroadcastScatterAllGather(OpContext& ctx, void* buffer, size_t count, int root);

void ReduceTree(OpContext& ctx, const void* send, void* recv, size_t count, int root);
void ReduceScatterGather(OpContext& ctx, const void* send, void* recv, size_t count, int root);

void AllReduceRing(OpContext& ctx, const void* send, void* recv, size_t count);
void AllReduceTree(OpContext& ctx, const void* send, void* recv, size_t count);

void AllGatherRing(OpContext& ctx, const void* send, void* recv, size_t count);
void AllGatherLinear(OpContext& ctx, const void* send, void* recv, size_t count);
void ReduceScatterRing(OpContext& ctx, const void* send, void* recv, size_t count);

// All-to-all(-v) on bytes; messages use `phase`.
void AllToAllPairwise(OpContext& ctx, const void* send, void* recv, const AllToAllLayout& layout,
                      uint32_t phase = 0);
void AllToAllLinear(OpContext& ctx, const void* send, void* recv, const AllToAllLayout& layout,
                    uint32_t phase = 0);
// 2DH (SPEC §2.4): count elements per peer, ranks_per_node L dividing W.
void AllToAllHierarchical(OpContext& ctx, const void* send, void* recv, size_t count,
                          int ranks_per_node);

// FastMoE two-phase all-to-all-v: an all-to-all of the int64 row counts (phase 0), then the rows
// (phase 1) with `data_algorithm` (kPairwise or kLinear). Returns the rows received from each
// peer; `allocate(total_rows)` returns where to put them.
std::vector<int64_t> AllToAllVTwoPhase(OpContext& ctx, const void* send,
                                       const std::vector<int64_t>& send_rows, size_t row_bytes,
                                       Algorithm data_algorithm,
                                       const std::function<void*(int64_t)>& allocate);

void ScatterLinear(OpContext& ctx, const void* send, void* recv, size_t count, int root);
void GatherLinear(OpContext& ctx, const void* send, void* recv, size_t count, int root);

// The one place where algorithms are chosen. Checks that `requested` is one the collective
// offers (InvalidArgument listing them otherwise) and resolves kAuto from the message size in
// bytes (equal on every rank), the group size, the topology and the transport ("inprocess",
// "mpi"). has_native: the transport has MPI's own collectives.
Algorithm SelectAlgorithm(CollectiveKind kind, Algorithm requested, size_t bytes, int group_size,
                          const Topology& topology, bool has_native,
                          std::string_view transport_kind);

}  // namespace switchyard::comm
