#include "switchyard/parallel/process_groups.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "switchyard/core/error.h"

namespace switchyard::parallel {

ProcessGroups::ProcessGroups(comm::Communicator& world, const Mesh& mesh)
    : world_(world), mesh_(mesh) {
  SY_REQUIRE(world.size() == mesh.world_size(), InvalidArgument,
             "the communicator has {} ranks, the mesh expects {}", world.size(), mesh.world_size());
  coords_ = mesh_.Coords(world.rank());
  std::vector<int> everyone(static_cast<size_t>(world.size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  // Every rank computes the same partitions, so every rank makes the same splits in the same
  // order (Split is collective over the world).
  std::vector<std::pair<std::vector<std::vector<int>>, comm::Communicator*>> made;
  for (GroupKind kind : kAllGroupKinds) {
    std::vector<std::vector<int>> all = mesh_.Groups(kind);
    if (all.size() == 1 && all[0] == everyone) {
      groups_[kind] = &world;
      continue;
    }
    auto same =
        std::find_if(made.begin(), made.end(), [&](const auto& m) { return m.first == all; });
    if (same != made.end()) {
      groups_[kind] = same->second;
      continue;
    }
    int color = comm::Communicator::kNoColor, key = 0;
    for (size_t g = 0; g < all.size(); ++g) {
      for (size_t m = 0; m < all[g].size(); ++m) {
        if (all[g][m] == world.rank()) {
          color = static_cast<int>(g);
          key = static_cast<int>(m);
        }
      }
    }
    SY_CHECK(color >= 0 || kind == GroupKind::kEmbedding, "rank {} is in no {} group", world.rank(),
             GroupKindName(kind));
    std::unique_ptr<comm::Communicator> comm =
        world.Split(color, key, fmt::format("{}.{}{}", world.name(), GroupKindName(kind), color));
    comm::Communicator* ptr = comm.get();
    SY_CHECK(color < 0 || (ptr != nullptr && ptr->rank() == key));
    if (comm) owned_.push_back(std::move(comm));
    groups_[kind] = ptr;
    made.emplace_back(std::move(all), ptr);
  }
}

ProcessGroups::~ProcessGroups() = default;

bool ProcessGroups::Has(GroupKind kind) const {
  auto it = groups_.find(kind);
  return it != groups_.end() && it->second != nullptr;
}

comm::Communicator& ProcessGroups::Get(GroupKind kind) const {
  auto it = groups_.find(kind);
  SY_CHECK(it != groups_.end());
  SY_REQUIRE(it->second != nullptr, InvalidArgument,
             "rank {} (pipeline stage {} of {}) is in no {} group: only the first and last stage "
             "are",
             coords_.rank, coords_.pp_rank, mesh_.pp(), GroupKindName(kind));
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
