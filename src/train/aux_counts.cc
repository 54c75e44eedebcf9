#include "switchyard/train/aux_counts.h"

namespace switchyard::train {

void StepAuxCounts::StartStep(uint64_t step) {
  if (started_ && step == step_) return;
  started_ = true;
  step_ = step;
  total_ = {};
  given_.clear();
  added_.clear();
}

const moe::AuxCountsSoFar* StepAuxCounts::Before(uint64_t step, int64_t key) {
  StartStep(step);
  auto it = given_.find(key);
  if (it == given_.end()) it = given_.emplace(key, total_).first;
  return &it->second;
}

void StepAuxCounts::Add(uint64_t step, int64_t key, const std::vector<double>& counts) {
  StartStep(step);
  if (counts.empty() || added_[key]) return;
  added_[key] = true;
  if (total_.counts.empty()) total_.counts.assign(counts.size(), 0.0);
  for (size_t e = 0; e < counts.size() && e < total_.counts.size(); ++e) {
    total_.counts[e] += counts[e];
  }
  ++total_.micro_batches;
}

}  // namespace switchyard::train
