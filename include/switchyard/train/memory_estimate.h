// What one rank of a training layout holds, estimated from the config before anything is
// allocated (docs/context_parallel.md "Memory per rank in training" compares it with the
// measured peak of core/memory_account.h).
#pragma once

#include <cstdint>
#include <string>

#include "switchyard/train/config.h"

namespace switchyard::train {

struct RankMemoryEstimate {
  // Values and gradients of this rank's parameters (float32); the gradients whole with several
  // micro-batches (they accumulate until the last one's backward reduces them).
  int64_t parameter_bytes = 0;
  int64_t optimizer_bytes = 0;   // AdamW's two moments (ZeRO >= 1: this rank's share)
  int64_t activation_bytes = 0;  // what the micro-batches in flight keep for backward, logits
  // ZeRO 2 / 3's gradient reductions in flight during the backward (overlap_grad_reduce, pp 1):
  // two consecutive blocks' receive buffers and, with one micro-batch, their gradients whole
  // (above the shards parameter_bytes counts); what the ZeRO meter measures at its peak.
  int64_t reduction_bytes = 0;
  // What the last block kept for its backward, given back before two reductions are in flight:
  // the reductions raise the peak by reduction_bytes - this, when positive.
  int64_t reduction_freed_bytes = 0;
  // The model's build, before the first step shards anything: every value and (zero) gradient
  // of this rank's tp / ep / pp share, unsharded over the data-parallel ranks, and the optimizer
  // state as ZeRO shards it (param_grad_buffer.cc builds the optimizers on the built model).
  int64_t build_bytes = 0;
  // The training steps' parts.
  int64_t steps() const {
    const int64_t reductions = reduction_bytes - reduction_freed_bytes;
    return parameter_bytes + optimizer_bytes + activation_bytes + (reductions > 0 ? reductions : 0);
  }
  // The run's peak: the larger of the build and the steps (the build only with ZeRO 2 and 3,
  // whose steps hold less than every value and gradient).
  int64_t total() const { return steps() > build_bytes ? steps() : build_bytes; }
};

// Per rank of `config`'s layout (tp, cp, pp, dp = ranks / (tp cp pp), ep, zero_stage): the
// parameters of its shard and stage (the stage with the most MoE blocks by IsMoeBlock, so
// mlp_only_layers' dense blocks count as dense; an MoE block with its gate, this rank's experts
// and a gated shared expert); per token of its share of a micro-batch (batch_size / dp /
// microbatches sequences, seq_len / cp positions of each; pp > 1: every micro-batch in flight)
// and block what the block keeps for backward: the two norms' inputs (/ tp with
// sequence_parallel), the attention's and the FFN's inputs, q, k, v and the heads' output (/ tp),
// with the "softmax" attention core and recompute none the num_heads / tp x seq_len
// probabilities; a dense FFN's 2 hidden rows / tp, an MoE FFN's slots of expert input and 2
// hidden rows (the busiest expert rank's, MoeSlotsPerToken, / tp), the buffer dispatchers'
// combine buffer (top_k, x capacity_factor padded, rows of model_dim / tp) and the gate's
// probabilities (and a gated shared expert's 2 hidden rows / tp and its gate value); recompute full
// keeps the block's input only (and one block's state while it is recomputed); the backward's
// working set: the gradients of the largest FFN's rows (an MoE block's slots, a dense block's 2
// hidden rows / tp); the final norm's input and output, the logits and their gradient
// (2 x vocab / tp). Sizes that overflow int64 are refused (InvalidArgument).
RankMemoryEstimate EstimateRankMemory(const TrainConfig& config);

// The MoE slots per token of a rank's share of the tokens that the busiest rank of the expert
// group holds, of `experts_held` experts among `ep` expert-parallel ranks: top_k x
// capacity_factor with the padded all-to-all; top_k with ep 1 or capacity_factor 0; otherwise the
// capacity bound min(top_k x |capacity_factor|, ep x min(top_k, experts_held)), which an
// untrained router reaches (docs/planner.md, "What the memory account measures").
double MoeSlotsPerToken(const TrainConfig& config, double experts_held, int ep);

// The attention core the layout runs: kSoftmax or kFlash (attention_core auto: flash with cp > 1;
// ResolveLayout's).
AttentionCore ResolvedAttentionCore(const TrainConfig& config);

// InvalidArgument when config.memory_budget_mib > 0 and the estimate exceeds it, naming the
// estimate (and its parts), the budget and the layout keys that reduce it.
void RequireMemoryBudget(const TrainConfig& config);

}  // namespace switchyard::train
