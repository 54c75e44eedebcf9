#include "switchyard/train/pipeline.h"

#include <algorithm>

#include "switchyard/core/error.h"

namespace switchyard::train {

std::vector<BlockRange> PipelineVirtualStages(const TrainConfig& c) {
  const int64_t stages = std::max<int64_t>(1, c.pp) * std::max<int64_t>(1, c.virtual_stages);
  const int64_t layers = c.model.num_layers;
  SY_REQUIRE(stages <= layers, InvalidArgument,
             "config: {} virtual stages (pp x virtual_stages) need at least as many blocks, "
             "'num_layers' is {}",
             stages, layers);
  std::vector<BlockRange> out;
  int64_t begin = 0;
  for (int64_t s = 0; s < stages; ++s) {
    int64_t count = layers / stages + (s < layers % stages ? 1 : 0);
    if (!c.pipeline_split.empty()) {
      SY_REQUIRE(static_cast<int64_t>(c.pipeline_split.size()) == stages, InvalidArgument,
                 "config: 'pipeline_split' has {} counts, expected pp x virtual_stages = {}",
                 c.pipeline_split.size(), stages);
      count = c.pipeline_split[static_cast<size_t>(s)];
    }
    out.push_back({begin, begin + count});
    begin += count;
  }
  SY_REQUIRE(begin == layers, InvalidArgument,
             "config: 'pipeline_split' covers {} blocks, 'num_layers' is {}", begin, layers);
  return out;
}

ModelPartition PipelinePartition(const TrainConfig& c, int rank) {
  const int p = static_cast<int>(std::max<int64_t>(1, c.pp));
  SY_REQUIRE(rank >= 0 && rank < p, InvalidArgument, "pipeline rank {}: expected 0..{}", rank,
             p - 1);
  const std::vector<BlockRange> stages = PipelineVirtualStages(c);
  ModelPartition partition;
  for (size_t s = static_cast<size_t>(rank); s < stages.size(); s += static_cast<size_t>(p)) {
    partition.chunks.push_back(stages[s]);
  }
  return partition;
}

parallel::ScheduleConfig PipelineScheduleConfig(const TrainConfig& c) {
  parallel::ScheduleConfig s;
  s.stages = static_cast<int>(c.pp);
  s.microbatches = static_cast<int>(c.microbatches);
  s.virtual_stages = static_cast<int>(c.virtual_stages);
  s.kind = c.pipeline_schedule;
  parallel::ValidateScheduleConfig(s);
  return s;
}

}  // namespace switchyard::train
