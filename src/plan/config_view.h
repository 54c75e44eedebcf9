// The one place the planner reads a TrainConfig: the model and layout keys it needs, by their
// JSON names (TrainConfigToJson), so that the planner does not depend on how train stores them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "switchyard/train/config.h"

namespace switchyard::plan::internal {

struct ModelView {
  int64_t vocab_size = 0, seq_len = 0, model_dim = 0, num_layers = 0, num_heads = 0;
  int64_t hidden_dim = 0, moe_blocks = 0, num_experts = 0, top_k = 0, expert_hidden_dim = 0;
  int64_t expert_matrices = 2;  // fc1, fc2 (3 with gated, SwiGLU experts)
  int64_t dense_matrices = 2;   // a dense block's FFN: fc1, fc2 (3 with mlp swiglu)
  // The attention projections in units of d x d: q and o, k and v scaled by num_kv_heads /
  // num_heads (grouped-query attention): 4 with multi-head attention.
  double attention_matrices = 4;
  int64_t batch_size = 0;
  double capacity_factor = 1;
  bool tied_head = true;
  std::string precision;  // fp32 | bf16
};

struct LayoutView {
  int64_t ranks = 1, tp = 1, cp = 1, pp = 1, dp = 1, ep = 1, etp = 1, virtual_stages = 1;
  int64_t zero_stage = 0, microbatches = 1, overlap_degree = 1;
  bool sequence_parallel = false, tp_comm_overlap = false, overlap_grad_reduce = true;
  bool megatron = false;  // the arrangement resolved
  std::string cp_algo, pipeline_schedule, dispatch, a2a_algo, adaptive_r;
  std::string recompute;  // none | full | selective
};

ModelView ReadModel(const train::TrainConfig& config);
// ep resolved as train resolves it (TrainExpertParallelSize); dp = ranks / (tp cp pp).
LayoutView ReadLayout(const train::TrainConfig& config);
// The search's fast path: `base` (ReadLayout of the config the flags were applied to before)
// with the layout keys `flags` sets (key, command-line text), for `config` = that config with the
// flags applied (ep and the arrangement are resolved from it).
LayoutView LayoutWithFlags(LayoutView base,
                           const std::vector<std::pair<std::string, std::string>>& flags,
                           const train::TrainConfig& config);

}  // namespace switchyard::plan::internal
