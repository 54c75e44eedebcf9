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
#include "switchyard/comm/algorithm_select.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"

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
// Hierarchical (2DH) all-to-all, intra-node then inter-node (docs/algorithms.md): count elements
// per peer, ranks_per_node L dividing W.
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

// ---- The launch table ----

// One collective call as the launch table passes it to an algorithm. Which fields a collective
// uses follows its Communicator method (switchyard/comm/communicator.h); counts are elements.
struct CollectiveArgs {
  const void* send = nullptr;
  void* recv = nullptr;  // broadcast: the buffer
  size_t count = 0;      // per rank or per block, as the collective defines; 0 for the -v forms
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  int root = 0;
  int ranks_per_node = 0;   // alltoall (hierarchical): 0 = the group's topology
  AllToAllLayout layout{};  // alltoall, alltoallv: bytes to and from each peer
  // alltoallv_dynamic: rows sent to each peer, elements per row, the shape of one row, and where
  // the received rows and counts go.
  std::vector<int64_t> send_rows{};
  int64_t row_elems = 1;
  Shape row_shape{};
  AllToAllVResult* result = nullptr;
};

// Runs one algorithm of one collective on this rank. Reductions compute in ctx.work_dtype()
// (float32 for bfloat16 input, see AccumulateInFloat32 in group_communicator.cc).
using AlgorithmFn = void (*)(OpContext& ctx, const CollectiveArgs& args);
// Runs at the call, on the caller's thread, after selection: checks the algorithm's own
// preconditions (InvalidArgument) and may complete `args`.
using AlgorithmPrepare = void (*)(CollectiveArgs& args, int group_size, const Topology& topology);

// One row of the launch table: the function that runs `algorithm` for `kind`.
struct AlgorithmEntry {
  CollectiveKind kind;
  Algorithm algorithm;
  AlgorithmFn run;
  AlgorithmPrepare prepare = nullptr;
};

// The row of (kind, algorithm); InternalError if the table has none (SelectAlgorithm only
// returns algorithms the table offers).
const AlgorithmEntry& FindAlgorithm(CollectiveKind kind, Algorithm algorithm);

// Collectives with a root (broadcast, reduce, scatter, gather) and with a reduce op (reduce,
// allreduce, reduce_scatter).
bool HasRoot(CollectiveKind kind);
bool IsReduction(CollectiveKind kind);

// alltoallv_dynamic on the rows of `args` (two-phase with `data_algorithm` kPairwise or kLinear,
// or the transport's own all-to-all and all-to-all-v): allocates args.result->output as
// [received rows, row_shape...] of ctx.info().dtype and fills its counts and displacements.
void AllToAllVDynamicTwoPhase(OpContext& ctx, const CollectiveArgs& args, Algorithm data_algorithm);
void AllToAllVDynamicNative(OpContext& ctx, const CollectiveArgs& args);

// SelectAlgorithm, the one place where algorithms are chosen: switchyard/comm/algorithm_select.h.

}  // namespace switchyard::comm
