#include "switchyard/train/distributed.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "switchyard/comm/agree.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/memory_account.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/gate.h"
#include "switchyard/parallel/expert_shard.h"
#include "switchyard/train/data.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/parallel_context.h"
#include "switchyard/train/pipeline.h"
#include "switchyard/train/router_trace.h"
#include "switchyard/train/run_dir.h"
#include "switchyard/train/zero.h"

namespace switchyard::train {
namespace {

void Scale(const Tensor& t, float factor) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] *= factor;
}

struct ParallelMoeState {
  parallel::ParallelOutput out;
  std::shared_ptr<const ConcatAuxTotals> concat_totals;  // aux_loss hf_concat
};

// What every rank of an MPI run must agree on (comm/agree.h): every key of the config but those
// that may differ per rank ('out': only rank 0 writes the run directory; 'threads': this rank's
// compute threads), the training data (by DataFileFingerprint) and the content of the MoE layer
// file, the resume point.
comm::ConfigEntries AgreementEntries(const TrainConfig& config, const RunOptions& run) {
  comm::ConfigEntries entries;
  const nlohmann::json j = nlohmann::json::parse(TrainConfigToJson(config));
  for (const auto& [key, value] : j.items()) {
    if (key == "out" || key == "threads") continue;
    entries.emplace_back(key, value.dump());
  }
  auto digest = [](const std::vector<std::string>& files) {
    std::string all;
    for (const std::string& f : files) {
      const std::vector<std::byte> bytes = ReadFileBytes(f);
      if (!all.empty()) all += ' ';
      all += comm::ContentDigest(bytes.data(), bytes.size());
    }
    return all;
  };
  // The data by fingerprint (a token file of many GB is not read whole to start a run).
  std::string data;
  for (const std::string& f : RunCorpusFiles(config.data, config.val_data, config.data_format)) {
    if (!data.empty()) data += ' ';
    data += "fnv1a64:";  // as comm::ContentDigest names its digests
    data += DataFileFingerprint(f);
  }
  entries.emplace_back("data (content)", data);
  if (!config.moe_layer_config.empty()) {
    entries.emplace_back("moe_layer_config (content)", digest({config.moe_layer_config}));
  }
  entries.emplace_back("resume", run.resume);
  return entries;
}

}  // namespace

parallel::Arrangement TrainArrangement(const TrainConfig& config) {
  // The arrangement does not depend on the world size: any world the layout divides.
  return ResolveLayout(config, static_cast<int>(config.tp * config.pp * config.cp)).arrangement;
}

int TrainExpertParallelSize(const TrainConfig& config, int world_size) {
  return ResolveLayout(config, world_size).ep;
}

parallel::ParallelOptions TrainParallelOptions(const TrainConfig& config, int world_size) {
  const ResolvedLayout layout = ResolveLayout(config, world_size);
  ValidateExpertLayout(config, layout);
  parallel::ParallelOptions o;
  o.mesh.world_size = world_size;
  o.mesh.tp = static_cast<int>(config.tp);
  o.mesh.pp = static_cast<int>(config.pp);
  o.mesh.cp = static_cast<int>(config.cp);
  o.mesh.ep = layout.ep;
  o.mesh.etp = static_cast<int>(config.etp);  // each MoE layer derives DeepSpeed's H-shards
  o.mesh.arrangement = layout.arrangement;
  if (config.tp > 1) o.mesh.sequence_parallel = config.sequence_parallel;
  o.dispatch = config.dispatch;
  o.batch_scope = config.routing_scope;
  o.overlap_degree = static_cast<int>(config.overlap_degree);
  if (config.a2a_algo == A2aAlgo::k2dh) {
    // 0: the machine's ranks per node (RankTrainer takes them from the world's topology).
    o.hierarchical_ranks_per_node =
        config.a2a_ranks_per_node > 0 ? static_cast<int>(config.a2a_ranks_per_node) : world_size;
  }
  o.smart_group = parallel::SmartGroupFromString(config.smart_schedule);
  o.shadow = parallel::ShadowFromString(config.shadow_experts);
  return o;
}

// ---- ParallelMoeFeedForward ----

ParallelMoeFeedForward::ParallelMoeFeedForward(ParameterSet& params, const std::string& prefix,
                                               moe::LayerConfig config,
                                               const parallel::ParallelOptions& options,
                                               std::shared_ptr<parallel::ProcessGroups> groups,
                                               uint64_t seed)
    : layer_(config, options, std::move(groups)),
      prefix_(prefix),
      params_(&params),
      data_shards_(layer_.mesh().dp() * layer_.mesh().cp()) {
  // The single-rank MoeFeedForward's initial values (same seed derivation), then this rank's part.
  moe::LayerParams full = moe::InitParams(config, seed ^ (InitStream(prefix) - kStreamInit));
  shard_ = layer_.ShardParams(full);
  for (const auto& [name, tensor] : moe::ParamsToMap(config, shard_)) {
    ParamOptions o;
    o.group = name.starts_with("experts.") ? ParamGroup::kExpert : ParamGroup::kDense;
    o.weight_decay = tensor.dim() >= 2 && name.ends_with(".weight");
    o.trainable = name != "gate.expert_bias";
    params.Add(prefix + name, tensor, o);
  }
}

FeedForwardOutput ParallelMoeFeedForward::Forward(const Tensor& x,
                                                  const FeedForwardContext& context) {
  const double t0 = NowSeconds();
  parallel::ParallelForwardOptions o;
  o.global_token_offset = context.global_token_offset;
  if (context.token_index) o.token_index = *context.token_index;
  o.step = context.step;
  o.threads = context.threads;
  o.save_for_backward = context.save_for_backward;
  o.training = context.training;
  o.entropy = context.training;  // the step's router statistics (docs/observability.md)
  o.adaptive_r = AdaptiveRAtStep(adaptive_r_, static_cast<int64_t>(context.step));
  parallel::ParallelMoeLayer& layer = layer_;
  int64_t nonfinite = 0;
  if (layer.config().check_finite && x.dtype() == DType::kFloat32) {
    const float* p = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) nonfinite += std::isfinite(p[i]) ? 0 : 1;
  }
  const bool global_aux = layer.config().aux_loss == moe::AuxLoss::kGlobal && context.training;
  const int64_t key = MicroBatchKey(context.global_token_offset, context.token_index.get());
  if (global_aux) o.aux_counts_so_far = aux_counts_.Before(context.step, key);
  TracedForward traced(router_trace_, prefix_, context.step, context.training, x.size(0),
                       context.global_token_offset, context.token_index.get(),
                       moe::EffectiveTopK(layer.config()));
  o.forced_experts = traced.forced;
  auto state = std::make_shared<ParallelMoeState>();
  RebindLayerParams(*params_, prefix_, &shard_);
  state->out = layer.Forward(shard_, x, o);
  state->concat_totals = context.concat_totals;
  traced.Record(state->out.layer, context.save_for_backward);
  if (global_aux) aux_counts_.Add(context.step, key, state->out.layer.aux_counts);
  FeedForwardOutput r =
      MoeFeedForwardOutput(layer.config(), state->out.layer, x.size(0), shard_.expert_bias);
  r.routing.nonfinite_inputs = nonfinite;
  if (context.save_for_backward) r.state = state;
  times_.seconds += NowSeconds() - t0;
  times_.comm_seconds += state->out.stats.comm_seconds;
  return r;
}

Tensor ParallelMoeFeedForward::Backward(const FeedForwardOutput& forward, const Tensor& dy,
                                        float loss_scale, int threads) {
  SY_CHECK(forward.state != nullptr, "ParallelMoeFeedForward::Backward needs save_for_backward");
  SY_REQUIRE(loss_scale != 0.0f, InvalidArgument,
             "ParallelMoeFeedForward: loss_scale must not be 0");
  const double t0 = NowSeconds();
  const auto& s = *static_cast<const ParallelMoeState*>(forward.state.get());
  parallel::ParallelMoeLayer& layer = layer_;
  // The layer differentiates sum(y * d) + (this rank's share of) the loss terms. This rank must
  // contribute sum(y * dy) + D * loss_scale * share (distributed.h: gradients are summed over the
  // ranks and divided by D), so pass d = dy / (D * loss_scale) and scale the results back. In the
  // per-rank scope the layer differentiates this rank's own loss terms, whose mean over the D
  // shards is the objective's: the share is loss / D, so the factor is loss_scale alone. With
  // context parallelism the per-rank scope routes each cp group as one shard (cp ranks share its
  // loss terms, as the D ranks share the global ones): the factor is cp.
  const bool per_rank = layer.options().batch_scope == parallel::BatchScope::kPerRank;
  const float scale = static_cast<float>(per_rank ? layer.mesh().cp() : data_shards_) * loss_scale;
  Tensor d = dy;
  if (scale != 1.0f) {
    d = dy.Clone();
    Scale(d, 1.0f / scale);
  }
  RebindLayerParams(*params_, prefix_, &shard_);
  parallel::ParallelGradients g =
      layer.Backward(shard_, s.out, d, threads, ConcatTotalsOf(s.concat_totals));
  for (const auto& [name, grad] : moe::ParamsToMap(layer.config(), g.params)) {
    Parameter& p = params_->Get(prefix_ + name);
    if (!p.options.trainable) continue;
    ExpectShape(p.name, grad, p.value.shape());
    float* dst = p.grad.data<float>();
    const float* src = grad.data<float>();
    for (int64_t i = 0; i < grad.numel(); ++i) dst[i] += scale * src[i];
  }
  Tensor dx = g.x;
  if (scale != 1.0f) Scale(dx, scale);
  times_.seconds += NowSeconds() - t0;
  times_.comm_seconds += g.stats.comm_seconds;
  return dx;
}

FeedForwardTimes ParallelMoeFeedForward::TakeTimes() {
  return std::exchange(times_, FeedForwardTimes{});
}

void ParallelMoeFeedForward::EndStep(std::span<const int64_t> global_expert_counts) {
  const moe::LayerConfig& c = layer_.config();
  if (!c.expert_bias) return;
  RebindLayerParams(*params_, prefix_, &shard_);
  moe::UpdateExpertBias(global_expert_counts, c.expert_bias_update_rate, shard_.expert_bias);
}

// ---- RunDistributedTraining ----

RunSummary RunDistributedTraining(comm::Launcher& launcher, const TrainConfig& config,
                                  const DistributedRunOptions& options) {
  ValidateTrainConfig(config);
  SY_REQUIRE(config.ranks == launcher.world_size(), InvalidArgument,
             "config: 'ranks' is {} but the launcher starts {} ranks ({})", config.ranks,
             launcher.world_size(), launcher.kind());
  RequireRunInputsOutsideRunDirectory(config, options.run.config_file,
                                      options.run.resume);  // before any rank reads or writes
  TrainConfig c = config;
  if (c.ep == 0) c.ep = TrainExpertParallelSize(c, static_cast<int>(c.ranks));  // as it runs
  const bool agree = launcher.ranks_in_process() < launcher.world_size();
  if (!agree) RequireTrainingMemory(c, launcher.ranks_in_process());  // every rank, up front
  std::mutex mu;
  RunSummary summary;
  launcher.Run([&](comm::Communicator& world) {
    // Ranks that share this process or node share its cores (the threading policy divides them)
    // and its memory.
    int sharing = launcher.ranks_in_process();
    if (agree) {
      comm::AgreeOnConfig(world, "train", AgreementEntries(c, options.run));
      sharing = std::max(sharing, world.topology().ranks_per_node);
      RequireTrainingMemory(c, sharing);
    }
    // Tensors this rank's thread allocates are counted (the run summary's measured peak).
    ScopedMemoryAccount account(std::make_shared<MemoryAccount>());
    RankTrainer rank(c, world, sharing);
    RunSummary s = rank.trainer().Run(options.run);
    if (world.rank() == 0 || agree) {
      std::lock_guard<std::mutex> lock(mu);
      summary = std::move(s);
    }
  });
  return summary;
}

}  // namespace switchyard::train
