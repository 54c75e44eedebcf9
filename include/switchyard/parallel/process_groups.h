// The communicators of one rank for a Mesh: one per group kind, split from the world.
//
// Construction is a collective over the world (every rank constructs its ProcessGroups with the
// same mesh, in the same order with respect to its other collectives). Subgroups of the expert
// tensor-parallel group used by Tutel's adaptive r (groups of g consecutive shards) are split on
// first use, which is collective over that group: every member asks for the same g in the same
// order, as the parallel layer does.
//
// Thread-safety: as comm::Communicator; ExpertTensorSubgroup must not race with itself.
#pragma once

#include <map>
#include <memory>

#include "switchyard/comm/communicator.h"
#include "switchyard/parallel/mesh.h"

namespace switchyard::parallel {

class ProcessGroups {
 public:
  // world.size() must equal mesh.world_size() (InvalidArgument). `world` must outlive this.
  ProcessGroups(comm::Communicator& world, const Mesh& mesh);

  const Mesh& mesh() const { return mesh_; }
  const RankCoords& coords() const { return coords_; }
  comm::Communicator& world() const { return world_; }
  comm::Communicator& Get(GroupKind kind) const;

  // The group of g consecutive members of this rank's kExpertTensor group that contains it
  // (g divides shards()). Collective over the kExpertTensor group on first use.
  comm::Communicator& ExpertTensorSubgroup(int g);

 private:
  comm::Communicator& world_;
  Mesh mesh_;
  RankCoords coords_;
  std::map<GroupKind, std::unique_ptr<comm::Communicator>> groups_;
  std::map<int, std::unique_ptr<comm::Communicator>> subgroups_;
};

}  // namespace switchyard::parallel
