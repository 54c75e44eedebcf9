// The communicators of one rank for a Mesh: one per group kind, split from the world.
//
// Built once per run and shared by every layer and the optimizer. Groups are cheap: kinds whose
// groups have identical member lists (in the same order) share one communicator, a kind whose one
// group is the whole world in rank order uses the world itself, and a communicator of one rank
// runs its collectives on the calling thread (no progress thread). A communicator starts its
// progress thread on its first collective, so a kind that is never used costs no thread.
// Kinds that share a communicator share its queue: their collectives run in the order they were
// issued, which every rank must keep the same (as for one kind).
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
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/parallel/mesh.h"

namespace switchyard::parallel {

class ProcessGroups {
 public:
  // world.size() must equal mesh.world_size() (InvalidArgument). `world` must outlive this.
  ProcessGroups(comm::Communicator& world, const Mesh& mesh);
  ~ProcessGroups();

  const Mesh& mesh() const { return mesh_; }
  const RankCoords& coords() const { return coords_; }
  comm::Communicator& world() const { return world_; }
  // This rank's group of `kind`. Throws InvalidArgument if it is in none (kEmbedding on a middle
  // pipeline stage; see Has).
  comm::Communicator& Get(GroupKind kind) const;
  // False only for kEmbedding on a middle pipeline stage.
  bool Has(GroupKind kind) const;
  // Communicators this rank split for the kinds (shared ones and the world counted once, the
  // world not at all).
  int communicator_count() const { return static_cast<int>(owned_.size()); }

  // The group of g consecutive members of this rank's kExpertTensor group that contains it
  // (g divides shards()). Collective over the kExpertTensor group on first use.
  comm::Communicator& ExpertTensorSubgroup(int g);

 private:
  comm::Communicator& world_;
  Mesh mesh_;
  RankCoords coords_;
  std::vector<std::unique_ptr<comm::Communicator>> owned_;
  std::map<GroupKind, comm::Communicator*> groups_;  // null: in no group of that kind
  std::map<int, std::unique_ptr<comm::Communicator>> subgroups_;
};

}  // namespace switchyard::parallel
