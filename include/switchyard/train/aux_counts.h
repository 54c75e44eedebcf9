// The router counts that balancing losses need beyond one layer's call.
// - aux_loss global in training (docs/moe.md, "Losses"): the counts of the step's earlier
//   micro-batches that each MoE FFN hands its layer (moe::AuxCountsSoFar), as Megatron-Core's
//   router keeps global_tokens_per_expert and ga_steps until the step's end.
// - aux_loss hf_concat across pipeline stages (docs/models.md): a micro-batch's running router
//   sums travel forward with the activation and its totals back with the gradient.
//
// Thread-safety: StepAuxCounts one per FFN (a rank's FFN runs one micro-batch at a time); the
// functions are reentrant.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/losses.h"
#include "switchyard/moe/router_load_loss.h"

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

// aux_loss hf_concat between pipeline stages: the 2E + 1 doubles of RouterLoadSums::ToVector,
// bit for bit, in extra rows below a float32 [rows, model_dim] activation or gradient (the
// executor moves float32 tensors; no collective is added to the schedule).
// The extra rows that hold them.
int64_t ConcatPayloadRows(int64_t num_experts, int64_t model_dim);
// [rows + payload_rows, model_dim]: x [rows, model_dim] float32 and then `sums`.
Tensor AppendConcatSums(const Tensor& x, const moe::RouterLoadSums& sums, int64_t payload_rows);
// The sums held by the last payload_rows rows of x (InvalidArgument when x is not float32 with
// that many rows).
moe::RouterLoadSums ReadConcatSums(const Tensor& x, int64_t payload_rows, int64_t num_experts,
                                   int64_t top_k);

}  // namespace switchyard::train
