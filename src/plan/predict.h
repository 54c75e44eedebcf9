// PredictStep on views read once (the search predicts many layouts of one model).
#pragma once

#include "plan/config_view.h"
#include "switchyard/plan/step_model.h"

namespace switchyard::plan::internal {

// PredictStep(config, cluster) with `model` = ReadModel(config) and `layout` = the config's
// layout (ReadLayout or LayoutWithFlags).
StepPrediction PredictStepOf(const train::TrainConfig& config, const ModelView& model,
                             const LayoutView& layout, const Cluster& cluster);

}  // namespace switchyard::plan::internal
