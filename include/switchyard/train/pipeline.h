// Pipeline parallelism in training: how a config's blocks are cut into virtual stages, which of
// them a pipeline rank holds, and the schedule it runs (parallel/pipeline.h). docs/pipeline.md.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/parallel/pipeline.h"
#include "switchyard/train/config.h"
#include "switchyard/train/model.h"

namespace switchyard::train {

// The block ranges of the pp * virtual_stages virtual stages, in order: pipeline_split's counts,
// or as even as possible (the first num_layers % stages one block more).
std::vector<BlockRange> PipelineVirtualStages(const TrainConfig& config);
// The chunks pipeline rank `rank` holds: virtual stages rank, rank + pp, ... (chunk c is virtual
// stage c * pp + rank, as parallel/pipeline.h numbers them).
ModelPartition PipelinePartition(const TrainConfig& config, int rank);
// The schedule configuration of a config (kind from pipeline_schedule; InvalidArgument naming the
// key for an unknown kind or a combination the kind cannot schedule).
parallel::ScheduleConfig PipelineScheduleConfig(const TrainConfig& config);

}  // namespace switchyard::train
