#include "switchyard/parallel/process_groups.h"

#include <fmt/format.h>

#include "switchyard/core/error.h"

namespace switchyard::parallel {

namespace {

constexpr GroupKind kAllKinds[] = {GroupKind::kTensor,         GroupKind::kData,
                                   GroupKind::kTokens,         GroupKind::kExpert,
                                   GroupKind::kExpertParallel, GroupKind::kExpertTensor,
                                   GroupKind::kExpertData,     GroupKind::kExpertHolders};

}  // namespace

ProcessGroups::ProcessGroups(comm::Communicator& world, const Mesh& mesh)
    : world_(world), mesh_(mesh) {
  SY_REQUIRE(world.size() == mesh.world_size(), InvalidArgument,
             "the communicator has {} ranks, the mesh expects {}", world.size(), mesh.world_size());
  coords_ = mesh_.Coords(world.rank());
  for (GroupKind kind : kAllKinds) {
    std::vector<std::vector<int>> all = mesh_.Groups(kind);
    int color = -1, key = -1;
    for (size_t g = 0; g < all.size(); ++g) {
      for (size_t m = 0; m < all[g].size(); ++m) {
        if (all[g][m] == world.rank()) {
          color = static_cast<int>(g);
          key = static_cast<int>(m);
        }
      }
    }
    SY_CHECK(color >= 0, "rank {} is in no {} group", world.rank(), GroupKindName(kind));
    groups_[kind] =
        world.Split(color, key, fmt::format("{}.{}{}", world.name(), GroupKindName(kind), color));
    SY_CHECK(groups_[kind] != nullptr && groups_[kind]->rank() == key);
  }
}

comm::Communicator& ProcessGroups::Get(GroupKind kind) const {
  auto it = groups_.find(kind);
  SY_CHECK(it != groups_.end());
  return *it->second;
}

comm::Communicator& ProcessGroups::ExpertTensorSubgroup(int g) {
  comm::Communicator& etp = Get(GroupKind::kExpertTensor);
  SY_REQUIRE(g >= 1 && etp.size() % g == 0, InvalidArgument,
             "subgroup size {} does not divide the {} H-shards of an expert", g, etp.size());
  if (g == etp.size()) return etp;
  auto it = subgroups_.find(g);
  if (it == subgroups_.end()) {
    const int color = etp.rank() / g;
    auto sub = etp.Split(color, etp.rank() % g, fmt::format("{}.g{}.{}", etp.name(), g, color));
    it = subgroups_.emplace(g, std::move(sub)).first;
  }
  return *it->second;
}

}  // namespace switchyard::parallel
