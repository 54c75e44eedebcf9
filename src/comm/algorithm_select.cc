// Algorithm choice and the launch table, here and nowhere else (as NCCL's tuning tables). The
// thresholds come from `switchyard bench comm` on the in-process and MPI transports
// (docs/algorithms.md).
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "comm/algorithms.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

using A = Algorithm;
using K = CollectiveKind;

NativeCollectives& Native(OpContext& ctx) { return *ctx.transport().native(); }

void PrepareHierarchical(CollectiveArgs& args, int group_size, const Topology& topology) {
  const int per = args.ranks_per_node > 0 ? args.ranks_per_node : topology.ranks_per_node;
  SY_REQUIRE(per >= 1 && group_size % per == 0, InvalidArgument,
             "alltoall (hierarchical): ranks_per_node {} must divide the group size {}", per,
             group_size);
  args.ranks_per_node = per;
}

// Elements to and from each peer (for MPI's all-to-all-v) from the byte layout.
std::vector<int64_t> Elements(const std::vector<size_t>& bytes, size_t elem) {
  std::vector<int64_t> out;
  out.reserve(bytes.size());
  for (size_t b : bytes) out.push_back(static_cast<int64_t>(b / elem));
  return out;
}

// The launch table: every algorithm of every collective, one row each, in the order
// SelectAlgorithm lists them when it refuses a name. Adding an algorithm is adding its row (and,
// if `auto` should ever pick it, its rule in SelectAlgorithm). Each function is in its own file
// (docs/algorithms.md); kNative rows hand the call to the transport's own collectives.
const AlgorithmEntry kTable[] = {
    {K::kBarrier, A::kDissemination,
     [](OpContext& c, const CollectiveArgs&) { BarrierDissemination(c); }},
    {K::kBarrier, A::kNative,
     [](OpContext& c, const CollectiveArgs&) { Native(c).Barrier(c.deadline()); }},

    {K::kBroadcast, A::kTree,
     [](OpContext& c, const CollectiveArgs& a) { BroadcastTree(c, a.recv, a.count, a.root); }},
    {K::kBroadcast, A::kScatterAllGather,
     [](OpContext& c, const CollectiveArgs& a) {
       BroadcastScatterAllGather(c, a.recv, a.count, a.root);
     }},
    {K::kBroadcast, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).Broadcast(a.recv, a.count, c.work_dtype(), a.root, c.deadline());
     }},

    {K::kReduce, A::kTree,
     [](OpContext& c, const CollectiveArgs& a) { ReduceTree(c, a.send, a.recv, a.count, a.root); }},
    {K::kReduce, A::kReduceScatterGather,
     [](OpContext& c, const CollectiveArgs& a) {
       ReduceScatterGather(c, a.send, a.recv, a.count, a.root);
     }},
    {K::kReduce, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).Reduce(a.send, a.recv, a.count, c.work_dtype(), a.reduce_op, a.root, c.deadline());
     }},

    {K::kAllReduce, A::kRing,
     [](OpContext& c, const CollectiveArgs& a) { AllReduceRing(c, a.send, a.recv, a.count); }},
    {K::kAllReduce, A::kTree,
     [](OpContext& c, const CollectiveArgs& a) { AllReduceTree(c, a.send, a.recv, a.count); }},
    {K::kAllReduce, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).AllReduce(a.send, a.recv, a.count, c.work_dtype(), a.reduce_op, c.deadline());
     }},

    {K::kAllGather, A::kRing,
     [](OpContext& c, const CollectiveArgs& a) { AllGatherRing(c, a.send, a.recv, a.count); }},
    {K::kAllGather, A::kLinear,
     [](OpContext& c, const CollectiveArgs& a) { AllGatherLinear(c, a.send, a.recv, a.count); }},
    {K::kAllGather, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).AllGather(a.send, a.recv, a.count, c.work_dtype(), c.deadline());
     }},

    {K::kReduceScatter, A::kRing,
     [](OpContext& c, const CollectiveArgs& a) { ReduceScatterRing(c, a.send, a.recv, a.count); }},
    {K::kReduceScatter, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).ReduceScatter(a.send, a.recv, a.count, c.work_dtype(), a.reduce_op, c.deadline());
     }},

    {K::kAllToAll, A::kPairwise,
     [](OpContext& c, const CollectiveArgs& a) { AllToAllPairwise(c, a.send, a.recv, a.layout); }},
    {K::kAllToAll, A::kLinear,
     [](OpContext& c, const CollectiveArgs& a) { AllToAllLinear(c, a.send, a.recv, a.layout); }},
    {K::kAllToAll, A::kHierarchical,
     [](OpContext& c, const CollectiveArgs& a) {
       AllToAllHierarchical(c, a.send, a.recv, a.count, a.ranks_per_node);
     },
     PrepareHierarchical},
    {K::kAllToAll, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).AllToAll(a.send, a.recv, a.count, c.work_dtype(), c.deadline());
     }},

    {K::kAllToAllV, A::kPairwise,
     [](OpContext& c, const CollectiveArgs& a) { AllToAllPairwise(c, a.send, a.recv, a.layout); }},
    {K::kAllToAllV, A::kLinear,
     [](OpContext& c, const CollectiveArgs& a) { AllToAllLinear(c, a.send, a.recv, a.layout); }},
    {K::kAllToAllV, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       const AllToAllLayout& l = a.layout;
       const size_t e = c.elem_size();
       Native(c).AllToAllV(a.send, Elements(l.send_bytes, e), Elements(l.send_offsets, e), a.recv,
                           Elements(l.recv_bytes, e), Elements(l.recv_offsets, e), c.work_dtype(),
                           c.deadline());
     }},

    {K::kAllToAllVDynamic, A::kPairwise,
     [](OpContext& c, const CollectiveArgs& a) { AllToAllVDynamicTwoPhase(c, a, A::kPairwise); }},
    {K::kAllToAllVDynamic, A::kLinear,
     [](OpContext& c, const CollectiveArgs& a) { AllToAllVDynamicTwoPhase(c, a, A::kLinear); }},
    {K::kAllToAllVDynamic, A::kNative, AllToAllVDynamicNative},

    {K::kScatter, A::kLinear,
     [](OpContext& c, const CollectiveArgs& a) {
       ScatterLinear(c, a.send, a.recv, a.count, a.root);
     }},
    {K::kScatter, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).Scatter(a.send, a.recv, a.count, c.work_dtype(), a.root, c.deadline());
     }},

    {K::kGather, A::kLinear,
     [](OpContext& c, const CollectiveArgs& a) {
       GatherLinear(c, a.send, a.recv, a.count, a.root);
     }},
    {K::kGather, A::kNative,
     [](OpContext& c, const CollectiveArgs& a) {
       Native(c).Gather(a.send, a.recv, a.count, c.work_dtype(), a.root, c.deadline());
     }},
};

// The algorithms of `kind`: its rows of the table, in table order.
std::vector<Algorithm> Offered(CollectiveKind kind) {
  std::vector<Algorithm> offered;
  for (const AlgorithmEntry& e : kTable) {
    if (e.kind == kind) offered.push_back(e.algorithm);
  }
  return offered;
}

constexpr size_t kKiB = 1024;

}  // namespace

const AlgorithmEntry& FindAlgorithm(CollectiveKind kind, Algorithm algorithm) {
  for (const AlgorithmEntry& e : kTable) {
    if (e.kind == kind && e.algorithm == algorithm) return e;
  }
  throw InternalError(fmt::format("the launch table has no row for {} ({})", CollectiveName(kind),
                                  AlgorithmName(algorithm)));
}

bool HasRoot(CollectiveKind kind) {
  return kind == K::kBroadcast || kind == K::kReduce || kind == K::kScatter || kind == K::kGather;
}

bool IsReduction(CollectiveKind kind) {
  return kind == K::kReduce || kind == K::kAllReduce || kind == K::kReduceScatter;
}

Algorithm SelectAlgorithm(CollectiveKind kind, Algorithm requested, size_t bytes, int group_size,
                          const Topology& topology, bool has_native,
                          std::string_view transport_kind) {
  std::vector<Algorithm> offered = Offered(kind);
  if (requested != A::kAuto) {
    if (std::find(offered.begin(), offered.end(), requested) == offered.end()) {
      std::string names;
      for (Algorithm a : offered)
        names += std::string(names.empty() ? "" : ", ") += AlgorithmName(a);
      throw InvalidArgument(fmt::format("{} has no algorithm '{}' (offered: auto, {})",
                                        CollectiveName(kind), AlgorithmName(requested), names));
    }
    SY_REQUIRE(requested != A::kNative || has_native, InvalidArgument,
               "{}: algorithm 'native' delegates to the transport's own collectives, and this "
               "communicator's transport ('{}') has none; use a communicator on the MPI transport "
               "(CreateMpiWorld) or another algorithm",
               CollectiveName(kind), transport_kind);
    return requested;
  }
  const int w = group_size;
  switch (kind) {
    case CollectiveKind::kBarrier: return A::kDissemination;
    case CollectiveKind::kBroadcast:
      // Tree: log2 W steps of the whole message; scatter+allgather moves ~2x the message once.
      return (w <= 2 || bytes < 256 * kKiB) ? A::kTree : A::kScatterAllGather;
    case CollectiveKind::kReduce:
      return (w <= 2 || bytes < 256 * kKiB) ? A::kTree : A::kReduceScatterGather;
    case CollectiveKind::kAllReduce:
      // Tree: 2 log2 W latency steps; ring: bandwidth-optimal, 2(W-1) steps.
      return bytes < 32 * kKiB ? A::kTree : A::kRing;
    case CollectiveKind::kAllGather:
      // Same bytes per rank; linear has one step instead of W - 1 dependent ones, which wins
      // where ranks share cores (bench comm, np 4: ring 0.8x MPI's own).
      return A::kLinear;
    case CollectiveKind::kReduceScatter: return A::kRing;
    case CollectiveKind::kAllToAll: {
      size_t per_peer = bytes / static_cast<size_t>(std::max(w, 1));
      // 2DH sends (L - 1) + (M - 1) messages instead of W - 1 but copies the buffer twice more:
      // it wins where per-message latency dominates (emulated 2 x 4 ranks, 200 us inter-node:
      // 1.8x faster than flat at 1 KiB blocks; 4 x 4, 50 us: 1.6x at 1 KiB, loses at 16 KiB).
      if (topology.nodes > 1 && topology.ranks_per_node > 1 && per_peer <= 8 * kKiB) {
        return A::kHierarchical;
      }
      // Linear keeps every message in flight; pairwise bounds the messages in flight to two per
      // rank, which pays off only for large blocks. Under MPI with more ranks than cores a
      // descheduled process stalls each pairwise step, so linear wins there up to large blocks
      // (bench comm: np 4, 4 MiB buffers: linear 0.94x MPI's own, pairwise 0.39x).
      size_t linear_limit = transport_kind == "mpi" ? 8 * kKiB * kKiB : 256 * kKiB;
      return per_peer <= linear_limit ? A::kLinear : A::kPairwise;
    }
    case CollectiveKind::kAllToAllV:
    case CollectiveKind::kAllToAllVDynamic:
      // Sizes differ between ranks, so the choice may not depend on them.
      return A::kPairwise;
    case CollectiveKind::kScatter:
    case CollectiveKind::kGather: return A::kLinear;
    case CollectiveKind::kSplit: return A::kAuto;
  }
  return A::kAuto;
}

}  // namespace switchyard::comm
