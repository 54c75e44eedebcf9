// Algorithm choice, made here and nowhere else (as NCCL's tuning tables). The thresholds come
// from `switchyard bench comm` on the in-process and MPI transports (docs/algorithms.md).
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "comm/algorithms.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

std::vector<Algorithm> Offered(CollectiveKind kind) {
  using A = Algorithm;
  switch (kind) {
    case CollectiveKind::kBarrier: return {A::kDissemination, A::kNative};
    case CollectiveKind::kBroadcast: return {A::kTree, A::kScatterAllGather, A::kNative};
    case CollectiveKind::kReduce: return {A::kTree, A::kReduceScatterGather, A::kNative};
    case CollectiveKind::kAllReduce: return {A::kRing, A::kTree, A::kNative};
    case CollectiveKind::kAllGather: return {A::kRing, A::kLinear, A::kNative};
    case CollectiveKind::kReduceScatter: return {A::kRing, A::kNative};
    case CollectiveKind::kAllToAll: return {A::kPairwise, A::kLinear, A::kHierarchical, A::kNative};
    case CollectiveKind::kAllToAllV: return {A::kPairwise, A::kLinear, A::kNative};
    case CollectiveKind::kAllToAllVDynamic: return {A::kPairwise, A::kLinear, A::kNative};
    case CollectiveKind::kScatter: return {A::kLinear, A::kNative};
    case CollectiveKind::kGather: return {A::kLinear, A::kNative};
    case CollectiveKind::kSplit: return {A::kAuto};
  }
  return {};
}

constexpr size_t kKiB = 1024;

}  // namespace

Algorithm SelectAlgorithm(CollectiveKind kind, Algorithm requested, size_t bytes, int group_size,
                          const Topology& topology, bool has_native,
                          std::string_view transport_kind) {
  using A = Algorithm;
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
               "algorithm 'native' delegates to MPI's own collectives: it needs the MPI "
               "transport (run under mpirun with --transport mpi)");
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
