// Placeholders until the schedule generator and the executor land (parallel/pipeline.h): every
// pipelined configuration is refused with a clear error. Removed when they are merged.
#include "switchyard/core/error.h"
#include "switchyard/parallel/pipeline.h"

namespace switchyard::parallel {

ScheduleKind ScheduleKindFromName(std::string_view name) {
  if (name == "1f1b") return ScheduleKind::k1F1B;
  throw InvalidArgument("pipeline schedules are not available in this build");
}
void ValidateScheduleConfig(const ScheduleConfig& config) {
  SY_REQUIRE(config.stages == 1, InvalidArgument,
             "pipeline parallelism is not available in this build (pp {})", config.stages);
}
Schedule MakeSchedule(const ScheduleConfig& config) {
  ValidateScheduleConfig(config);
  return Schedule{config, {}};
}
PipelineRunStats RunSchedule(comm::Communicator&, const Schedule&, const PipelineStageCallbacks&) {
  throw InvalidArgument("pipeline parallelism is not available in this build");
}

}  // namespace switchyard::parallel
