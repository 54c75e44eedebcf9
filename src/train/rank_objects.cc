// BuildRankObjects (rank_objects.h): the process groups, buffer, checkpoint layout, step trace,
// context and MoE factory of one rank.
#include "train/rank_objects.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "switchyard/comm/self.h"
#include "switchyard/train/distributed.h"
#include "switchyard/train/pipeline.h"

namespace switchyard::train::internal {
namespace {

// A trainer alone lays `config` out on its one rank: every parallel degree 1.
TrainConfig OneRankLayout(TrainConfig c) {
  c.ranks = 1;
  c.tp = c.pp = c.cp = c.etp = 1;
  c.ep = 1;
  c.sequence_parallel = false;
  c.tp_comm_overlap = false;
  return c;
}

// Whether this rank's stage holds MoE blocks (the run's header then names the expert layout).
bool StageHoldsExperts(const TrainConfig& config, int pp_rank) {
  if (config.pp == 1) return NumMoeBlocks(config.model) > 0;
  for (const BlockRange& chunk : PipelinePartition(config, pp_rank).chunks) {
    for (int64_t b = chunk.begin; b < chunk.end; ++b) {
      if (IsMoeBlock(config.model, b)) return true;
    }
  }
  return false;
}

}  // namespace

std::unique_ptr<RankObjects> BuildRankObjects(const TrainConfig& run_config,
                                              comm::Communicator* run_world, int ranks_in_process,
                                              const ZeroOptions& zero) {
  auto r = std::make_unique<RankObjects>();
  const bool alone = run_world == nullptr;
  if (alone) r->own_world = comm::CreateSelfCommunicator("world");
  comm::Communicator& world = alone ? *r->own_world : *run_world;
  const TrainConfig config = alone ? OneRankLayout(run_config) : run_config;
  parallel::ParallelOptions options = TrainParallelOptions(config, world.size());
  if (config.a2a_algo == A2aAlgo::k2dh && config.a2a_ranks_per_node == 0) {
    // The launcher's node size, as far as it divides the expert group (the nodes of the 2DH
    // all-to-all are consecutive ranks of the expert group).
    options.hierarchical_ranks_per_node =
        std::gcd(std::max(1, world.topology().ranks_per_node), options.mesh.ep);
  }
  // The run's process groups, from the layout's degrees only: built once, shared by every MoE
  // block and the optimizer (every block's experts split over them alike, ValidateExpertLayout
  // checks; each MoE layer checks that its experts fit).
  const ResolvedLayout layout = ResolveLayout(config, world.size());
  parallel::MeshConfig degrees = options.mesh;
  degrees.etp = layout.expert_shards;
  r->groups = std::make_shared<parallel::ProcessGroups>(world, parallel::Mesh(degrees));
  const parallel::Mesh& mesh = r->groups->mesh();
  // DeepSpeed's TP de-duplication (parallel::ParallelOptions::tp_dedup): each tp rank runs the
  // experts on its share of the rows, so expert gradients are summed over tp too.
  const bool dedup = options.tp_dedup && mesh.tp_duplicates_tokens() &&
                     options.dispatch != parallel::DispatchKind::kAllGather;
  const TensorParallelOptions tp{.sequence_parallel = config.tp > 1 && config.sequence_parallel,
                                 .comm_overlap = config.tp > 1 && config.tp_comm_overlap};
  ZeroOptions buckets = zero;
  buckets.bucket_elements = static_cast<int64_t>(config.bucket_mb * 1024 * 1024 / sizeof(float));
  r->buffer = std::make_unique<ParamGradBuffer>(
      r->groups, static_cast<int>(config.zero_stage), buckets,
      dedup ? parallel::GroupKind::kExpertHolders : parallel::GroupKind::kExpertData);
  r->buffer->SetOverlapGradReduce(config.overlap_grad_reduce);
  if (config.trace_step > 0) {
    r->trace = std::make_unique<StepTrace>(world, config.trace_step, config.out + "/trace.json");
    r->buffer->SetTrace(r->trace.get());
  }
  if (config.model.moe_every > 0 && !alone) {
    ValidateAdaptiveR(config, layout);
  }
  ContextParallelOptions cp;
  if (config.cp > 1) {
    cp = ContextParallelOptions{
        .algorithm = config.cp_algo, .split = SequenceSplitKind::kZigzag, .causal = true};
  }
  const int stage = r->groups->coords().pp_rank;
  r->context = MakeParallelContext(*r->groups, ranks_in_process, tp, cp,
                                   LayoutNotes{.zero_stage = static_cast<int>(config.zero_stage),
                                               .experts = StageHoldsExperts(config, stage)});
  if (alone) r->context.description.clear();  // the run's header names no layout
  if (config.pp > 1) {
    // Every rank of this stage (collective over the world): checkpoints gather the experts of
    // the stage's MoE blocks over it.
    r->stage = world.Split(stage, world.rank(), fmt::format("stage{}", stage));
    r->buffer->SetTiedEmbedding(config.model.tied_head);
  }
  r->checkpoint = std::make_unique<CheckpointLayout>(r->groups, r->stage.get());
  if (config.model.moe_every > 0 && !alone) {
    RankObjects* objects = r.get();
    r->moe_factory = [objects, config, options](int64_t block, const std::string& prefix,
                                                ParameterSet& params, uint64_t seed) {
      const moe::LayerConfig layer = MoeBlockLayerConfig(config, block);
      objects->checkpoint->AddMoeBlock(prefix, layer);
      auto ffn = std::make_unique<ParallelMoeFeedForward>(params, prefix, layer, options,
                                                          objects->groups, seed);
      ffn->set_adaptive_r(config.adaptive_r);
      if (objects->trace) objects->trace->AddLayer(&ffn->layer());
      return ffn;
    };
  }
  return r;
}

}  // namespace switchyard::train::internal
