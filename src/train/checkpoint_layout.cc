#include "switchyard/train/checkpoint_layout.h"

#include <fmt/format.h>

#include <utility>

#include "switchyard/core/error.h"
#include "switchyard/moe/layer.h"
#include "switchyard/parallel/expert_shard.h"
#include "switchyard/train/tensor_parallel.h"

namespace switchyard::train {
namespace {

// The expert tensors of an MoE block by their name after "experts." and their ExpertWeights slot.
struct ExpertField {
  const char* name;
  Tensor moe::ExpertWeights::*member;
};
constexpr ExpertField kExpertFields[] = {
    {"fc1.weight", &moe::ExpertWeights::fc1_weight}, {"fc1.bias", &moe::ExpertWeights::fc1_bias},
    {"fc2.weight", &moe::ExpertWeights::fc2_weight}, {"fc2.bias", &moe::ExpertWeights::fc2_bias},
    {"fc3.weight", &moe::ExpertWeights::fc3_weight},
};

Shape FullShape(const moe::LayerConfig& config, const std::string& name) {
  for (const auto& [n, shape] : moe::ParamShapes(config)) {
    if (n == name) return shape;
  }
  SY_CHECK(false, "no parameter '{}' in the MoE layer", name);
  return {};
}

}  // namespace

CheckpointLayout::CheckpointLayout(std::shared_ptr<parallel::ProcessGroups> groups,
                                   comm::Communicator* stage)
    : groups_(std::move(groups)), world_(groups_->world()), mesh_(groups_->mesh()), stage_(stage) {}

void CheckpointLayout::AddMoeBlock(const std::string& prefix, const moe::LayerConfig& config) {
  moe_blocks_.push_back({prefix, config});
}

void CheckpointLayout::Gather(ParameterSet& params, TensorMap& map,
                              const std::vector<std::string>& suffixes) {
  for (const std::string& suffix : suffixes) GatherExperts(map, suffix);
  for (const std::string& suffix : suffixes) GatherTensorParallel(params, map, suffix);
  GatherStages(map);
}

void CheckpointLayout::Slice(ParameterSet& params, TensorMap& map,
                             const std::vector<std::string>& suffixes) const {
  for (const std::string& suffix : suffixes) SliceExperts(map, suffix);
  for (const std::string& suffix : suffixes) SliceTensorParallel(params, map, suffix);
}

void CheckpointLayout::GatherExperts(TensorMap& map, const std::string& suffix) {
  // Over the ranks of this stage (the stages hold different MoE blocks), in world-rank order.
  comm::Communicator& stage = stage_ != nullptr ? *stage_ : world_;
  const int w = stage.size();
  std::vector<int> members;
  for (int r = 0; r < world_.size(); ++r) {
    if (mesh_.Coords(r).pp_rank == groups_->coords().pp_rank) members.push_back(r);
  }
  SY_CHECK(static_cast<int>(members.size()) == w, "stage group of {} ranks, mesh says {}", w,
           members.size());
  for (const MoeBlock& block : moe_blocks_) {
    for (const ExpertField& f : kExpertFields) {
      const std::string key = block.prefix + "experts." + f.name + suffix;
      auto it = map.find(key);
      if (it == map.end()) continue;
      const Tensor local = it->second;
      const int64_t n = local.numel();
      Tensor all = Tensor::Empty({w * n}, DType::kFloat32);
      stage
          .AllGather(local.data<float>(), all.data<float>(), static_cast<size_t>(n),
                     DType::kFloat32)
          .Wait();
      moe::ExpertWeights full;
      full.*f.member = Tensor::Zeros(FullShape(block.config, std::string("experts.") + f.name));
      for (int r = 0; r < w; ++r) {
        moe::ExpertWeights shard;
        shard.*f.member = all.Slice(r * n, (r + 1) * n).Reshape(local.shape());
        // Blocks may hold different numbers of experts (experts_per_block) over the run's mesh.
        parallel::PlaceShard(
            shard, parallel::ShardOf(mesh_, members[static_cast<size_t>(r)], block.config), &full);
      }
      it->second = full.*f.member;
    }
  }
}

void CheckpointLayout::SliceExperts(TensorMap& map, const std::string& suffix) const {
  for (const MoeBlock& block : moe_blocks_) {
    const parallel::ShardSpec spec = parallel::ShardOf(mesh_, world_.rank(), block.config);
    for (const ExpertField& f : kExpertFields) {
      const std::string key = block.prefix + "experts." + f.name + suffix;
      auto it = map.find(key);
      if (it == map.end()) continue;
      ExpectShape(key, it->second, FullShape(block.config, std::string("experts.") + f.name));
      moe::ExpertWeights full;
      full.*f.member =
          it->second.dtype() == DType::kFloat32 ? it->second : it->second.To(DType::kFloat32);
      it->second = parallel::ShardExperts(full, spec).*f.member;
    }
  }
}

void CheckpointLayout::GatherTensorParallel(ParameterSet& params, TensorMap& map,
                                            const std::string& suffix) {
  if (mesh_.tp() == 1) return;
  for (const Parameter& p : params.all()) {  // the same order on every rank of the group
    if (!p.tp_shard.split()) continue;
    auto it = map.find(p.name + suffix);
    if (it == map.end()) continue;
    it->second = GatherFull(groups_->Get(parallel::GroupKind::kTensor), it->second, p.tp_shard);
  }
}

void CheckpointLayout::SliceTensorParallel(ParameterSet& params, TensorMap& map,
                                           const std::string& suffix) const {
  if (mesh_.tp() == 1) return;
  const comm::Communicator& tp = groups_->Get(parallel::GroupKind::kTensor);
  for (const Parameter& p : params.all()) {
    if (!p.tp_shard.split()) continue;
    auto it = map.find(p.name + suffix);
    if (it == map.end()) continue;
    const Tensor full =
        it->second.dtype() == DType::kFloat32 ? it->second : it->second.To(DType::kFloat32);
    it->second = ShardOf(it->first, full, p.tp_shard, tp.rank(), static_cast<int>(tp.size()));
  }
}

void CheckpointLayout::GatherStages(TensorMap& map) {
  if (mesh_.pp() == 1) return;
  comm::Communicator& pipeline = groups_->Get(parallel::GroupKind::kPipeline);
  TensorMap all;
  for (int s = 0; s < pipeline.size(); ++s) {
    std::vector<std::byte> bytes;
    if (s == pipeline.rank()) bytes = SerializeSafetensors(map);
    int64_t size[1] = {static_cast<int64_t>(bytes.size())};
    pipeline.Broadcast(size, 1, DType::kInt64, {.root = s}).Wait();
    // As int32 words (the transports move typed elements), then the exact size again.
    const size_t words = (static_cast<size_t>(size[0]) + 3) / 4;
    bytes.resize(words * 4);
    pipeline.Broadcast(bytes.data(), words, DType::kInt32, {.root = s}).Wait();
    bytes.resize(static_cast<size_t>(size[0]));
    for (auto& [name, t] : ParseSafetensors(bytes, fmt::format("pipeline stage {}", s))) {
      all[name] = t;
    }
  }
  map = std::move(all);
}

}  // namespace switchyard::train
