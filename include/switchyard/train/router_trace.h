// Router trace and replay (docs/observability.md, "Router trace and replay"): a training run
// records, for chosen steps, every MoE layer's routes (top-k expert ids and combine weights) of
// every token with its global index; a later run, in any layout, forces those routes
// (Megatron-Core's RouterReplay: the ids are forced, the gate values are those of the replaying
// model's scores at these experts, so gradients flow as usual).
//
// Files: <dir>/step_<step, 6 digits>/rank_<world rank, 5 digits>.safetensors, one per rank that
// routes tokens, each holding, per MoE layer with parameter prefix P (e.g. "blocks.1.moe."):
//   P + "tokens"   int64 [N]       the global index of each token (micro-batch offset included)
//   P + "experts"  int16 [N, k]    the chosen experts, in choice order (int32 when an id does not
//                                  fit int16: layers of more than 32768 experts)
//   P + "weights"  bfloat16 [N, k] the combine weights (0 where the pair was dropped)
// and the metadata {"format": "switchyard-router-trace", "step": "<step>"}. Ranks that hold the
// same tokens (tensor parallelism) record the same routes; replay accepts duplicates that agree.
//
// Thread-safety: one RouterTrace per rank; its layers call it from the rank's thread.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/layer.h"

namespace switchyard::train {

struct RouterTraceOptions {
  std::string record_dir;  // non-empty: record the chosen steps into this directory
  // The 1-based steps to record: a list, or every `every`-th step (every > 0: steps every,
  // 2 every, ...); both empty / 0: every step.
  std::vector<int64_t> record_steps;
  int64_t every = 0;
  std::string replay_dir;  // non-empty: force the routes recorded there at every training step
};

class RouterTrace {
 public:
  // `rank`: the world rank (names this rank's file).
  RouterTrace(RouterTraceOptions options, int rank);

  bool recording() const { return !options_.record_dir.empty(); }
  bool replaying() const { return !options_.replay_dir.empty(); }
  // True when step `step` (1-based) is recorded.
  bool Records(int64_t step) const;

  // Replay: the experts [T, k] recorded for the tokens `tokens` of the layer `prefix` in step
  // `step`. Throws InvalidArgument naming the directory, step, layer or token when the trace has
  // no such step, layer or token, or records another k.
  std::vector<int32_t> Forced(const std::string& prefix, int64_t step,
                              std::span<const int64_t> tokens, int64_t top_k);
  // Record: the routes of the tokens `tokens` of layer `prefix` in step `step`: experts [T, k]
  // int32 and combine weights [T, k] float32 (LayerOutput::topk_idx / combine_weights).
  void Record(const std::string& prefix, int64_t step, std::span<const int64_t> tokens,
              const Tensor& experts, const Tensor& weights);
  // After step `step`: writes this rank's file of that step when it recorded any routes.
  void EndStep(int64_t step);

  // The directory of step `step` inside `dir`.
  static std::string StepDirectory(const std::string& dir, int64_t step);

 private:
  struct Recorded {
    std::vector<int64_t> tokens;
    std::vector<int32_t> experts;
    std::vector<float> weights;
    int64_t top_k = 0;
  };
  struct Replayed {
    int64_t top_k = 0;
    std::unordered_map<int64_t, size_t> row;  // token -> row of experts
    std::vector<int32_t> experts;
  };
  void LoadReplayStep(int64_t step);

  RouterTraceOptions options_;
  int rank_ = 0;
  std::map<std::string, Recorded> recorded_;  // by layer prefix, this step
  int64_t loaded_step_ = 0;                   // replay: the step held in replayed_
  std::map<std::string, Replayed> replayed_;
};

// The options of the training keys router_trace, router_trace_steps ("1,100,1000" or "every:N";
// "": every step) and router_replay. Throws InvalidArgument naming the key for a malformed
// step list, steps without router_trace, or the same directory recorded and replayed.
RouterTraceOptions RouterTraceOptionsFromConfig(const std::string& trace, const std::string& steps,
                                                const std::string& replay);

// A trace's "experts" tensor as int32 ids (int16 and int32 files are both read: traces written
// before int16 hold int32); an undefined tensor when `experts` is neither or is not [N, k].
Tensor TraceExpertIdsAsInt32(const Tensor& experts);

// Global token indices of `rows` rows: token_index when given, else offset, offset + 1, ...
std::vector<int64_t> RowTokens(int64_t rows, int64_t global_token_offset,
                               const std::vector<int64_t>* token_index);

// What an MoE FFN does around its forward on training step `step` (0-based, as
// FeedForwardContext::step; files count from 1). Evaluation calls and a null trace do nothing.
struct TracedForward {
  RouterTrace* trace = nullptr;  // null: no trace
  std::string prefix;            // the layer's parameter prefix
  int64_t step = 0;              // 1-based
  std::vector<int64_t> tokens;   // global index of each row
  std::vector<int32_t> forced;   // replay: [T, k] for ForwardOptions::forced_experts; else empty

  TracedForward(RouterTrace* trace, std::string prefix, uint64_t step, bool training, int64_t rows,
                int64_t global_token_offset, const std::vector<int64_t>* token_index,
                int64_t top_k);
  // Records the call's routes when the step is recorded and the call keeps its state for
  // backward (a block recomputed in backward runs its forward twice and records once).
  void Record(const moe::LayerOutput& out, bool save_for_backward);
};

}  // namespace switchyard::train
