#include "switchyard/train/memory_estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/model.h"
#include "switchyard/train/pipeline.h"

namespace switchyard::train {

AttentionCore ResolvedAttentionCore(const TrainConfig& c) {
  // The attention core does not depend on the world size: any world the layout divides.
  return ResolveLayout(c, static_cast<int>(c.tp * c.pp * c.cp)).attention_core;
}

namespace {

// The schedule's peak of micro-batch chunks in flight on a rank (parallel::SimulateSchedule),
// in units of a whole stage's blocks (a chunk holds 1 / virtual_stages of them). A schedule train
// cannot build (refused by its validation with a clearer message) counts every micro-batch.
double PipelineBlocksInFlight(const TrainConfig& c) {
  const double all = static_cast<double>(std::max<int64_t>(1, c.microbatches));
  try {
    const parallel::ScheduleConfig schedule = PipelineScheduleConfig(c);
    // The peak depends on the schedule alone: kept per thread for the planner's many layouts.
    thread_local std::map<std::tuple<int, int, int, int>, int> peaks;
    const auto key = std::tuple{schedule.stages, schedule.microbatches, schedule.virtual_stages,
                                static_cast<int>(schedule.kind)};
    auto it = peaks.find(key);
    if (it == peaks.end()) {
      const parallel::ScheduleSimulation sim =
          parallel::SimulateSchedule(parallel::MakeSchedule(schedule));
      int peak = 1;
      for (int p : sim.peak_in_flight) peak = std::max(peak, p);
      if (peaks.size() > 4096) peaks.clear();
      it = peaks.emplace(key, peak).first;
    }
    return std::min(all, static_cast<double>(it->second) /
                             static_cast<double>(std::max<int64_t>(1, c.virtual_stages)));
  } catch (const InvalidArgument&) {
    return all;
  }
}

}  // namespace

double MoeSlotsPerToken(const TrainConfig& c, double experts_held, int ep) {
  const double k = static_cast<double>(c.top_k);
  const double cf = std::fabs(c.capacity_factor);
  // The padded all-to-all holds every expert's capacity, used or not.
  if (c.dispatch == parallel::DispatchKind::kAllToAll) return k * std::max(1.0, c.capacity_factor);
  // The experts of one rank: every slot of its own tokens, whatever the routing.
  if (ep <= 1) return k;
  // Each source rank sends an expert at most its capacity (k floor(cf ceil(T / E)) slots of its
  // T tokens), so a rank receives at most cf k slots per token of a rank; and a token sends a
  // rank at most min(k, experts held) slots. An untrained router sends most tokens to the same
  // experts (measured on bench plan-check's default model, ep 4: the busiest rank at capacity
  // every step), so the busiest rank is at that bound; capacity_factor 0 (no drops) has none:
  // the mean, k.
  if (cf == 0) return k;
  return std::min(k * std::max(1.0, cf), static_cast<double>(ep) * std::min(k, experts_held));
}

namespace {

// The MoE blocks (IsMoeBlock: moe_every and mlp_only_layers) of the stage holding the most, with
// the blocks split evenly over the stages (`layers` each).
int64_t MoeBlocksOfFullestStage(const ModelConfig& m, int64_t layers) {
  int64_t most = 0;
  for (int64_t first = 0; first < m.num_layers; first += layers) {
    int64_t here = 0;
    for (int64_t b = first; b < std::min(m.num_layers, first + layers); ++b) {
      here += IsMoeBlock(m, b) ? 1 : 0;
    }
    most = std::max(most, here);
  }
  return most;
}

// A block's parameters on a rank, by how the gradient reduction divides them.
struct BlockUnits {
  int64_t layers = 0;       // blocks of the stage
  int64_t dense_block = 0;  // a dense block's values (attention, norms, FFN), over dense_shards
  int64_t moe_block = 0;    // an MoE block's values other than its experts, over dense_shards
  int64_t experts = 0;      // an MoE block's experts held here, over expert_shards
  int64_t dense_shards = 1, expert_shards = 1;
};

// ZeRO 2 and 3 reduce-scatter the gradients block by block during the last micro-batch's
// backward (overlap_grad_reduce, pp 1; param_grad_buffer.cc's AfterBlock): block i's reduction
// is launched after its backward and finished after block i - 1's, so at the backward's peak two
// consecutive blocks' reductions are in flight. Each holds its receive buffer (1 / shards of the
// unit: zero.cc's Bucket::received) and, with one micro-batch, its whole gradients, of which the
// estimate's gradients count only the shard; together the two blocks' whole size (measured on
// bench plan-check's default model, ZeRO 2 / 3 with ep 2 and 4: the ZeRO meter's gradients and
// reduction buffers 1.10-2.23 MB above the shards, this 1.06-2.11 MB). Bytes above the shards.
int64_t ReductionInFlightBytes(const TrainConfig& c, const BlockUnits& u) {
  if (c.zero_stage < 2 || !c.overlap_grad_reduce || std::max<int64_t>(1, c.pp) > 1) return 0;
  const bool whole = c.microbatches <= 1;  // else the gradients are counted whole already
  // The elements of block b a reduction holds beyond its shard.
  auto held = [&](int64_t b) {
    double sum = 0;
    const bool moe = IsMoeBlock(c.model, b) && u.experts > 0;
    for (const auto& [n, shards] : {std::pair{moe ? u.moe_block : u.dense_block, u.dense_shards},
                                    std::pair{moe ? u.experts : int64_t{0}, u.expert_shards}}) {
      if (shards <= 1) continue;  // a group of one rank reduces nothing
      const double g = static_cast<double>(shards);
      sum += static_cast<double>(n) * (whole ? 1.0 : 1.0 / g);
    }
    return sum;
  };
  double most = u.layers == 1 ? held(0) : 0;
  for (int64_t b = 0; b + 1 < u.layers; ++b) most = std::max(most, held(b) + held(b + 1));
  return static_cast<int64_t>(std::ceil(4 * most));
}

// An expert's matrices and values.
struct ExpertShape {
  int64_t matrices = 2;  // fc1 and fc2, and fc3 when gated (SwiGLU)
  int64_t values = 0;
};

// An expert: fc1 and fc2 (and fc3 when gated, SwiGLU), with their biases unless fc_bias is off
// (the moe_layer_config file's keys; its defaults without one, not read per call then).
// With mlp swiglu and no file, MoeLayerConfig's gated SiLU experts, biases as mlp_bias (set
// here: MoeLayerConfig reads the whole config, too slow for the planner's every candidate).
ExpertShape ExpertShapeOf(const TrainConfig& c, bool has_moe, int64_t expert_hidden) {
  const ModelConfig& m = c.model;
  moe::LayerConfig layer =
      has_moe && !c.moe_layer_config.empty() ? MoeLayerConfig(c) : moe::LayerConfig{};
  if (m.mlp == MlpKind::kSwiGlu && c.moe_layer_config.empty()) {
    layer.gated = true;
    layer.fc_bias = m.mlp_bias;
  }
  const int64_t matrices = layer.gated ? 3 : 2;
  const int64_t d = m.model_dim;
  return {.matrices = matrices,
          .values = CheckedMul(matrices, CheckedMul(d, expert_hidden, "per-rank memory estimate"),
                               "per-rank memory estimate") +
                    (layer.fc_bias ? expert_hidden + d : 0)};
}

// The expert-data ranks over which ZeRO shards an expert (parallel::LayerMesh): DeepSpeed's
// arrangement builds the expert groups of the ranks with the same tp rank (dp cp / ep of them);
// Megatron's (sequence parallel) of etp x ep x edp x pp over the whole world, the tp ranks among
// the data ranks. (Until 2026-11-28 the estimate divided by tp in both: the tp 2,
// sequence-parallel ZeRO 3 layouts of bench plan-check were +11-15 % over, their experts'
// moments counted twice.)
int64_t ExpertDataShards(const TrainConfig& c, int ep) {
  const int64_t pp = std::max<int64_t>(1, c.pp);
  const int64_t width = TrainArrangement(c) == parallel::Arrangement::kMegatron
                            ? std::max<int64_t>(1, c.etp)
                            : std::max<int64_t>(1, c.tp);
  return std::max<int64_t>(1, c.ranks / pp / (std::max(1, ep) * width));
}

}  // namespace

RankMemoryEstimate EstimateRankMemory(const TrainConfig& c) {
  const ModelConfig& m = c.model;
  const char* what = "per-rank memory estimate";
  const int64_t tp = std::max<int64_t>(1, c.tp), cp = std::max<int64_t>(1, c.cp),
                pp = std::max<int64_t>(1, c.pp);
  const int64_t dp = std::max<int64_t>(1, c.ranks / (tp * cp * pp));
  const int64_t d = m.model_dim, v = m.vocab_size, s = m.seq_len;
  const int64_t layers = (m.num_layers + pp - 1) / pp;
  const int64_t moe_layers = MoeBlocksOfFullestStage(m, layers);
  const int64_t eh = c.expert_hidden_dim > 0 ? c.expert_hidden_dim : m.hidden_dim;
  // Parameters of this rank: embeddings (and an untied head), split over tp; the position
  // embedding; per layer attention, norms, and the dense FFN or this rank's experts and the gate.
  // (An untied head is a second V x d matrix on the rank holding both ends: pp 1.)
  int64_t params =
      CheckedMul(v, d, what) / tp * (m.tied_head || pp > 1 ? 1 : 2) + CheckedMul(s, d, what);
  // q and o are d x d; k and v d x (num_kv_heads x head_dim) (grouped-query attention).
  const int64_t kv_heads = m.num_kv_heads > 0 ? m.num_kv_heads : m.num_heads;
  const int64_t kv_dim = d / std::max<int64_t>(1, m.num_heads) * kv_heads;
  const int64_t attention = CheckedMul(2, CheckedMul(d, d + kv_dim, what), what) / tp + 8 * d;
  const bool swiglu = m.mlp == MlpKind::kSwiGlu;  // gate, up and down projections
  const int64_t dense_ffn =
      CheckedMul(swiglu ? 3 : 2, CheckedMul(d, m.hidden_dim, what), what) / tp;
  int64_t experts_held = 0;
  int ep = 1;
  if (moe_layers > 0 && c.num_experts > 0) {
    ep = TrainExpertParallelSize(c, static_cast<int>(std::max<int64_t>(1, c.ranks)));
    experts_held = std::max<int64_t>(1, c.num_experts / std::max(1, ep));
  }
  const ExpertShape expert = ExpertShapeOf(c, moe_layers > 0, eh);
  const int64_t expert_matrices = expert.matrices;
  const int64_t experts = CheckedMul(experts_held, expert.values, what);
  // Qwen2-MoE's gated shared expert of every MoE block: a SwiGLU MLP over tp and its [1, d] gate.
  const int64_t shared_hidden = m.gated_shared_expert_hidden;
  const int64_t shared =
      CheckedMul(3, CheckedMul(d, shared_hidden, what), what) / tp + (shared_hidden > 0 ? d : 0);
  const int64_t gate = CheckedMul(c.num_experts, d, what) + shared;
  params += CheckedMul(layers - moe_layers, attention + dense_ffn, what) +
            CheckedMul(moe_layers, attention + gate, what);
  const int64_t expert_params = CheckedMul(moe_layers, experts, what);
  // ZeRO shards (param_grad_buffer.h's formula): stage >= 1 the AdamW moments, >= 2 the
  // gradients, 3 the values, over the data-parallel ranks (dense parameters: dp x cp; the
  // experts: the stage's ranks holding the same experts); stage 3 gathers one block's values
  // at a time, the next one prefetched.
  const int64_t dense_shards = dp * cp;
  const int64_t expert_shards = ExpertDataShards(c, ep);
  auto sharded = [&](int stage, int64_t bytes_per_value) {
    const bool shard = c.zero_stage >= stage;
    return CheckedMul(params / (shard ? dense_shards : 1), bytes_per_value, what) +
           CheckedMul(expert_params / (shard ? expert_shards : 1), bytes_per_value, what);
  };
  RankMemoryEstimate e;
  // The gradients of a step of several micro-batches accumulate whole until the last one's
  // backward reduces them (measured, ZeRO 3 with 2 micro-batches: the meter's gradients 4.18 MiB
  // against 2.15 with one): sharded only with one micro-batch.
  e.parameter_bytes = sharded(3, 4) + (c.microbatches > 1 ? sharded(4, 4) : sharded(2, 4));
  if (c.zero_stage >= 3) {
    const int64_t block = std::max(attention + dense_ffn, attention + gate + experts);
    // The largest block's gathered values (measured on the tiny model of
    // StepModelTest.MemoryEstimateMatchesTheMeasuredPeak: the arrays' peak is 1.07 such blocks
    // above the shards; the next block's gather is not held beside it at the peak).
    e.parameter_bytes += CheckedMul(4, block, what);
  }
  e.optimizer_bytes = sharded(1, 8);
  // The build holds every value and gradient of the rank's share before the first step releases
  // what ZeRO 2 / 3 shard (measured: the wide model of docs/planner.md's accuracy table).
  e.build_bytes = CheckedMul(params + expert_params, 8, what) + e.optimizer_bytes;
  // Activations of the micro-batches in flight on this rank.
  const int64_t rows =
      std::max<int64_t>(1, c.batch_size / dp / std::max<int64_t>(1, c.microbatches));
  const int64_t tokens = CheckedMul(rows, s / cp, what);
  // Per block, what Block::SavedTensors keeps (float32 values per token): the two norms' inputs
  // (/ tp with sequence parallelism), the attention's and the FFN's inputs, q | k | v and the
  // heads' output (/ tp), with the softmax core the probabilities; recompute selective drops
  // the probabilities, full keeps only the block's input.
  const int64_t norm_inputs = c.sequence_parallel && tp > 1 ? 2 * d / tp : 2 * d;
  const int64_t heads = m.num_heads / tp;
  const bool softmax = ResolvedAttentionCore(c) == AttentionCore::kSoftmax;
  const bool full = m.recompute == Recompute::kFull;
  const int64_t probs =
      softmax && m.recompute == Recompute::kNone ? CheckedMul(heads, s, what) : 2 * heads;
  const int64_t attention_rows = norm_inputs + 2 * d + 4 * d / tp + probs;
  // The MoE FFN of a block: the rows its experts hold (x, hidden, activated) per slot, the
  // tokens de-duplicated over tp; the gate's probabilities. Slots per token of the rank: the
  // busiest rank's (MoeSlotsPerToken); the measured peak is the largest rank's.
  const double slots_per_token =
      MoeSlotsPerToken(c, static_cast<double>(experts_held), ep) / static_cast<double>(tp);
  const int64_t moe_hidden =
      CheckedToInt64(std::ceil(slots_per_token * static_cast<double>(d + expert_matrices * eh)),
                     "per-rank memory estimate (top_k x capacity_factor x expert rows)", 0,
                     std::numeric_limits<int64_t>::max());
  const int64_t dense_layer = full ? d : attention_rows + 2 * m.hidden_dim / tp;
  // The shared expert keeps its hidden rows like a dense FFN, and its gate value.
  const int64_t shared_rows = shared_hidden > 0 ? 2 * shared_hidden / tp + 1 : 0;
  // The buffer dispatchers (all but allgather) keep the experts' outputs in the plan's buffer
  // of this rank's own slots (top_k per token, x capacity_factor padded) for the combine's
  // backward (dispatcher.h's out_buf_).
  const bool padded = c.dispatch == parallel::DispatchKind::kAllToAll;
  const int64_t combine_rows =
      c.dispatch == parallel::DispatchKind::kAllGather
          ? 0
          : CheckedToInt64(std::ceil(static_cast<double>(c.top_k) *
                                     (padded ? std::max(1.0, c.capacity_factor) : 1.0) *
                                     static_cast<double>(d) / static_cast<double>(tp)),
                           what, 0, std::numeric_limits<int64_t>::max());
  const int64_t moe_layer =
      full ? d : attention_rows + moe_hidden + combine_rows + c.num_experts + shared_rows;
  // One block's state again while it is recomputed in backward (full), the final norm's input
  // and output and the logits' gradient (the logits themselves while the loss is computed).
  const int64_t recomputed =
      full ? std::max(attention_rows + 2 * m.hidden_dim / tp,
                      attention_rows + moe_hidden + combine_rows + c.num_experts + shared_rows)
           : 0;
  // The softmax core's gradient of one layer's probabilities in backward.
  const int64_t probs_grad = softmax ? CheckedMul(heads, s, what) : 0;
  // What the blocks keep per micro-batch until its backward, and what exists for one
  // micro-batch at a time (the block recomputed, one probability gradient, the final norm and
  // the logits: the last stage runs a micro-batch's loss and backward in turn).
  const int64_t kept =
      CheckedMul(layers - moe_layers, dense_layer, what) + CheckedMul(moe_layers, moe_layer, what);
  // The backward's working set beside what is kept (measured on the default model: about 3,000
  // floats per token at the backward's peak): the gradients of the largest FFN's rows, an MoE
  // block's slots or a dense block's two hidden rows.
  const int64_t ffn_grads =
      std::max(moe_layers > 0 ? moe_hidden : 0, layers > moe_layers ? 2 * m.hidden_dim / tp : 0);
  const int64_t transient =
      recomputed + probs_grad + ffn_grads + 2 * d + CheckedMul(2, v / tp, what);
  // With pp > 1, the kept rows of the most micro-batch chunks (of layers / virtual_stages
  // blocks each) whose forward has run and whose backward has not, on any rank of the schedule.
  const double in_flight = pp > 1 ? PipelineBlocksInFlight(c) : 1.0;
  const double per_token = static_cast<double>(kept) * in_flight + static_cast<double>(transient);
  e.activation_bytes = CheckedToInt64(std::ceil(static_cast<double>(tokens) * per_token * 4), what,
                                      0, std::numeric_limits<int64_t>::max());
  // Two reductions are in flight while block i's backward runs, after block i + 1's gave back
  // what it kept (block i's rows are still held): at least the last block's rows are free.
  e.reduction_freed_bytes =
      CheckedMul(tokens, 4 * (IsMoeBlock(m, layers - 1) ? moe_layer : dense_layer), what);
  e.reduction_bytes = ReductionInFlightBytes(c, {.layers = layers,
                                                 .dense_block = attention + dense_ffn,
                                                 .moe_block = attention + gate,
                                                 .experts = experts,
                                                 .dense_shards = dense_shards,
                                                 .expert_shards = expert_shards});
  return e;
}

void RequireMemoryBudget(const TrainConfig& c) {
  if (!(c.memory_budget_mib > 0)) return;
  const RankMemoryEstimate e = EstimateRankMemory(c);
  const double budget = c.memory_budget_mib * 1024 * 1024;
  SY_REQUIRE(static_cast<double>(e.total()) <= budget, InvalidArgument,
             "config: the per-rank memory estimate {} (parameters and gradients {}, AdamW state "
             "{}, activations {}; the model's build {}; cp {}, tp {}, pp {}, attention_core {}) "
             "exceeds 'memory_budget_mib' {} ({}): split the sequence over more ranks ('cp'), "
             "the layers ('pp') or the weights ('tp'), or use a smaller batch_size",
             FormatBytes(static_cast<uint64_t>(e.total())),
             FormatBytes(static_cast<uint64_t>(e.parameter_bytes)),
             FormatBytes(static_cast<uint64_t>(e.optimizer_bytes)),
             FormatBytes(static_cast<uint64_t>(e.activation_bytes)),
             FormatBytes(static_cast<uint64_t>(e.build_bytes)), c.cp, c.tp, c.pp,
             ChoiceTraits<AttentionCore>::Name(ResolvedAttentionCore(c)), c.memory_budget_mib,
             FormatBytes(static_cast<uint64_t>(budget)));
}

}  // namespace switchyard::train
