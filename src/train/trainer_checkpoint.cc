// Trainer::Snapshot and Trainer::Restore: a run's state in and out of a checkpoint, with the
// checks that a resumed run continues the same training (trainer.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "switchyard/train/trainer.h"
#include "train/rank_objects.h"

namespace switchyard::train {

using nlohmann::json;

CheckpointData Trainer::Snapshot() {
  CheckpointData d;
  ParameterSet& params = model_->parameters();
  buffer_->GatherParameters();
  d.step = step_;
  d.optimizer_step = optimizer_step();
  d.seed = config_.seed;
  d.global_batch = config_.batch_size;
  d.config_json = TrainConfigToJson(config_);
  d.data_json = data_->identity_json();
  d.moe_layer_json = moe_layer_json_;
  // Layout-independent (checkpoint_layout.h): full tensors by name, experts by global id, every
  // stage's part (collective; every rank calls it, the writer saves the result).
  CheckpointLayout& layout = *rank_->checkpoint;
  for (const Parameter& p : params.all()) {
    if (!p.tied_copy) d.model.emplace(p.name, p.value);
  }
  layout.Gather(params, d.model, {""});
  d.optimizer = buffer_->FullState();
  if (!d.optimizer.empty()) layout.Gather(params, d.optimizer, {".exp_avg", ".exp_avg_sq"});
  return d;
}

namespace {

// The MoE layer options that decide which parameters an MoE block has.
constexpr const char* kMoeParameterKeys[] = {"gated", "fc_bias", "residual_moe",
                                             "shared_expert_hidden", "expert_bias"};

// Refuses (naming each key, both values, `source` and this run's layer file) a checkpoint whose
// MoE layer options (moe::ToJson) shape other parameters than this run's.
void RequireSameMoeParameters(const std::string& checkpoint_json, const std::string& run_json,
                              const std::string& source, const std::string& layer_file) {
  const json theirs = json::parse(checkpoint_json), ours = json::parse(run_json);
  std::vector<std::string> changed;
  for (const char* key : kMoeParameterKeys) {
    const json a = theirs.contains(key) ? theirs.at(key) : json();
    const json b = ours.contains(key) ? ours.at(key) : json();
    if (a != b) {
      changed.push_back(
          fmt::format("'{}': {} has {}, this run {}", key, source, a.dump(), b.dump()));
    }
  }
  SY_REQUIRE(changed.empty(), InvalidArgument,
             "resume: MoE layer options that shape the parameters differ from {}'s (this run's "
             "'moe_layer_config': {}): {}; give the options it was trained with",
             source, layer_file.empty() ? std::string("none, the defaults") : layer_file,
             fmt::join(changed, "; "));
}

}  // namespace

void Trainer::Restore(const CheckpointData& data, const std::string& source) {
  TrainConfig saved = TrainConfigFromJson(data.config_json.empty() ? "{}" : data.config_json);
  // What must match for the model to load and the run to continue identically: every
  // difference in one message.
  json mine = json::parse(TrainConfigToJson(config_));
  json theirs = json::parse(TrainConfigToJson(saved));
  std::vector<std::string> differences;
  for (const std::string& key : ResumeMustMatchKeys()) {
    if (mine[key] != theirs[key]) {
      differences.push_back(fmt::format("'{}': the checkpoint has {}, this run {}", key,
                                        theirs[key].dump(), mine[key].dump()));
    }
  }
  SY_REQUIRE(differences.empty(), InvalidArgument,
             "resume: {} settings differ from the checkpoint's (pass the checkpoint's values, or "
             "leave them out on the command line): {}",
             differences.size(), fmt::join(differences, "; "));
  if (!data.data_json.empty()) {
    const json a = json::parse(data.data_json), b = json::parse(data_->identity_json());
    SY_REQUIRE(a.at("bytes") == b.at("bytes") && a.at("fnv1a64") == b.at("fnv1a64"),
               InvalidArgument,
               "resume: the checkpoint was trained on {} ({} bytes, fnv1a64 {}), this run's data "
               "is {} ({} bytes, fnv1a64 {}): set 'data' (and 'tokenizer') to the checkpoint's",
               a.at("files").dump(), a.at("bytes").dump(), a.at("fnv1a64").dump(),
               b.at("files").dump(), b.at("bytes").dump(), b.at("fnv1a64").dump());
  }
  if (!data.moe_layer_json.empty() && !moe_layer_json_.empty()) {
    RequireSameMoeParameters(data.moe_layer_json, moe_layer_json_, source,
                             config_.moe_layer_config);
  }
  try {
    TensorMap values = data.model;
    rank_->checkpoint->Slice(model_->parameters(), values, {""});
    // Other stages' parameters stay in the map.
    model_->parameters().LoadValues(values, /*allow_extra=*/ctx_.pp_size > 1);
  } catch (const Error& e) {
    if (!data.moe_layer_json.empty() || moe_layer_json_.empty()) throw;
    // A checkpoint from before the MoE layer options were recorded.
    throw InvalidArgument(fmt::format(
        "resume: {} does not fit this run's model ({}); it does not record its MoE layer "
        "options: check that 'moe_layer_config' ({}) has the ones it was trained with",
        source, e.what(), config_.moe_layer_config.empty() ? "none" : config_.moe_layer_config));
  }
  if (data.optimizer_step != 0 || !data.optimizer.empty()) {
    TensorMap state = data.optimizer;
    rank_->checkpoint->Slice(model_->parameters(), state, {".exp_avg", ".exp_avg_sq"});
    buffer_->LoadFullState(state, data.optimizer_step);
  }
  step_ = data.step;
}

}  // namespace switchyard::train
