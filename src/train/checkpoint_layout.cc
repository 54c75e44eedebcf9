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

std::optional<CheckpointLayout::Part> CheckpointLayout::PartOf(const Parameter& p) const {
  Part part;
  Shape local = p.value.shape();
  auto whole = [](const Shape& shape) {
    Box b;
    b.begin.assign(shape.size(), 0);
    b.end.assign(shape.begin(), shape.end());
    return b;
  };
  for (const MoeBlock& block : moe_blocks_) {
    if (p.name.rfind(block.prefix + "experts.", 0) != 0) continue;
    const std::string field = p.name.substr(block.prefix.size());
    const parallel::ShardSpec s = parallel::ShardOf(mesh_, world_.rank(), block.config);
    part.full_shape = FullShape(block.config, field);
    Box b = whole(part.full_shape);
    b.begin[0] = s.first_expert;
    b.end[0] = s.first_expert + s.local_experts;
    const int64_t h0 = s.shard * s.shard_hidden(), h1 = h0 + s.shard_hidden();
    if (field == "experts.fc1.weight" || field == "experts.fc3.weight") {
      b.begin[1] = h0;
      b.end[1] = h1;  // [E, H, M]
    } else if (field == "experts.fc2.weight" || field == "experts.fc1.bias") {
      b.begin.back() = h0;
      b.end.back() = h1;                       // [E, M, H], [E, H]
    } else if (field == "experts.fc2.bias") {  // [E, M] in chunks of bias_chunk()
      if (s.shards > 1 && s.bias_chunk() * s.shards != s.model_dim) return std::nullopt;
      b.begin[1] = s.shard * s.bias_chunk();
      b.end[1] = b.begin[1] + s.bias_chunk();
    } else {
      return std::nullopt;
    }
    part.boxes.push_back(std::move(b));
    return part;
  }
  const int tp = mesh_.tp();
  if (tp == 1 || !p.tp_shard.split()) {
    part.full_shape = local;
    part.boxes.push_back(whole(local));
    return part;
  }
  const int rank = groups_->Get(parallel::GroupKind::kTensor).rank();
  part.full_shape = local;
  if (p.tp_shard.dim == TpShard::Dim::kColumns) {
    part.full_shape[1] *= tp;
    Box b = whole(part.full_shape);
    b.begin[1] = rank * local[1];
    b.end[1] = (rank + 1) * local[1];
    part.boxes.push_back(std::move(b));
    return part;
  }
  // Rows [f * part + r * n, f * part + (r + 1) * n) of every fused part f (ShardOf).
  const int64_t parts = p.tp_shard.fused_parts, n = local[0] / parts;
  part.full_shape[0] *= tp;
  for (int64_t f = 0; f < parts; ++f) {
    Box b = whole(part.full_shape);
    b.begin[0] = f * n * tp + rank * n;
    b.end[0] = b.begin[0] + n;
    part.boxes.push_back(std::move(b));
  }
  return part;
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
