// ValidateTrainConfig: every check of a run's keys, in one place (config.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
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

// The range of every number key (config_keys.def's values column), checked on the full 64-bit
// value before anything narrows it (the layout sizes become `int`: a value such as 2^32 + 1
// would wrap to 1); every float key must be finite. Keys without a range there are checked by
// ValidateModelConfig or below. Choice keys must hold one of their names.
void CheckRanges(const TrainConfig& config) {
  VisitFields(config, [](const ConfigKeyInfo& info, const auto& v) {
    using T = std::decay_t<decltype(v)>;
    const char* key = info.name;
    const KeyValues& r = info.values;
    if constexpr (config_keys::IsChoice<T>::value) {
      SY_REQUIRE(v.valid(), InvalidArgument, "config: '{}' must be {}, got \"{}\"", key,
                 ChoiceNamesText<typename T::Enum>(), v.name());
    } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool> && std::is_signed_v<T>) {
      if (!r.ranged) return;
      const auto x = static_cast<int64_t>(v);
      if (r.int_hi == config_keys::kNoIntBound) {
        SY_REQUIRE(x >= r.int_lo, InvalidArgument, "config: '{}' must be >= {}, got {}", key,
                   r.int_lo, x);
      } else {
        SY_REQUIRE(x >= r.int_lo && x <= r.int_hi, InvalidArgument,
                   "config: '{}' must be in [{}, {}], got {}", key, r.int_lo, r.int_hi, x);
      }
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!r.ranged) return;
      const auto x = static_cast<double>(v);
      const bool ok =
          std::isfinite(x) && x >= r.float_lo && (r.open_hi ? x < r.float_hi : x <= r.float_hi);
      if (r.float_hi == config_keys::kNoFloatBound) {
        SY_REQUIRE(ok, InvalidArgument, "config: '{}' must be a finite number >= {}, got {}", key,
                   r.float_lo, x);
      } else {
        SY_REQUIRE(ok, InvalidArgument,
                   "config: '{}' must be a finite number in [{}, {}{}{}, got {}", key, r.float_lo,
                   r.float_hi, r.open_hi ? ")" : "]", r.unit, x);
      }
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      // Counts of lists: each entry as a key of its own.
      if (!r.ranged) return;
      for (int64_t e : v) {
        SY_REQUIRE(e >= r.int_lo && e <= r.int_hi, InvalidArgument,
                   "config: '{}': expected counts in [{}, {}], got {}", key, r.int_lo, r.int_hi, e);
      }
    }
  });
  for (int64_t b : config.pipeline_split) {
    SY_REQUIRE(b >= 1 && b <= config.model.num_layers, InvalidArgument,
               "config: 'pipeline_split': every virtual stage needs >= 1 block and at most "
               "'num_layers' {}, got {}",
               config.model.num_layers, b);
  }
}

}  // namespace

ResolvedLayout ResolveLayout(const TrainConfig& c, int world_size) {
  SY_REQUIRE(world_size >= 1, InvalidArgument, "ranks: expected >= 1, got {}", world_size);
  SY_REQUIRE(c.tp >= 1 && c.pp >= 1 && c.cp >= 1 && c.etp >= 1 && c.ep >= 0, InvalidArgument,
             "config: 'tp' {}, 'pp' {}, 'cp' {} and 'etp' {} must be >= 1, 'ep' {} >= 0", c.tp,
             c.pp, c.cp, c.etp, c.ep);
  // The rule "tp x pp x cp divides the ranks", here only.
  SY_REQUIRE(world_size % (c.tp * c.pp) == 0, InvalidArgument,
             "config: {} must divide 'ranks' {} (data-parallel size ranks / (tp x pp))",
             c.tp == 1   ? fmt::format("'pp' {}", c.pp)
             : c.pp == 1 ? fmt::format("'tp' {}", c.tp)
                         : fmt::format("'tp' {} x 'pp' {}", c.tp, c.pp),
             world_size);
  SY_REQUIRE(world_size % (c.tp * c.pp * c.cp) == 0, InvalidArgument,
             "config: 'cp' {} x 'tp' {} x 'pp' {} must divide 'ranks' {} (data-parallel size "
             "ranks / (tp x pp x cp))",
             c.cp, c.tp, c.pp, world_size);
  ResolvedLayout l;
  l.world_size = world_size;
  l.tp = static_cast<int>(c.tp);
  l.pp = static_cast<int>(c.pp);
  l.cp = static_cast<int>(c.cp);
  l.etp = static_cast<int>(c.etp);
  l.dp = world_size / (l.tp * l.pp * l.cp);
  switch (c.arrangement.value()) {
    case ArrangementChoice::kAuto:
      l.arrangement = c.sequence_parallel ? parallel::Arrangement::kMegatron
                                          : parallel::Arrangement::kDeepSpeed;
      break;
    case ArrangementChoice::kDeepSpeed: l.arrangement = parallel::Arrangement::kDeepSpeed; break;
    case ArrangementChoice::kMegatron: l.arrangement = parallel::Arrangement::kMegatron; break;
  }
  // ep 0: as large as the arrangement allows (DeepSpeed's EP groups sit inside the data-parallel
  // ranks of each tp rank, Megatron's fold over all ranks of the etp groups); the mesh's rule.
  parallel::MeshConfig degrees;
  degrees.world_size = world_size;
  degrees.tp = l.tp;
  degrees.pp = l.pp;
  degrees.etp = l.etp;
  degrees.ep = static_cast<int>(c.ep);
  degrees.arrangement = l.arrangement;
  // ep 0 with num_experts that do not fit the ranks (6 experts, 4 ranks): the largest ep
  // dividing both (ValidateExpertLayout checks num_experts against it).
  degrees.num_experts = c.model.moe_every > 0 ? c.num_experts : 0;
  l.ep = parallel::ResolvedExpertParallel(degrees);
  // The H-shards per expert: Megatron's 'etp'; DeepSpeed splits each of the first MoE block's E
  // experts over ep / E ranks when E < ep (ValidateExpertLayout checks that E and ep fit).
  l.expert_shards = l.etp;
  if (l.arrangement == parallel::Arrangement::kDeepSpeed) {
    const int64_t e = c.model.moe_every > 0 ? BlockExperts(c, c.model.moe_every - 1) : l.ep;
    l.expert_shards = e >= 1 && e < l.ep && l.ep % e == 0 ? static_cast<int>(l.ep / e) : 1;
  }
  l.attention_core = c.attention_core != AttentionCore::kAuto ? c.attention_core.value()
                     : c.cp > 1                               ? AttentionCore::kFlash
                                                              : AttentionCore::kSoftmax;
  return l;
}

void ValidateExpertLayout(const TrainConfig& config, const ResolvedLayout& layout) {
  const int ep = layout.ep, world_size = layout.world_size;
  SY_REQUIRE(layout.arrangement == parallel::Arrangement::kMegatron || config.etp == 1,
             InvalidArgument,
             "config: 'etp' {}: expert tensor parallelism is Megatron's folding ('arrangement' "
             "megatron); the DeepSpeed arrangement shards experts along H only when "
             "'num_experts' < 'ep'",
             config.etp);
  SY_REQUIRE(world_size % ep == 0, InvalidArgument,
             "config: 'ep' {} must divide the number of ranks {}", ep, world_size);
  const int64_t e = config.num_experts;
  SY_REQUIRE(e % ep == 0 || ep % e == 0, InvalidArgument,
             "config: 'num_experts' {} and 'ep' {}: one must divide the other (E / ep experts per "
             "rank, or each expert split over ep / E ranks)",
             e, ep);
  // Every MoE block shares the run's process groups: each block's experts must split over the
  // ep ranks the same way (as many H-shards per expert: 1 when E >= ep, else ep / E).
  auto shards = [ep](int64_t experts) { return experts >= ep ? int64_t{1} : ep / experts; };
  for (int64_t block : config.experts_per_block) {
    SY_REQUIRE((block % ep == 0 || ep % block == 0) &&
                   shards(block) == shards(config.experts_per_block.front()),
               InvalidArgument,
               "config: 'experts_per_block' {} with 'ep' {}: every MoE block must split its "
               "experts over the ep ranks the same way (every count a multiple of ep, or every "
               "count the same divisor of ep)",
               fmt::format("[{}]", fmt::join(config.experts_per_block, ", ")), ep);
  }
  SY_REQUIRE(
      config.a2a_algo != A2aAlgo::k2dh || config.dispatch == parallel::DispatchKind::kAllToAll,
      InvalidArgument,
      "config: 'a2a_algo' 2dh is the fixed-capacity all-to-all's: it needs 'dispatch' "
      "alltoall, got \"{}\"",
      config.dispatch);
  // The a2a-FFN pipeline splits the exchanged tokens into chunks; the all-gather dispatcher
  // exchanges none (the MoE layer refuses the pair when it is built: say so before the run).
  SY_REQUIRE(config.overlap_degree == 1 || config.dispatch != parallel::DispatchKind::kAllGather,
             InvalidArgument,
             "config: 'overlap_degree' {} pipelines the all-to-all with the experts: it needs "
             "'dispatch' alltoall or alltoallv, got \"allgather\"",
             config.overlap_degree);
}

void ValidateAdaptiveR(const TrainConfig& config, const ResolvedLayout& layout) {
  const int shards = layout.expert_shards;
  const auto entries =
      static_cast<int64_t>(std::count(config.adaptive_r.begin(), config.adaptive_r.end(), ',') + 1);
  for (int64_t s = 0; s < entries; ++s) {
    const int r = AdaptiveRAtStep(config.adaptive_r, s);
    SY_REQUIRE(r < 0 || r == 0 || shards % r == 0, InvalidArgument,
               "config: 'adaptive_r' \"{}\": r = {} is neither 0 nor a divisor of the {} "
               "H-shard(s) of each expert (ep / num_experts when the experts are fewer than "
               "the ep ranks, else 1)",
               config.adaptive_r, r, shards);
  }
}

void ValidateTrainConfig(const TrainConfig& c) {
  ValidateModelConfig(c.model);
  CheckRanges(c);
  // Before anything builds the MoE layer's config from these keys.
  SY_REQUIRE(c.aux_loss == "gshard" || c.aux_loss == "gshard_all_choices" ||
                 c.aux_loss == "importance_load" || c.aux_loss == "global" ||
                 c.aux_loss == "sequence" || c.aux_loss == "hf_concat" || c.aux_loss == "none",
             InvalidArgument,
             "config: 'aux_loss' must be \"gshard\", \"gshard_all_choices\", \"importance_load\", "
             "\"global\", \"sequence\", \"hf_concat\" or \"none\", got \"{}\"",
             c.aux_loss);
  // One loss over every MoE block's router rows: each row has the same E columns.
  SY_REQUIRE(c.aux_loss != "hf_concat" || c.experts_per_block.empty(), InvalidArgument,
             "config: 'aux_loss' hf_concat concatenates the router rows of every MoE block, which "
             "needs num_experts in each: leave 'experts_per_block' unset");
  (void)RouterTraceOptionsFromConfig(c.router_trace, c.router_trace_steps, c.router_replay);
  // The sequence loss needs whole sequences in every MoE call; sampling feeds the model a growing
  // context (moe/losses.cc refuses a batch that is not whole sequences).
  SY_REQUIRE(c.aux_loss != "sequence" || c.sample_tokens == 0, InvalidArgument,
             "config: 'aux_loss' \"sequence\" (from the flags, the config or 'moe_layer_config' "
             "{}) needs whole sequences of 'seq_len' tokens in every MoE call, and the samples "
             "('sample_tokens' {}) feed a growing context: set 'sample_tokens' 0",
             c.moe_layer_config.empty() ? "(none)" : c.moe_layer_config, c.sample_tokens);
  if (!c.experts_per_block.empty()) {
    const int64_t blocks = NumMoeBlocks(c.model);
    SY_REQUIRE(static_cast<int64_t>(c.experts_per_block.size()) == blocks, InvalidArgument,
               "config: 'experts_per_block' has {} entries, expected one per MoE block: {} "
               "(num_layers {} / moe_every {})",
               c.experts_per_block.size(), blocks, c.model.num_layers, c.model.moe_every);
  }
  SY_REQUIRE(c.temperature > 0, InvalidArgument, "config: 'temperature' must be > 0, got {}",
             c.temperature);
  SY_REQUIRE(c.out.empty() == false, InvalidArgument, "config: 'out' must not be empty");
  SY_REQUIRE(c.data_format == "auto" || c.data_format == "text" || c.data_format == "megatron" ||
                 c.data_format == "nanogpt" || c.data_format == "llmc",
             InvalidArgument,
             "config: 'data_format' must be \"auto\", \"text\", \"megatron\", \"nanogpt\" or "
             "\"llmc\", got \"{}\"",
             c.data_format);
  SY_REQUIRE(!c.tokenizer.empty(), InvalidArgument,
             "config: 'tokenizer' must be \"bytes\" or a SentencePiece model file, got \"\"");
  SY_REQUIRE(!c.tp_comm_overlap || c.sequence_parallel, InvalidArgument,
             "config: 'tp_comm_overlap' overlaps the sequence-parallel collectives: it needs "
             "'sequence_parallel' true");
  // The overlap rings exist for GPT-2's attention and GELU MLP only (tensor_parallel_gqa.cc): a
  // layout the planner proposes is refused here, not when the model is built.
  const bool swiglu_mlp =
      c.model.mlp == MlpKind::kSwiGlu && NumMoeBlocks(c.model) < c.model.num_layers;
  SY_REQUIRE(c.tp == 1 || !c.tp_comm_overlap || (!UsesGqaAttention(c.model) && !swiglu_mlp),
             InvalidArgument,
             "config: 'tp_comm_overlap' is not supported with {} (arch {}): use "
             "'tp_comm_overlap' false, or arch gpt",
             swiglu_mlp && !UsesGqaAttention(c.model) ? "the SwiGLU MLP"
                                                      : "grouped-query attention (RoPE, kv heads, "
                                                        "q/k/v biases or QK-norm)",
             ChoiceTraits<Arch>::Name(c.arch));
  // The layout sizes are in range (CheckRanges): tp x pp x cp divides ranks (ResolveLayout).
  (void)ResolveLayout(c, static_cast<int>(c.ranks));
  // The MoE layer's options: the file's, the run's keys over them, router_group_by's groups and
  // aux_loss sequence's length.
  if (NumMoeBlocks(c.model) > 0) (void)MoeLayerConfig(c);
  if (c.tp > 1) {
    for (const auto& [key, v] : {std::pair<const char*, int64_t>{"num_heads", c.model.num_heads},
                                 {"hidden_dim", c.model.hidden_dim},
                                 {"vocab_size", c.model.vocab_size}}) {
      SY_REQUIRE(v % c.tp == 0, InvalidArgument,
                 "config: '{}' {} does not divide by 'tp' {} (each tensor-parallel rank holds an "
                 "equal part)",
                 key, v, c.tp);
    }
  }
  if (c.cp > 1) {
    SY_REQUIRE(c.attention_core != AttentionCore::kSoftmax, InvalidArgument,
               "config: 'attention_core' softmax keeps the whole [seq_len, seq_len] "
               "probabilities on one rank, which 'cp' {} splits: use \"auto\" or \"flash\"",
               c.cp);
    SY_REQUIRE(c.model.seq_len % (2 * c.cp) == 0, InvalidArgument,
               "config: 'seq_len' {} does not split over 'cp' {} ranks: the load-balanced "
               "(zigzag) split needs a multiple of 2 x cp = {}",
               c.model.seq_len, c.cp, 2 * c.cp);
    SY_REQUIRE(c.cp_algo != CpAlgorithm::kUlysses || c.model.num_heads % (c.cp * c.tp) == 0,
               InvalidArgument,
               "config: 'cp_algo' ulysses splits each tensor-parallel rank's heads over the cp "
               "ranks: 'num_heads' {} does not divide by 'tp' {} x 'cp' {} = {}",
               c.model.num_heads, c.tp, c.cp, c.tp * c.cp);
  }
  SY_REQUIRE(c.model.precision == Precision::kFloat32 || c.cp == 1, InvalidArgument,
             "config: 'precision' bf16 is not supported with 'cp' {} yet (the context-parallel "
             "attention core computes in float32): use 'precision' fp32",
             c.cp);
  SY_REQUIRE(c.model.precision == Precision::kFloat32 || !c.tp_comm_overlap, InvalidArgument,
             "config: 'precision' bf16 with 'tp_comm_overlap': the overlap rings run float32 "
             "GEMMs only; use 'precision' fp32 or 'tp_comm_overlap' false");
  SY_REQUIRE(c.model.recompute != Recompute::kSelective || c.cp == 1, InvalidArgument,
             "config: 'recompute' selective with 'cp' {}: the context-parallel attention core "
             "already recomputes its probabilities in backward; use 'recompute' none or full",
             c.cp);
  SY_REQUIRE(c.eval_tokens == 0 || c.eval_tokens >= c.model.seq_len, InvalidArgument,
             "config: 'eval_tokens' {} is less than one evaluation window of seq_len {} tokens "
             "(0: all held-out tokens)",
             c.eval_tokens, c.model.seq_len);
  SY_REQUIRE(c.batch_size % c.microbatches == 0, InvalidArgument,
             "config: 'batch_size' {} does not divide into 'microbatches' {} equal micro-batches",
             c.batch_size, c.microbatches);
  SY_REQUIRE(
      c.virtual_stages == 1 || c.pipeline_schedule == parallel::ScheduleKind::kInterleaved1F1B,
      InvalidArgument,
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
  // Sizes derived from these must fit: the data counters (step * batch_size + row) and the
  // tokens of a step.
  CheckedMul(c.steps + 1, c.batch_size, "config: 'steps' x 'batch_size' (data counter)");
  CheckedMul(c.batch_size, c.model.seq_len, "config: 'batch_size' x 'seq_len' (tokens per step)");
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
}

void ValidateBatchSplit(const TrainConfig& c, int64_t data_shards, int64_t tp_size,
                        bool sequence_parallel) {
  // Every data-parallel rank's part of every micro-batch: at least one row, and with sequence
  // parallelism tokens that split evenly over the tensor-parallel ranks.
  SY_REQUIRE(c.batch_size >= data_shards, InvalidArgument,
             "config: batch_size {} must be >= the number of data-parallel ranks {}", c.batch_size,
             data_shards);
  const int64_t shards = data_shards, rows = c.batch_size / c.microbatches;
  SY_REQUIRE(rows >= shards, InvalidArgument,
             "config: a micro-batch of batch_size {} / microbatches {} = {} rows cannot be split "
             "over {} data-parallel ranks",
             c.batch_size, c.microbatches, rows, shards);
  const int64_t p = tp_size;
  // With context parallelism a rank holds seq_len / cp positions of each sequence.
  const int64_t positions = c.model.seq_len / std::max<int64_t>(1, c.cp);
  for (int64_t d = 0; sequence_parallel && d < shards; ++d) {
    const int64_t mine = rows * (d + 1) / shards - rows * d / shards;
    SY_REQUIRE(mine * positions % p == 0, InvalidArgument,
               "config: sequence parallelism splits each data-parallel rank's tokens over 'tp' "
               "{} ranks, but data-parallel rank {} has {} rows x seq_len {}{} = {} tokens per "
               "micro-batch: choose batch_size (split over {} micro-batches and {} "
               "data-parallel ranks) and seq_len so that they divide",
               p, d, mine, c.model.seq_len,
               c.cp > 1 ? fmt::format(" / cp {}", c.cp) : std::string(), mine * positions,
               c.microbatches, shards);
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
  if (key == "a2a_ranks_per_node" && c.a2a_algo != A2aAlgo::k2dh &&
      c.router_group_by != RouterGroupBy::kNode) {
    return fmt::format(
        "it sizes the nodes of the 2dh all-to-all and of 'router_group_by' node, and "
        "'a2a_algo' is \"{}\", 'router_group_by' \"{}\"",
        c.a2a_algo, c.router_group_by);
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
  // The balancing loss is the MoE router's: a dense model has no router to balance.
  if (key == "aux_loss" && (run.dense || NumMoeBlocks(c.model) == 0)) {
    return "the model has no MoE blocks (no router to balance)";
  }
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
    // A flag's source is "--<key>"; "--config F", "--init-from P" and "--upcycle-from P" are
    // files, whose empty strings are values (a checkpoint's moe_layer_config "").
    const bool flag = source == "--" + key;
    const json& value = mine.at(key);
    SY_REQUIRE(!(flag && value.is_string() && value.get<std::string>().empty()), InvalidArgument,
               "{} is empty: leave the flag out for the default", source);
  }
  ValidateTrainConfig(c);
  // Ranks as threads each start their compute threads in this one process.
  SY_REQUIRE(run.dense || !run.ranks_are_threads || c.threads * c.ranks <= config_keys::kMaxRanks,
             InvalidArgument,
             "config: 'threads' {} x 'ranks' {} = {} compute threads in this process: at most {}",
             c.threads, c.ranks, c.threads * c.ranks, config_keys::kMaxRanks);
  if (!run.dense) {
    // The experts against the layout, before anything is written (the trainer's own checks
    // repeat these for library callers; one rank alone has no expert layout).
    const ResolvedLayout layout = ResolveLayout(c, static_cast<int>(c.ranks));
    ValidateExpertLayout(c, layout);
    if (NumMoeBlocks(c.model) > 0) ValidateAdaptiveR(c, layout);
  }
  std::vector<std::string> notices;
  for (const auto& [key, source] : resolved.explicit_keys) {
    // What the user typed; a checkpoint's or an --init-from / --upcycle-from source's recorded
    // values (a dense model's 'aux_loss', say) are the model's, not a request.
    if (!source.starts_with("--") || source.starts_with("--init-from ") ||
        source.starts_with("--upcycle-from ")) {
      continue;
    }
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
