// The options of a training run (TrainConfig): one flat set of keys that are at once the fields,
// the keys of config.json / --config files and the command-line flags (--model_dim, --steps, ...).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/moe/config.h"
#include "switchyard/train/config_choice.h"
#include "switchyard/train/model.h"

namespace switchyard::train {

// Every option of a run: one field per row of config_keys.def, which declares each key once
// (type, default, category, resume rule, range and help). The JSON keys (TrainConfigToJson)
// are the field names, which are also the command-line flags (--model_dim, --steps, ...).
struct TrainConfig {
  ModelConfig model;  // the SY_MODEL_KEY rows
#define SY_TRAIN_KEY(key, Type, default_value, ...) Type key = default_value;
#define SY_MODEL_KEY(...)
#include "switchyard/train/config_keys.def"
#undef SY_TRAIN_KEY
#undef SY_MODEL_KEY
};

// A key's place in a run (config_keys.def): what is trained, how the run goes, where it runs.
enum class KeyCategory : uint8_t { kModel, kRun, kLayout };
// Whether a resumed run must keep its checkpoint's value (ResumeMustMatchKeys).
enum class KeyResume : uint8_t { kMayDiffer, kMustMatch };
// What a key's value is, and its range where ValidateTrainConfig checks one.
struct KeyValues {
  enum class Kind : uint8_t { kInt, kFloat, kBool, kPath, kText, kChoice, kList };
  Kind kind = Kind::kInt;
  bool ranged = false;                // false: checked elsewhere (ValidateModelConfig, ...)
  int64_t int_lo = 0, int_hi = 0;     // kInt, and each entry of kList; int_hi INT64_MAX: >= lo
  double float_lo = 0, float_hi = 0;  // kFloat; float_hi 1e30: >= lo
  bool open_hi = false;               // kFloat: hi excluded
  const char* unit = "";              // kFloat: printed after the range (" MiB")
};
// One row of config_keys.def.
struct ConfigKeyInfo {
  const char* name;
  KeyCategory category;
  KeyResume resume;
  KeyValues values;
  const char* layer_key;  // the moe::LayerConfig key it is handed to; "" for none
  const char* help;
};
// Every key, in config_keys.def's order.
const std::vector<ConfigKeyInfo>& TrainConfigTable();
// The row of `key`; nullptr for an unknown key.
const ConfigKeyInfo* FindConfigKey(std::string_view key);

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

// What a config's layout resolves to on a world of `world_size` ranks: every derived size and
// every "auto" choice, computed in one place (ResolveLayout).
struct ResolvedLayout {
  int world_size = 1;
  int tp = 1, pp = 1, cp = 1;
  int dp = 1;   // data-parallel size: world_size / (tp x pp x cp)
  int ep = 1;   // 'ep', or for 0 as large as the arrangement allows
  int etp = 1;  // expert tensor-parallel size ('etp'; Megatron arrangement)
  // H-shards per expert, the mesh's etp: Megatron's 'etp'; DeepSpeed ep / E (the first MoE
  // block's experts) when E < ep, else 1.
  int expert_shards = 1;
  // 'arrangement' auto: Megatron with sequence_parallel, else DeepSpeed.
  parallel::Arrangement arrangement = parallel::Arrangement::kDeepSpeed;
  // 'attention_core' auto: flash with cp > 1, else softmax (never kAuto here).
  AttentionCore attention_core = AttentionCore::kSoftmax;
};
// The layout of `config` on `world_size` ranks. The one place of the rule "tp x pp x cp divides
// the ranks": InvalidArgument naming the keys otherwise ("config: 'tp' 3 must divide 'ranks'
// 4 ..."). The arrangement and the attention core do not depend on world_size.
ResolvedLayout ResolveLayout(const TrainConfig& config, int world_size);
// The experts against the layout (needs the keys and the world size only): 'ep' divides the
// ranks, 'num_experts' and every 'experts_per_block' entry split over the ep ranks alike,
// 'a2a_algo' 2dh with 'dispatch' alltoall. InvalidArgument naming the keys otherwise.
void ValidateExpertLayout(const TrainConfig& config, const ResolvedLayout& layout);
// Every entry of 'adaptive_r' is 0, auto/default or a divisor of the layout's expert_shards.
void ValidateAdaptiveR(const TrainConfig& config, const ResolvedLayout& layout);
// The batch's split over a layout, as the trainer checks it before the first step: every one of
// `data_shards` data-parallel ranks gets at least one row of every micro-batch, and with
// `sequence_parallel` its tokens of a micro-batch divide by `tp_size`. InvalidArgument naming
// the sizes otherwise.
void ValidateBatchSplit(const TrainConfig& config, int64_t data_shards, int64_t tp_size,
                        bool sequence_parallel);

// The MoE layer options of the config's MoE blocks (model_dim, hidden_dim = expert_hidden_dim or
// hidden_dim, num_experts, top_k, capacity_factor, coefficients, activation, seed), on top of
// moe_layer_config's file when given. Throws InvalidArgument / IoError.
moe::LayerConfig MoeLayerConfig(const TrainConfig& config);
// The router's expert groups: num_groups, or with router_group_by the expert-parallel size of the
// run's layout (ep_rank: one group per ep rank's experts) or the nodes of a2a_ranks_per_node ranks
// in the expert group (node). Throws InvalidArgument naming the keys when the groups cannot be
// formed (no group_topk, num_groups set as well, experts that do not split over the groups).
int64_t RouterGroupCount(const TrainConfig& config);
// The number of MoE blocks of the model (num_layers / moe_every; 0 for a dense model).
int64_t NumMoeBlocks(const ModelConfig& model);
// The experts of the MoE block at transformer block `block` (experts_per_block's entry for it,
// else num_experts).
int64_t BlockExperts(const TrainConfig& config, int64_t block);
// MoeLayerConfig with that block's number of experts.
moe::LayerConfig MoeBlockLayerConfig(const TrainConfig& config, int64_t block);
// True when the model has MoE blocks and their balancing loss is aux_loss hf_concat (Hugging
// Face's: one loss over the router rows of every MoE block of a micro-batch; docs/models.md).
bool UsesConcatAux(const TrainConfig& config);

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

// The keys a resumed run must share with its checkpoint (model shape, MoE sizes, seed, batch):
// the kMustMatch rows of config_keys.def.
const std::vector<std::string>& ResumeMustMatchKeys();
// The layout keys, the kLayout rows of config_keys.def (ranks, ep, zero_stage, tp, pp, cp,
// dispatch, ..., threads, trace_step): where a run runs, not what it computes; a resumed run
// does not take them from its checkpoint.
bool IsLayoutKey(std::string_view key);

// Every key with a one-line description, in TrainConfigToJson's order (for command-line flags).
struct ConfigKey {
  std::string name;
  std::string help;
  // What the value is, for help texts: INT, FLOAT, BOOL, PATH (a file or directory), NAME or
  // LIST (KeyValues::Kind).
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
