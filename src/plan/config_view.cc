#include "plan/config_view.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "switchyard/parallel/mesh.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/model.h"

namespace switchyard::plan::internal {

using nlohmann::json;

ModelView ReadModel(const train::TrainConfig& config) {
  const json j = json::parse(train::TrainConfigToJson(config));
  ModelView m;
  m.vocab_size = j.at("vocab_size").get<int64_t>();
  m.seq_len = j.at("seq_len").get<int64_t>();
  m.model_dim = j.at("model_dim").get<int64_t>();
  m.num_layers = j.at("num_layers").get<int64_t>();
  m.num_heads = j.at("num_heads").get<int64_t>();
  m.hidden_dim = j.at("hidden_dim").get<int64_t>();
  m.num_experts = j.at("num_experts").get<int64_t>();
  m.top_k = j.at("top_k").get<int64_t>();
  const int64_t eh = j.at("expert_hidden_dim").get<int64_t>();
  m.expert_hidden_dim = eh > 0 ? eh : m.hidden_dim;
  m.capacity_factor = j.at("capacity_factor").get<double>();
  m.batch_size = j.at("batch_size").get<int64_t>();
  m.tied_head = j.at("tied_head").get<bool>();
  m.precision = j.at("precision").get<std::string>();
  m.moe_blocks = train::NumMoeBlocks(config.model);
  const bool swiglu = config.model.mlp == train::MlpKind::kSwiGlu;
  // The experts' layer as train builds it: gated from the moe_layer_config file or mlp swiglu.
  if (m.moe_blocks > 0 && (swiglu || !config.moe_layer_config.empty())) {
    m.expert_matrices = train::MoeLayerConfig(config).gated ? 3 : 2;
  }
  m.dense_matrices = swiglu ? 3 : 2;
  const int64_t kv = config.model.num_kv_heads > 0 ? config.model.num_kv_heads : m.num_heads;
  m.attention_matrices =
      2.0 + 2.0 * static_cast<double>(kv) / static_cast<double>(std::max<int64_t>(1, m.num_heads));
  return m;
}

LayoutView ReadLayout(const train::TrainConfig& config) {
  const json j = json::parse(train::TrainConfigToJson(config));
  LayoutView l;
  l.ranks = j.at("ranks").get<int64_t>();
  l.tp = j.at("tp").get<int64_t>();
  l.cp = j.at("cp").get<int64_t>();
  l.pp = j.at("pp").get<int64_t>();
  l.dp = std::max<int64_t>(1, l.ranks / (l.tp * l.cp * l.pp));
  l.ep = train::TrainExpertParallelSize(config, static_cast<int>(l.ranks));
  l.etp = j.at("etp").get<int64_t>();
  l.virtual_stages = j.at("virtual_stages").get<int64_t>();
  l.zero_stage = j.at("zero_stage").get<int64_t>();
  l.microbatches = j.at("microbatches").get<int64_t>();
  l.overlap_degree = j.at("overlap_degree").get<int64_t>();
  l.sequence_parallel = l.tp > 1 && j.at("sequence_parallel").get<bool>();
  l.tp_comm_overlap = j.at("tp_comm_overlap").get<bool>();
  l.overlap_grad_reduce = j.at("overlap_grad_reduce").get<bool>();
  l.megatron = train::TrainArrangement(config) == parallel::Arrangement::kMegatron;
  l.cp_algo = j.at("cp_algo").get<std::string>();
  l.pipeline_schedule = j.at("pipeline_schedule").get<std::string>();
  l.dispatch = j.at("dispatch").get<std::string>();
  l.a2a_algo = j.at("a2a_algo").get<std::string>();
  l.adaptive_r = j.at("adaptive_r").get<std::string>();
  l.recompute = j.at("recompute").get<std::string>();
  return l;
}

LayoutView LayoutWithFlags(LayoutView l,
                           const std::vector<std::pair<std::string, std::string>>& flags,
                           const train::TrainConfig& config) {
  for (const auto& [key, text] : flags) {
    int64_t* number = key == "ranks"            ? &l.ranks
                      : key == "tp"             ? &l.tp
                      : key == "cp"             ? &l.cp
                      : key == "pp"             ? &l.pp
                      : key == "etp"            ? &l.etp
                      : key == "virtual_stages" ? &l.virtual_stages
                      : key == "zero_stage"     ? &l.zero_stage
                      : key == "microbatches"   ? &l.microbatches
                      : key == "overlap_degree" ? &l.overlap_degree
                                                : nullptr;
    bool* flag = key == "sequence_parallel"     ? &l.sequence_parallel
                 : key == "tp_comm_overlap"     ? &l.tp_comm_overlap
                 : key == "overlap_grad_reduce" ? &l.overlap_grad_reduce
                                                : nullptr;
    std::string* name = key == "cp_algo"             ? &l.cp_algo
                        : key == "pipeline_schedule" ? &l.pipeline_schedule
                        : key == "dispatch"          ? &l.dispatch
                        : key == "a2a_algo"          ? &l.a2a_algo
                        : key == "adaptive_r"        ? &l.adaptive_r
                        : key == "recompute"         ? &l.recompute
                                                     : nullptr;
    if (number != nullptr) {
      *number = std::stoll(text);
    } else if (flag != nullptr) {
      *flag = text == "true";
    } else if (name != nullptr) {
      *name = text;
    }
  }
  l.sequence_parallel = l.sequence_parallel && l.tp > 1;
  l.dp = std::max<int64_t>(1, l.ranks / (l.tp * l.cp * l.pp));
  l.ep = train::TrainExpertParallelSize(config, static_cast<int>(l.ranks));
  l.megatron = train::TrainArrangement(config) == parallel::Arrangement::kMegatron;
  return l;
}

}  // namespace switchyard::plan::internal
