// ValidateTrainConfig: every check of a run's keys, in one place (config.h).
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/parallel/pipeline.h"
#include "switchyard/train/config.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/router_trace.h"
#include "train/config_fields.h"

namespace switchyard::train {

using nlohmann::json;

namespace {

// The range of every integer key, checked on the full 64-bit value before anything narrows it
// (the layout sizes become `int`: a value such as 2^32 + 1 would wrap to 1). Keys not listed
// here are checked by ValidateModelConfig or below.
struct IntRange {
  const char* key;
  int64_t lo, hi;
};
constexpr int64_t kMaxRanks = 4096;  // as `switchyard layer`
constexpr int64_t kMaxThreads = 256;
constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
constexpr IntRange kIntRanges[] = {
    {"num_experts", 1, int64_t{1} << 20},
    {"top_k", 1, int64_t{1} << 20},
    {"expert_hidden_dim", 0, int64_t{1} << 24},
    {"steps", 0, kAny},
    {"batch_size", 1, kAny},
    {"warmup_steps", 0, kAny},
    {"log_every", 1, kAny},
    {"eval_every", 0, kAny},
    {"eval_tokens", 0, kAny},
    {"checkpoint_every", 0, kAny},
    {"keep_checkpoints", 0, kAny},
    {"sample_tokens", 0, kAny},
    {"threads", 0, kMaxThreads},
    {"trace_step", 0, kAny},
    {"ranks", 1, kMaxRanks},
    {"ep", 0, kMaxRanks},
    {"zero_stage", 0, 3},
    {"overlap_degree", 1, 1024},
    {"a2a_ranks_per_node", 0, kMaxRanks},
    {"tp", 1, kMaxRanks},
    {"etp", 1, kMaxRanks},
    {"cp", 1, kMaxRanks},
    {"microbatches", 1, int64_t{1} << 20},
    {"pp", 1, kMaxRanks},
    {"virtual_stages", 1, kMaxRanks},
    {"num_groups", 0, int64_t{1} << 20},
    {"group_topk", -1, int64_t{1} << 20},
};

// The range of every float key: finite, in [lo, hi] (hi exclusive when `open_hi`).
struct FloatRange {
  const char* key;
  double lo, hi;
  bool open_hi = false;
  const char* unit = "";
};
constexpr double kHuge = 1e30;
constexpr FloatRange kFloatRanges[] = {
    // |cf| beyond the experts of a block changes nothing; 1e6 keeps every size derived from it
    // in range.
    {"capacity_factor", -1e6, 1e6},
    {"aux_loss_coef", 0, kHuge},
    {"z_loss_coef", 0, kHuge},
    {"val_fraction", 0, 0.5},
    {"lr", 0, kHuge},
    {"min_lr", 0, kHuge},
    {"weight_decay", 0, kHuge},
    {"beta1", 0, 1, true},
    {"beta2", 0, 1, true},
    {"adam_eps", 0, kHuge},
    {"grad_clip", 0, kHuge},
    {"temperature", 0, kHuge},
    {"bucket_mb", 0, double{1 << 20}, false, " MiB"},
    {"memory_budget_mib", 0, double{1 << 30}, false, " MiB"},
    {"topk_scaling_factor", 0, kHuge},
    {"expert_bias_update_rate", -kHuge, kHuge},
};

void CheckRanges(const TrainConfig& config) {
  TrainConfig c = config;
  VisitFields(c, [](const char* key, const auto& v) {
    using T = std::decay_t<decltype(v)>;
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool> && std::is_signed_v<T>) {
      for (const IntRange& r : kIntRanges) {
        if (std::string_view(r.key) != key) continue;
        const auto x = static_cast<int64_t>(v);
        if (r.hi == kAny) {
          SY_REQUIRE(x >= r.lo, InvalidArgument, "config: '{}' must be >= {}, got {}", key, r.lo,
                     x);
        } else {
          SY_REQUIRE(x >= r.lo && x <= r.hi, InvalidArgument,
                     "config: '{}' must be in [{}, {}], got {}", key, r.lo, r.hi, x);
        }
      }
    } else if constexpr (std::is_floating_point_v<T>) {
      for (const FloatRange& r : kFloatRanges) {
        if (std::string_view(r.key) != key) continue;
        const auto x = static_cast<double>(v);
        const bool ok = std::isfinite(x) && x >= r.lo && (r.open_hi ? x < r.hi : x <= r.hi);
        if (r.hi == kHuge) {
          SY_REQUIRE(ok, InvalidArgument, "config: '{}' must be a finite number >= {}, got {}", key,
                     r.lo, x);
        } else {
          SY_REQUIRE(ok, InvalidArgument,
                     "config: '{}' must be a finite number in [{}, {}{}{}, got {}", key, r.lo, r.hi,
                     r.open_hi ? ")" : "]", r.unit, x);
        }
      }
    }
  });
  // Counts of lists: each entry as a key of its own.
  for (int64_t e : config.experts_per_block) {
    SY_REQUIRE(e >= 1 && e <= (int64_t{1} << 20), InvalidArgument,
               "config: 'experts_per_block': expected counts in [1, {}], got {}", int64_t{1} << 20,
               e);
  }
  for (int64_t b : config.pipeline_split) {
    SY_REQUIRE(b >= 1 && b <= config.model.num_layers, InvalidArgument,
               "config: 'pipeline_split': every virtual stage needs >= 1 block and at most "
               "'num_layers' {}, got {}",
               config.model.num_layers, b);
  }
}

}  // namespace

void ValidateTrainConfig(const TrainConfig& c) {
  ValidateModelConfig(c.model);
  CheckRanges(c);
  // Before anything builds the MoE layer's config from these keys.
  SY_REQUIRE(c.aux_loss.empty() || c.aux_loss == "gshard" || c.aux_loss == "gshard_all_choices" ||
                 c.aux_loss == "importance_load" || c.aux_loss == "global" || c.aux_loss == "none",
             InvalidArgument,
             "config: 'aux_loss' must be \"gshard\", \"gshard_all_choices\", \"importance_load\", "
             "\"global\" or \"none\", got \"{}\"",
             c.aux_loss);
  (void)RouterTraceOptionsFromConfig(c.router_trace, c.router_trace_steps, c.router_replay);
  if (!c.experts_per_block.empty()) {
    const int64_t blocks = NumMoeBlocks(c.model);
    SY_REQUIRE(static_cast<int64_t>(c.experts_per_block.size()) == blocks, InvalidArgument,
               "config: 'experts_per_block' has {} entries, expected one per MoE block: {} "
               "(num_layers {} / moe_every {})",
               c.experts_per_block.size(), blocks, c.model.num_layers, c.model.moe_every);
  }
  if (NumMoeBlocks(c.model) > 0) {
    // The layer computes the sequence-level loss from each token's global index; the trainer does
    // not yet hand it a sequence_length that matches its batches, nor is that path tested.
    SY_REQUIRE(MoeLayerConfig(c).aux_loss != moe::AuxLoss::kSequence, InvalidArgument,
               "config: 'moe_layer_config' {} sets aux_loss \"sequence\", which `switchyard layer` "
               "and the library run but `train` does not support yet; use another aux_loss",
               c.moe_layer_config);
  }
  SY_REQUIRE(c.temperature > 0, InvalidArgument, "config: 'temperature' must be > 0, got {}",
             c.temperature);
  SY_REQUIRE(c.out.empty() == false, InvalidArgument, "config: 'out' must not be empty");
  SY_REQUIRE(!c.tp_comm_overlap || c.sequence_parallel, InvalidArgument,
             "config: 'tp_comm_overlap' overlaps the sequence-parallel collectives: it needs "
             "'sequence_parallel' true");
  SY_REQUIRE(c.arrangement == "auto" || c.arrangement == "deepspeed" || c.arrangement == "megatron",
             InvalidArgument,
             "config: 'arrangement' must be \"auto\", \"deepspeed\" or \"megatron\", got \"{}\"",
             c.arrangement);
  if (c.tp > 1) {
    SY_REQUIRE(c.ranks % c.tp == 0, InvalidArgument,
               "config: 'tp' {} must divide 'ranks' {} (data-parallel size ranks / tp)", c.tp,
               c.ranks);
    for (const auto& [key, v] : {std::pair<const char*, int64_t>{"num_heads", c.model.num_heads},
                                 {"hidden_dim", c.model.hidden_dim},
                                 {"vocab_size", c.model.vocab_size}}) {
      SY_REQUIRE(v % c.tp == 0, InvalidArgument,
                 "config: '{}' {} does not divide by 'tp' {} (each tensor-parallel rank holds an "
                 "equal part)",
                 key, v, c.tp);
    }
  }
  SY_REQUIRE(c.cp_algo == "ring" || c.cp_algo == "ulysses", InvalidArgument,
             "config: 'cp_algo' must be \"ring\" or \"ulysses\", got \"{}\"", c.cp_algo);
  SY_REQUIRE(
      c.attention_core == "auto" || c.attention_core == "softmax" || c.attention_core == "flash",
      InvalidArgument,
      "config: 'attention_core' must be \"auto\", \"softmax\" or \"flash\", got \"{}\"",
      c.attention_core);
  if (c.cp > 1) {
    SY_REQUIRE(c.attention_core != "softmax", InvalidArgument,
               "config: 'attention_core' softmax keeps the whole [seq_len, seq_len] "
               "probabilities on one rank, which 'cp' {} splits: use \"auto\" or \"flash\"",
               c.cp);
    SY_REQUIRE(c.model.seq_len % (2 * c.cp) == 0, InvalidArgument,
               "config: 'seq_len' {} does not split over 'cp' {} ranks: the load-balanced "
               "(zigzag) split needs a multiple of 2 x cp = {}",
               c.model.seq_len, c.cp, 2 * c.cp);
    SY_REQUIRE(c.cp_algo != "ulysses" || c.model.num_heads % (c.cp * c.tp) == 0, InvalidArgument,
               "config: 'cp_algo' ulysses splits each tensor-parallel rank's heads over the cp "
               "ranks: 'num_heads' {} does not divide by 'tp' {} x 'cp' {} = {}",
               c.model.num_heads, c.tp, c.cp, c.tp * c.cp);
  }
  SY_REQUIRE(c.model.precision == Precision::kFloat32 || (c.tp == 1 && c.cp == 1), InvalidArgument,
             "config: 'precision' bf16 is not supported with 'tp' {} / 'cp' {} yet (tensor- and "
             "context-parallel layers compute in float32): use 'precision' fp32",
             c.tp, c.cp);
  SY_REQUIRE(c.model.recompute != Recompute::kSelective || c.cp == 1, InvalidArgument,
             "config: 'recompute' selective with 'cp' {}: the context-parallel attention core "
             "already recomputes its probabilities in backward; use 'recompute' none or full",
             c.cp);
  SY_REQUIRE(c.batch_size % c.microbatches == 0, InvalidArgument,
             "config: 'batch_size' {} does not divide into 'microbatches' {} equal micro-batches",
             c.batch_size, c.microbatches);
  SY_REQUIRE(c.ranks % (c.tp * c.pp) == 0, InvalidArgument,
             "config: {} must divide 'ranks' {} (data-parallel size ranks / (tp x pp))",
             c.tp == 1   ? fmt::format("'pp' {}", c.pp)
             : c.pp == 1 ? fmt::format("'tp' {}", c.tp)
                         : fmt::format("'tp' {} x 'pp' {}", c.tp, c.pp),
             c.ranks);
  SY_REQUIRE(c.ranks % (c.tp * c.pp * c.cp) == 0, InvalidArgument,
             "config: 'cp' {} x 'tp' {} x 'pp' {} must divide 'ranks' {} (data-parallel size "
             "ranks / (tp x pp x cp))",
             c.cp, c.tp, c.pp, c.ranks);
  SY_REQUIRE(c.virtual_stages == 1 || c.pipeline_schedule == "interleaved", InvalidArgument,
             "config: 'virtual_stages' {} needs 'pipeline_schedule' interleaved (got \"{}\")",
             c.virtual_stages, c.pipeline_schedule);
  SY_REQUIRE(c.pp * c.virtual_stages <= c.model.num_layers, InvalidArgument,
             "config: 'pp' {} x 'virtual_stages' {} stages need at least as many blocks, "
             "'num_layers' is {}",
             c.pp, c.virtual_stages, c.model.num_layers);
  if (!c.pipeline_split.empty()) {
    int64_t sum = 0;
    for (int64_t b : c.pipeline_split) {
      SY_REQUIRE(b >= 1, InvalidArgument,
                 "config: 'pipeline_split': every virtual stage needs >= 1 block, got {}", b);
      sum += b;
    }
    SY_REQUIRE(static_cast<int64_t>(c.pipeline_split.size()) == c.pp * c.virtual_stages &&
                   sum == c.model.num_layers,
               InvalidArgument,
               "config: 'pipeline_split' has {} counts summing to {}: expected pp x "
               "virtual_stages = {} counts summing to num_layers {}",
               c.pipeline_split.size(), sum, c.pp * c.virtual_stages, c.model.num_layers);
  }
  SY_REQUIRE(c.nonfinite == "stop" || c.nonfinite == "skip", InvalidArgument,
             "config: 'nonfinite' must be \"stop\" or \"skip\", got \"{}\"", c.nonfinite);
  // Sizes derived from these must fit: the data counters (step * batch_size + row) and the
  // tokens of a step.
  CheckedMul(c.steps + 1, c.batch_size, "config: 'steps' x 'batch_size' (data counter)");
  CheckedMul(c.batch_size, c.model.seq_len, "config: 'batch_size' x 'seq_len' (tokens per step)");
  SY_REQUIRE(c.dispatch == "alltoall" || c.dispatch == "alltoallv" || c.dispatch == "allgather",
             InvalidArgument,
             "config: 'dispatch' must be \"alltoall\", \"alltoallv\" or \"allgather\", got \"{}\"",
             c.dispatch);
  SY_REQUIRE(c.routing_scope == "global" || c.routing_scope == "per_rank", InvalidArgument,
             "config: 'routing_scope' must be \"global\" or \"per_rank\", got \"{}\"",
             c.routing_scope);
  SY_REQUIRE(c.a2a_algo == "flat" || c.a2a_algo == "2dh", InvalidArgument,
             "config: 'a2a_algo' must be \"flat\" or \"2dh\", got \"{}\"", c.a2a_algo);
  (void)AdaptiveRAtStep(c.adaptive_r, 0);  // parses every entry
  try {
    (void)parallel::SmartGroupFromString(c.smart_schedule);
    (void)parallel::ShadowFromString(c.shadow_experts);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(
        fmt::format("config: 'smart_schedule' \"{}\" / 'shadow_experts' "
                    "\"{}\": {}",
                    c.smart_schedule, c.shadow_experts, e.what()));
  }
  // Checked whether or not a pipeline runs (pp 1), so that a misspelling never passes.
  try {
    (void)parallel::ScheduleKindFromName(c.pipeline_schedule);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("config: 'pipeline_schedule': {}", e.what()));
  }
}

namespace {

// Why `key` cannot act in the run `c` describes ("" when it can).
std::string WhyKeyCannotAct(std::string_view key, const TrainConfig& c,
                            const TrainRunContext& run) {
  if (run.dense && key == "trace_step") {
    return "it records the ranks of a distributed run: use `switchyard train --ranks 1` "
           "(train-dense has no communication layer to trace)";
  }
  if (run.dense && IsLayoutKey(key) && key != "threads" && key != "attention_core" &&
      key != "memory_budget_mib") {
    return "train-dense runs one rank without the communication layer: use `switchyard train` "
           "for a parallel layout";
  }
  if ((key == "pipeline_schedule" || key == "virtual_stages" || key == "pipeline_split") &&
      c.pp == 1) {
    return "it shapes a pipeline, and 'pp' is 1";
  }
  if (key == "pp" && c.pp > 1 && c.microbatches == 1) {
    return "with 'microbatches' 1 the stages run one after another (no pipelining): set "
           "'microbatches' to at least 'pp'";
  }
  if (key == "cp_algo" && c.cp == 1) {
    return "it is the attention of context parallelism, and 'cp' is 1";
  }
  if (key == "a2a_ranks_per_node" && c.a2a_algo != "2dh") {
    return fmt::format("it sizes the nodes of the 2dh all-to-all, and 'a2a_algo' is \"{}\"",
                       c.a2a_algo);
  }
  if (key == "moe_every" && c.model.moe_every > c.model.num_layers) {
    return fmt::format("no block of 'num_layers' {} is an MoE block (the model is dense)",
                       c.model.num_layers);
  }
  if (key == "trace_step" && c.trace_step > c.steps) {
    return fmt::format("the run ends at step {} ('steps')", c.steps);
  }
  const bool moe_exchange = key == "overlap_degree" || key == "shadow_experts" ||
                            key == "smart_schedule" || key == "a2a_algo";
  if (moe_exchange && NumMoeBlocks(c.model) == 0) return "the model has no MoE blocks";
  if (moe_exchange && (run.dense || TrainExpertParallelSize(c, static_cast<int>(c.ranks)) == 1)) {
    return "the MoE blocks exchange no tokens with an expert-parallel size of 1";
  }
  if (key == "a2a_algo" && run.ranks_are_threads && c.a2a_ranks_per_node == 0) {
    return "the ranks are threads of one process (one node), where 2dh is the flat exchange plus "
           "copies: set 'a2a_ranks_per_node' to emulate nodes";
  }
  return "";
}

}  // namespace

std::vector<std::string> ValidateTrainConfig(const ResolvedTrainConfig& resolved,
                                             const TrainRunContext& run) {
  SY_REQUIRE(!run.resume_flag_empty, InvalidArgument,
             "--resume is empty: give a checkpoint, checkpoints or run directory, or leave the "
             "flag out for a fresh run");
  const TrainConfig& c = resolved.config;
  const json mine = json::parse(TrainConfigToJson(c));
  const json defaults = json::parse(TrainConfigToJson(TrainConfig{}));
  for (const auto& [key, source] : resolved.explicit_keys) {
    if (!source.starts_with("--")) continue;  // the checkpoint's or the MoE layer file's
    const bool flag = !source.starts_with("--config ");
    const json& value = mine.at(key);
    SY_REQUIRE(!(flag && value.is_string() && value.get<std::string>().empty()), InvalidArgument,
               "{} is empty: leave the flag out for the default", source);
  }
  ValidateTrainConfig(c);
  // Ranks as threads each start their compute threads in this one process.
  SY_REQUIRE(run.dense || !run.ranks_are_threads || c.threads * c.ranks <= kMaxRanks,
             InvalidArgument,
             "config: 'threads' {} x 'ranks' {} = {} compute threads in this process: at most {}",
             c.threads, c.ranks, c.threads * c.ranks, kMaxRanks);
  std::vector<std::string> notices;
  for (const auto& [key, source] : resolved.explicit_keys) {
    if (!source.starts_with("--")) continue;
    const std::string why = WhyKeyCannotAct(key, c, run);
    if (why.empty()) continue;
    const json& value = mine.at(key);
    const bool harmless =
        value == defaults.at(key) || (run.dense && (key == "ranks" || key == "ep") && value == 1);
    SY_REQUIRE(harmless, InvalidArgument, "config: '{}' {} ({}) cannot act: {}", key, value.dump(),
               source, why);
    if (!source.starts_with("--config ")) {
      notices.push_back(
          fmt::format("note: '{}' {} ({}) has no effect: {}", key, value.dump(), source, why));
    }
  }
  return notices;
}

}  // namespace switchyard::train
