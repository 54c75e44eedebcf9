// The options of a training run (TrainConfig): one flat set of keys that are at once the fields,
// the keys of config.json / --config files and the command-line flags (--model_dim, --steps, ...).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/moe/config.h"
#include "switchyard/train/model.h"

namespace switchyard::train {

// Every option of a run. The JSON keys (TrainConfigToJson) are the field names, which are also
// the command-line flags (--model_dim, --steps, ...).
struct TrainConfig {
  ModelConfig model;

  // MoE blocks (model.moe_every > 0), built by the MoE FFN factory.
  int64_t num_experts = 4;
  // PR-MoE's pyramid (DeepSpeed): the experts of each MoE block in block order, e.g. [4, 8];
  // empty: num_experts in every MoE block. One count per MoE block (num_layers / moe_every).
  // As a flag: --experts_per_block 4,8.
  std::vector<int64_t> experts_per_block;
  int64_t top_k = 2;
  double capacity_factor = 1.25;
  int64_t expert_hidden_dim = 0;  // 0: model.hidden_dim
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.0;
  // A layer.json (moe/config.h) with every other MoE option (preset, drop policy, noise, ...).
  // MoeLayerConfig() puts the keys above over its values; ResolveTrainConfig() first takes the
  // file's values for the keys the user did not set (explicit values win over defaults).
  // "": the moe::LayerConfig defaults.
  std::string moe_layer_config;
  // The MoE layer's check_finite (moe/config.h): a non-finite value in an MoE block's input
  // stops the step with an error naming it.
  bool check_finite = false;
  // How an MoE block decides capacity, drops and the balancing losses: "global" (over the whole
  // batch: W ranks equal one rank) or "per_rank" (Tutel's and DeepSpeed's: over each data-
  // parallel rank's own tokens; W data-parallel ranks equal one rank with microbatches = W).
  std::string routing_scope = "global";
  // The Megatron-Core / DeepSeek-V3 router keys of the MoE layer (docs/moe.md), over the
  // moe_layer_config file's values when set; unset (0, -1, "", negative) keeps the file's value or
  // the layer's default.
  int64_t num_groups = 0;               // experts in this many groups (0: unset)
  int64_t group_topk = -1;              // the best groups a token may use (-1: unset; 0: off)
  double topk_scaling_factor = 0;       // routed scaling (0: unset)
  std::string aux_loss;                 // gshard | ... | global | none ("": unset)
  double expert_bias_update_rate = -1;  // aux-loss-free bias rate (negative: unset)
  // Router trace and replay (docs/observability.md); "": none.
  std::string router_trace;        // record the MoE layers' routes into this directory
  std::string router_trace_steps;  // steps to record: "1,100,1000" or "every:N"; "": every step
  std::string router_replay;       // force the routes recorded in this directory

  // Data.
  // Training text: files and directories (every regular file in a directory, sorted; ".dat"
  // indexes and symlinks skipped), comma-separated; "" = the fortunes corpus (kFortunesDir).
  std::string data;
  // Held-out text for the validation loss, in the same form; "" = every k-th record of `data`
  // (val_fraction). When set, all of `data` trains and val_fraction is not used.
  std::string val_data;
  double val_fraction = 0.1;

  // Optimization.
  int64_t steps = 1000;
  int64_t batch_size = 32;  // sequences per step (global, over all ranks)
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 50;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;  // max global gradient norm; 0 disables
  // A step whose loss or gradient norm is not finite: "stop" ends the run with an error naming
  // the step (the update is not applied; the last completed step is saved); "skip" does not
  // apply that step's update and counts it (metrics' skipped_steps, summary.json).
  std::string nonfinite = "stop";
  uint64_t seed = 1;

  // Run directory.
  std::string out = "runs/train";
  int64_t log_every = 10;          // metrics line every N steps
  int64_t eval_every = 100;        // validation loss every N steps (and at the end); 0: end only
  int64_t eval_tokens = 0;         // held-out tokens per evaluation; 0: all
  int64_t checkpoint_every = 500;  // 0: at the end only
  int64_t keep_checkpoints = 2;    // 0: keep all
  int64_t sample_tokens = 400;     // generated at the end; 0: none
  double temperature = 0.8;
  int threads = 0;  // compute threads of this rank; 0: the policy of core/threading.h
  // > 0: a Chrome trace-event timeline of step trace_step (1-based, as the metrics' step), every
  // rank's compute and communication, written to <out>/trace.json (switchyard trace-svg draws it).
  int64_t trace_step = 0;

  // Parallel layout (switchyard train; train/distributed.h). A checkpoint does not depend on it:
  // a run may resume under another layout.
  int64_t ranks = 4;                  // ranks as threads of this process (under mpirun: its world)
  int64_t ep = 0;                     // expert-parallel size (0: ranks)
  int64_t zero_stage = 0;             // ZeRO stage 0-3 of the optimizer
  std::string dispatch = "alltoall";  // alltoall | alltoallv | allgather
  int64_t overlap_degree = 1;         // Tutel's a2a-FFN overlap degree D of the MoE blocks
  // Data-parallel gradient reduction (docs/training.md, "Memory and overlap"): a block's buckets
  // are reduced while the backward goes on (asynchronous collectives); buckets of at most about
  // bucket_mb MiB of float32 gradients (0: one per block and one for the rest).
  bool overlap_grad_reduce = true;
  double bucket_mb = 25;
  // Tutel's adaptive r of the MoE blocks (experts split into H-shards when ep > num_experts):
  // "default" (r = 1, Megatron arrangement r = shards), "auto" (the cheapest by the volume
  // model), an integer r (0, or a divisor of the shards) or a list "r0,r1,..." used in turn, one
  // entry per step (step s takes entry s % length). Results do not depend on it.
  std::string adaptive_r = "default";
  // The token all-to-all of the MoE blocks: "flat" or "2dh" (Tutel's two-dimensional
  // hierarchical all-to-all over nodes of a2a_ranks_per_node ranks; 0: the ranks the machine
  // puts on one node).
  std::string a2a_algo = "flat";
  int64_t a2a_ranks_per_node = 0;
  // FasterMoE's smart schedule of the MoE blocks: "off", "auto" or a group size g.
  std::string smart_schedule = "off";
  // FasterMoE's shadow experts: "none", "auto" or a list of expert indices "0,3".
  std::string shadow_experts = "none";
  // Tensor parallelism (docs/tensor_parallel.md): the dense layers split over tp ranks (the data-
  // parallel size is ranks / tp); tp must divide ranks, num_heads, hidden_dim and vocab_size.
  int64_t tp = 1;
  // Norms and the residual stream sharded along the sequence over the tp ranks (all-gather and
  // reduce-scatter instead of all-reduce); each data-parallel rank's tokens must divide by tp.
  bool sequence_parallel = false;
  // With sequence_parallel: those collectives as rings overlapped with the GEMMs.
  bool tp_comm_overlap = false;
  // How the MoE blocks' experts sit beside tp (parallel/mesh.h): "deepspeed" (expert groups
  // inside the data-parallel ranks, tokens de-duplicated over tp), "megatron" (expert-TP x EP x
  // expert-DP folded over all ranks; sequence-parallel tokens) or "auto" (megatron with
  // sequence_parallel, else deepspeed).
  std::string arrangement = "auto";
  int64_t etp = 1;  // Megatron arrangement: each expert's hidden dimension split over etp ranks
  // Context parallelism (docs/context_parallel.md): each sequence's positions split over cp ranks
  // (zigzag: seq_len must divide by 2 cp), attention across them by cp_algo ring | ulysses
  // (num_heads divisible by tp x cp). Composes with tp (each tp rank's heads), sequence_parallel,
  // pp, dp and MoE blocks.
  int64_t cp = 1;
  std::string cp_algo = "ring";
  // The attention core: "softmax" keeps the [seq_len, seq_len] probabilities of every head for
  // backward (CausalAttentionForward), "flash" only a log-sum-exp per row and recomputes them
  // (the core of train/context_parallel.h, the one cp > 1 runs); "auto": softmax at cp 1.
  std::string attention_core = "auto";
  // MiB: a layout whose per-rank memory estimate (RankMemoryEstimate) exceeds it is refused
  // before anything is allocated (InvalidArgument naming both); 0: no budget.
  double memory_budget_mib = 0;
  // Gradient accumulation: each step's batch in this many micro-batches (forward and backward
  // each, gradients summed). Micro-batch k is rows [k B / m, (k + 1) B / m) of the global batch
  // (B = batch_size), split over the data-parallel ranks; batch_size must divide by it. An MoE
  // block routes each micro-batch on its own (capacity and losses per micro-batch).
  int64_t microbatches = 1;
  // Pipeline parallelism (docs/pipeline.md): the blocks split over pp stages (ranks / (tp * pp)
  // data-parallel ranks), run by a schedule of micro-batches.
  int64_t pp = 1;
  std::string pipeline_schedule = "1f1b";  // fthenb | 1f1b | interleaved | zb-h1
  int64_t virtual_stages = 1;              // model chunks per stage (interleaved)
  // Blocks of each virtual stage, in order (pp * virtual_stages counts summing to num_layers);
  // empty: as even as possible (the first num_layers % (pp * v) stages one block more).
  std::vector<int64_t> pipeline_split;
};

// Flat JSON object with every key.
std::string TrainConfigToJson(const TrainConfig& config);
// Overrides `base` with the keys of a JSON object; an unknown key or a value of the wrong type
// throws InvalidArgument naming the key ("config: key 'steps': expected an integer, got ...").
TrainConfig TrainConfigFromJson(std::string_view json_text, const TrainConfig& base = {});
// `text` as a JSON value (JSON text) that any bytes survive: a JSON string when it is valid
// UTF-8, else {"hex": "<its bytes in hex>"} (a path may hold any byte but NUL; a JSON string
// only UTF-8). TrainConfigToJson writes string keys so and TrainConfigFromJson reads both forms
// (docs/formats.md).
std::string StringToJsonValue(const std::string& text);

// Checks values (InvalidArgument naming the key and the value given). Every integer key is
// range-checked as the full 64-bit value before anything narrows it (ranks, tp, pp, cp, ep, etp,
// virtual_stages, a2a_ranks_per_node, overlap_degree, threads, ... become `int`), every float key
// must be finite and in its range, and choice keys are checked by name whether or not they act.
void ValidateTrainConfig(const TrainConfig& config);

// The MoE layer options of the config's MoE blocks (model_dim, hidden_dim = expert_hidden_dim or
// hidden_dim, num_experts, top_k, capacity_factor, coefficients, activation, seed), on top of
// moe_layer_config's file when given. Throws InvalidArgument / IoError.
moe::LayerConfig MoeLayerConfig(const TrainConfig& config);
// The number of MoE blocks of the model (num_layers / moe_every; 0 for a dense model).
int64_t NumMoeBlocks(const ModelConfig& model);
// The experts of the MoE block at transformer block `block` (experts_per_block's entry for it,
// else num_experts).
int64_t BlockExperts(const TrainConfig& config, int64_t block);
// MoeLayerConfig with that block's number of experts.
moe::LayerConfig MoeBlockLayerConfig(const TrainConfig& config, int64_t block);

// Where a run's configuration comes from, lowest precedence first: the command's defaults, the
// checkpoint being resumed (every key but the layout and `out`), the --config file, the flags;
// then the moe_layer_config file for the MoE keys no source above set explicitly.
struct TrainConfigSources {
  TrainConfig defaults;
  std::string config_file;                   // "": none
  std::map<std::string, std::string> flags;  // key -> command-line text
  std::string resume;                        // "": a fresh run
};
struct ResolvedTrainConfig {
  TrainConfig config;
  // key -> where its explicit value came from ("--top_k", "--config run.json",
  // "checkpoint runs/a/checkpoints/step_00000002").
  std::map<std::string, std::string> explicit_keys;
  bool out_given = false;  // `out` came from a flag or the --config file
};
// Resolves the sources. Throws InvalidArgument naming both sources when two explicit values of
// one key disagree (a flag or the --config file against the moe_layer_config file), and listing
// every key a flag or the --config file sets differently from the resumed checkpoint's model
// (ResumeMustMatchKeys). IoError for unreadable files.
ResolvedTrainConfig ResolveTrainConfig(const TrainConfigSources& sources);

// Where a run runs, for the checks of the keys set explicitly (ValidateTrainConfig below).
struct TrainRunContext {
  bool dense = false;              // train-dense: one rank without the communication layer
  bool ranks_are_threads = true;   // the ranks are threads of one process (one node)
  bool resume_flag_empty = false;  // --resume was given as ""
};
// ValidateTrainConfig(resolved.config), then every key set explicitly by a flag or the --config
// file (ResolvedTrainConfig::explicit_keys) that cannot act in the run's layout: a value other
// than the key's default is an InvalidArgument naming the key, the value and why (e.g.
// 'pipeline_schedule' at pp 1, 'cp_algo' at cp 1, 'overlap_degree' where no tokens are
// exchanged, 'trace_step' after the last step, 'tp' for train-dense); the default value is no
// error and comes back as a notice to print. A flag given an empty path ("--data ''") is an
// error. Also refuses what would fail only inside the first step (cp with drop_policy random).
std::vector<std::string> ValidateTrainConfig(const ResolvedTrainConfig& resolved,
                                             const TrainRunContext& run);

// The keys a resumed run must share with its checkpoint (model shape, MoE sizes, seed, batch).
const std::vector<std::string>& ResumeMustMatchKeys();
// The layout keys (ranks, ep, zero_stage, overlap_grad_reduce, bucket_mb, dispatch, overlap_degree,
// threads, tp, sequence_parallel, tp_comm_overlap, arrangement, etp, pp, pipeline_schedule,
// virtual_stages, pipeline_split, cp, cp_algo, attention_core, memory_budget_mib, adaptive_r,
// a2a_algo, a2a_ranks_per_node, smart_schedule, shadow_experts, trace_step): where a run runs,
// not what it computes; a resumed run does not take them from its checkpoint.
bool IsLayoutKey(std::string_view key);

// Every key with a one-line description, in TrainConfigToJson's order (for command-line flags).
struct ConfigKey {
  std::string name;
  std::string help;
  // What the value is, for help texts: INT, FLOAT, BOOL, PATH (a file or directory) or NAME.
  std::string type;
};
std::vector<ConfigKey> TrainConfigKeys();
// Sets one key from command-line text: a JSON value (4, 0.5, true) or, when that does not
// parse, a bare string (--data corpus.txt). Errors as TrainConfigFromJson.
void SetTrainConfigValue(TrainConfig& config, std::string_view key, std::string_view text);

// The adaptive r of step `step` (0-based) from the text of the key adaptive_r, as
// parallel::ParallelOptions takes it (parallel::kAdaptiveRDefault / kAdaptiveRAuto or r >= 0).
// InvalidArgument naming the key for malformed text.
int AdaptiveRAtStep(std::string_view adaptive_r, int64_t step);

}  // namespace switchyard::train
