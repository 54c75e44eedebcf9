// The layout-independent form of a distributed run's checkpoint (distributed.h): full tensors by
// PyTorch-style name, experts [E, ...] by global expert id, tensor-parallel shards gathered, every
// pipeline stage's part. A CheckpointLayout turns one rank's tensors into that form (Gather,
// collective) and takes this rank's part back out of it (Slice), for the values of the model and
// for the optimizer's state ("<name>.exp_avg", ...: the names with a suffix).
//
// Thread-safety: one per rank; Gather is collective over the rank's stage (experts), its tp group
// and its pipeline group, in the same order on every rank.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/config.h"
#include "switchyard/parallel/process_groups.h"
#include "switchyard/train/parameters.h"

namespace switchyard::train {

class CheckpointLayout {
 public:
  // `groups`: the run's process groups. `stage`: every rank of this rank's pipeline stage (world
  // ranks in order; null: the world, one stage). Both must outlive the layout.
  CheckpointLayout(std::shared_ptr<parallel::ProcessGroups> groups, comm::Communicator* stage);

  // An MoE block of this rank's model (its parameter prefix and layer config): its experts are
  // gathered and sliced by global expert id.
  void AddMoeBlock(const std::string& prefix, const moe::LayerConfig& config);
  void set_stage(comm::Communicator* stage) { stage_ = stage; }
  int world_rank() const { return world_.rank(); }

  // The full tensors of this rank's entries "<name><suffix>" of `map` for each suffix ("" for
  // the values; ".exp_avg", ".exp_avg_sq" for the optimizer state): the MoE blocks' experts over
  // the stage, the tensor-parallel shards of `params` over tp, then every stage's part (pp > 1:
  // broadcast over the pipeline group, stage by stage), on every rank. Collective.
  void Gather(ParameterSet& params, TensorMap& map, const std::vector<std::string>& suffixes);
  // This rank's part of the full tensors in `map` (the inverse of Gather; other stages' entries
  // are left in the map).
  void Slice(ParameterSet& params, TensorMap& map, const std::vector<std::string>& suffixes) const;

  // A box of a full tensor: [begin[d], end[d]) in each dimension d.
  struct Box {
    std::vector<int64_t> begin, end;
  };
  struct Part {
    Shape full_shape;        // the full tensor's
    std::vector<Box> boxes;  // their contents, each row-major, one after another: the rank's value
  };
  // Which part of its full tensor this rank's parameter `p` holds (the same as Slice takes):
  // rows of its experts with their H-shard, its tensor-parallel shard (one box per fused part),
  // or the whole tensor. Lets a reader read only that part (hf_names.h: LoadRankWeights).
  // nullopt where the part is not a set of boxes (an expert bias chunk padded past model_dim):
  // Slice the full tensor then.
  std::optional<Part> PartOf(const Parameter& p) const;

 private:
  struct MoeBlock {
    std::string prefix;
    moe::LayerConfig config;
  };
  // Full expert tensors out of every rank's shards (collective), or this rank's shard out of
  // full tensors, for the names "<prefix>experts.<t><suffix>" of every MoE block in `map`.
  void GatherExperts(TensorMap& map, const std::string& suffix);
  void SliceExperts(TensorMap& map, const std::string& suffix) const;
  // The single-rank tensors of the tensor-parallel shards in `map` (all-gather over tp,
  // collective), or this rank's shards of them.
  void GatherTensorParallel(ParameterSet& params, TensorMap& map, const std::string& suffix);
  void SliceTensorParallel(ParameterSet& params, TensorMap& map, const std::string& suffix) const;
  void GatherStages(TensorMap& map);

  std::shared_ptr<parallel::ProcessGroups> groups_;
  comm::Communicator& world_;
  const parallel::Mesh& mesh_;
  comm::Communicator* stage_;
  std::vector<MoeBlock> moe_blocks_;
};

}  // namespace switchyard::train
