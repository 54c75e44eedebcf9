// Names of the comm layer's enums, for options, error messages and the CLI.
#include <array>
#include <string>
#include <utility>

#include "switchyard/comm/types.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

template <typename Enum, size_t N>
std::string_view NameOf(const std::array<std::pair<Enum, std::string_view>, N>& table, Enum value) {
  for (const auto& [e, name] : table) {
    if (e == value) return name;
  }
  return "unknown";
}

template <typename Enum, size_t N>
Enum FromName(const std::array<std::pair<Enum, std::string_view>, N>& table, std::string_view name,
              std::string_view what) {
  std::string accepted;
  for (const auto& [e, n] : table) {
    if (n == name) return e;
    accepted += accepted.empty() ? "" : ", ";
    accepted += n;
  }
  throw InvalidArgument(fmt::format("unknown {} '{}' (expected one of: {})", what, name, accepted));
}

constexpr std::array<std::pair<ReduceOp, std::string_view>, 3> kReduceOps = {{
    {ReduceOp::kSum, "sum"},
    {ReduceOp::kMax, "max"},
    {ReduceOp::kMin, "min"},
}};

constexpr std::array<std::pair<CollectiveKind, std::string_view>, 12> kCollectives = {{
    {CollectiveKind::kBarrier, "barrier"},
    {CollectiveKind::kBroadcast, "broadcast"},
    {CollectiveKind::kReduce, "reduce"},
    {CollectiveKind::kAllReduce, "allreduce"},
    {CollectiveKind::kAllGather, "allgather"},
    {CollectiveKind::kReduceScatter, "reduce_scatter"},
    {CollectiveKind::kAllToAll, "alltoall"},
    {CollectiveKind::kAllToAllV, "alltoallv"},
    {CollectiveKind::kAllToAllVDynamic, "alltoallv_dynamic"},
    {CollectiveKind::kScatter, "scatter"},
    {CollectiveKind::kGather, "gather"},
    {CollectiveKind::kSplit, "split"},
}};

constexpr std::array<std::pair<Algorithm, std::string_view>, 10> kAlgorithms = {{
    {Algorithm::kAuto, "auto"},
    {Algorithm::kRing, "ring"},
    {Algorithm::kTree, "tree"},
    {Algorithm::kScatterAllGather, "scatter_allgather"},
    {Algorithm::kReduceScatterGather, "reduce_scatter_gather"},
    {Algorithm::kPairwise, "pairwise"},
    {Algorithm::kLinear, "linear"},
    {Algorithm::kHierarchical, "hierarchical"},
    {Algorithm::kDissemination, "dissemination"},
    {Algorithm::kNative, "native"},
}};

}  // namespace

std::string_view ReduceOpName(ReduceOp op) { return NameOf(kReduceOps, op); }
ReduceOp ReduceOpFromName(std::string_view name) { return FromName(kReduceOps, name, "reduce op"); }
std::string_view CollectiveName(CollectiveKind kind) { return NameOf(kCollectives, kind); }
CollectiveKind CollectiveFromName(std::string_view name) {
  return FromName(kCollectives, name, "collective");
}
std::string_view AlgorithmName(Algorithm algorithm) { return NameOf(kAlgorithms, algorithm); }
Algorithm AlgorithmFromName(std::string_view name) {
  return FromName(kAlgorithms, name, "algorithm");
}

}  // namespace switchyard::comm
