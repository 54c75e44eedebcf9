// aux_loss global in training (docs/moe.md, "Losses"): the counts of the step's earlier
// micro-batches that each MoE FFN hands its layer (moe::AuxCountsSoFar), as Megatron-Core's
// router keeps global_tokens_per_expert and ga_steps until the step's end.
//
// Thread-safety: one per FFN (a rank's FFN runs one micro-batch at a time).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "switchyard/moe/losses.h"

namespace switchyard::train {

// The key of a micro-batch: its first token's global index.
inline int64_t MicroBatchKey(int64_t global_token_offset, const std::vector<int64_t>* token_index) {
  return token_index != nullptr && !token_index->empty() ? token_index->front()
                                                         : global_token_offset;
}

class StepAuxCounts {
 public:
  // The counts for the micro-batch `key` (its first global token index) of training step `step`:
  // those of the step's micro-batches recorded before it. A new step starts from none; a repeated
  // forward of the same micro-batch (activation recomputation) gets what it got the first time.
  const moe::AuxCountsSoFar* Before(uint64_t step, int64_t key);
  // Records the counts the layer returned for micro-batch `key` (once; a repeat adds nothing).
  void Add(uint64_t step, int64_t key, const std::vector<double>& counts);

 private:
  void StartStep(uint64_t step);

  bool started_ = false;
  uint64_t step_ = 0;
  moe::AuxCountsSoFar total_;                     // every micro-batch recorded in the step
  std::map<int64_t, moe::AuxCountsSoFar> given_;  // what each micro-batch was handed
  std::map<int64_t, bool> added_;
};

}  // namespace switchyard::train
