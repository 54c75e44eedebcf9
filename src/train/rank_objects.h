// The objects of one rank's place in a training run, built once per rank by the Trainer
// (trainer.h) from the config and the world it is given: the process groups of the run's mesh,
// the pipeline stage's group, the parameter-and-gradient buffer (data-parallel reduction, ZeRO,
// the sharded optimizers), the checkpoint layout, the step trace, the ParallelContext and the
// factory of the MoE blocks. A trainer alone gets the same objects over a one-rank world
// (comm/self.h) with every parallel degree 1.
//
// Thread-safety: one per rank, used by its thread.
#pragma once

#include <memory>

#include "switchyard/comm/communicator.h"
#include "switchyard/parallel/process_groups.h"
#include "switchyard/train/checkpoint_layout.h"
#include "switchyard/train/config.h"
#include "switchyard/train/feed_forward.h"
#include "switchyard/train/parallel_context.h"
#include "switchyard/train/param_grad_buffer.h"
#include "switchyard/train/zero.h"
#include "train/step_trace.h"

namespace switchyard::train::internal {

struct RankObjects {
  // Declared so that what refers to a member is destroyed before it.
  std::unique_ptr<comm::Communicator> own_world;  // the one-rank world of a trainer alone
  std::shared_ptr<parallel::ProcessGroups> groups;
  std::unique_ptr<comm::Communicator> stage;  // every rank of this stage (null: pp 1)
  std::unique_ptr<StepTrace> trace;           // null: no step traced
  std::unique_ptr<ParamGradBuffer> buffer;
  std::unique_ptr<CheckpointLayout> checkpoint;
  ParallelContext context;
  // Builds the MoE blocks over the groups (parallel::ParallelMoeLayer); null for a trainer
  // alone, whose blocks are the single-rank MoeFeedForward (the reference the parallel layer is
  // tested against).
  FeedForwardFactory moe_factory;
};

// The objects of this rank of `world` for `config` (collective over `world`: splits it into the
// mesh's groups). `zero`: ShardedAdamW's checking options; the buckets come from the config.
// `world` null: a trainer alone, over a one-rank world of its own with every parallel degree of
// `config` taken as 1. Throws InvalidArgument naming the key for a layout the world cannot hold.
std::unique_ptr<RankObjects> BuildRankObjects(const TrainConfig& config, comm::Communicator* world,
                                              int ranks_in_process, const ZeroOptions& zero);

}  // namespace switchyard::train::internal
