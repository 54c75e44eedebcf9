// Where one rank sits in a training run's parallel layout: its coordinates along the mesh's
// dimensions and the groups the trainer talks over. A plain value, built once per rank from the
// run's process groups (MakeParallelContext) and read by the trainer; one rank is the same value
// with every size 1 (the default), not a separate code path.
//
// Thread-safety: a value; the communicators it points to follow comm::Communicator's rules and
// must outlive every copy.
#pragma once

#include <string>

#include "switchyard/comm/communicator.h"
#include "switchyard/parallel/process_groups.h"
#include "switchyard/train/model.h"

namespace switchyard::train {

struct ParallelContext {
  int rank = 0;        // in the world
  int world_size = 1;  // ranks of the run
  // Ranks sharing this process's cores (ranks as threads), for the threading policy.
  int ranks_in_process = 1;
  // The data-parallel coordinate: the batch's rows are split over data_size shards and this rank
  // trains rows of shard data_rank (the ranks of a tensor- or context-parallel group share
  // theirs).
  int data_rank = 0;
  int data_size = 1;
  int tp_rank = 0;  // tensor parallel
  int tp_size = 1;
  int cp_rank = 0;  // context parallel
  int cp_size = 1;
  int pp_rank = 0;  // pipeline stage
  int pp_size = 1;
  // Whether this rank's loss and token count, and its routing statistics, enter the global sums
  // (once per group of ranks that compute the same ones: the tensor-parallel ranks share the
  // loss, and without sequence parallelism the routing too).
  bool reports_loss = true;
  bool reports_routing = true;
  // Ranks of a stage that report routing statistics for each MoE block it holds: the token
  // shards of a stage.
  int routing_replicas = 1;
  // The pipeline group: one rank of each stage with the same tp and data-parallel coordinates
  // (pp_size ranks). Every step runs its schedule on it; null with one stage: the trainer runs
  // it on a one-rank group of its own.
  comm::Communicator* pipeline = nullptr;
  // The layouts the model is built with (no group: none).
  TensorParallelContext tensor_parallel;
  ContextParallelContext context_parallel;
  // One line naming the layout for the run's header ("": a trainer alone).
  std::string description;

  // Only one rank writes the run directory.
  bool writes_run_directory() const { return rank == 0; }
};

// What the run's header line names besides the mesh: the ZeRO stage and whether this rank's
// model holds MoE blocks (their expert layout is then described).
struct LayoutNotes {
  int zero_stage = 0;
  bool experts = false;
};

// The context of this rank in `groups` (their mesh and coordinates): `tp` and `cp` are the model's
// tensor- and context-parallel options (used when the mesh has tp > 1, cp > 1; InvalidArgument
// when tp's sequence parallelism is not the mesh's). The communicators are `groups`' (which must
// outlive the context).
ParallelContext MakeParallelContext(const parallel::ProcessGroups& groups, int ranks_in_process,
                                    const TensorParallelOptions& tp,
                                    const ContextParallelOptions& cp, const LayoutNotes& notes);

}  // namespace switchyard::train
