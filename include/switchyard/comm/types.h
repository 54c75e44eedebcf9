// Vocabulary of the comm layer: deadlines, reduction operators, collective and algorithm names,
// and the node layout of a group.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

namespace switchyard::comm {

using Clock = std::chrono::steady_clock;
// Every blocking wait of the comm layer takes a deadline; passing it is an error, never a hang.
using Deadline = Clock::time_point;
using Milliseconds = std::chrono::milliseconds;

enum class ReduceOp : uint8_t { kSum, kMax, kMin };
// "sum", "max", "min".
std::string_view ReduceOpName(ReduceOp op);
// Inverse of ReduceOpName; throws InvalidArgument naming the accepted names.
ReduceOp ReduceOpFromName(std::string_view name);

// The collectives of the Communicator. Also carried in message headers, so that a peer calling a
// different collective is reported by name.
enum class CollectiveKind : uint8_t {
  kBarrier,
  kBroadcast,
  kReduce,
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kAllToAllV,
  kAllToAllVDynamic,  // FastMoE's two-phase form: exchange counts, then data
  kScatter,
  kGather,
  kSplit,
};
// "barrier", "broadcast", "reduce", "allreduce", "allgather", "reduce_scatter", "alltoall",
// "alltoallv", "alltoallv_dynamic", "scatter", "gather", "split".
std::string_view CollectiveName(CollectiveKind kind);
// Inverse of CollectiveName; throws InvalidArgument naming the accepted names.
CollectiveKind CollectiveFromName(std::string_view name);

// Algorithms, each a file src/comm/<collective>_<algorithm>.cc (see docs/algorithms.md for which
// collective accepts which, their step counts and bytes on the wire). kAuto lets the one selection
// function (src/comm/algorithm_select.cc) choose by message size, group size and transport.
enum class Algorithm : uint8_t {
  kAuto,
  kRing,                 // allgather, reduce_scatter, allreduce
  kTree,                 // binomial tree: broadcast, reduce, allreduce (reduce + broadcast)
  kScatterAllGather,     // broadcast for large messages
  kReduceScatterGather,  // reduce for large messages
  kPairwise,             // alltoall, alltoallv(_dynamic): step s exchanges with rank +-s
  kLinear,               // alltoall(v), scatter, gather: every message posted at once
  kHierarchical,         // alltoall: 2DH, intra-node then inter-node (Tutel)
  kDissemination,        // barrier
  kNative,               // the transport's own collective (MPI_I*), where it has one
};
// "auto", "ring", "tree", "scatter_allgather", "reduce_scatter_gather", "pairwise", "linear",
// "hierarchical", "dissemination", "native".
std::string_view AlgorithmName(Algorithm algorithm);
// Inverse of AlgorithmName; throws InvalidArgument naming the accepted names.
Algorithm AlgorithmFromName(std::string_view name);

// How the ranks of a group sit on machines: rank r is local rank r % ranks_per_node of node
// r / ranks_per_node. nodes * ranks_per_node == group size. A group whose layout is not of this
// form is described as one node.
struct Topology {
  int nodes = 1;
  int ranks_per_node = 1;
};

}  // namespace switchyard::comm
