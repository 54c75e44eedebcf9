// Runs one MoE layer on W ranks as the single-rank layer's drop-in: the tokens of x are split
// contiguously over the data shards (mesh.h), every rank runs ParallelMoeLayer, and the results
// come back as one whole-batch result: outputs and token gradients gathered in order, parameter
// gradients synchronised and reported as moe::MoeLayer would report them on the whole batch (kSum).
// So the same inputs give the same outputs for every layout (global batch scope).
//
// Ranks come from a comm::Launcher chosen by the program: ranks as threads of this process, or
// this process as one rank of a multi-process job (every process passes the same inputs, they
// check that they agree, and rank 0 receives the assembled result).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "switchyard/comm/launcher.h"
#include "switchyard/core/tensor.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/parallel/schedule.h"
#include "switchyard/parallel/trace.h"

namespace switchyard::parallel {

struct DriverOptions {
  ParallelOptions parallel;  // parallel.mesh.world_size = W (0: the launcher's world size)
  // Tokens of each data shard, in order (sum = T); empty: an even contiguous split (the first
  // T % D shards get one more token).
  std::vector<int64_t> token_split;
  int64_t global_token_offset = 0;  // global index of x's first token
  uint64_t step = 0;
  // [T * k] routes to force, token-major (moe::ForwardOptions::forced_experts); empty: the gate's.
  std::vector<int32_t> forced_experts;
  bool training = true;  // the calls' mode (ParallelForwardOptions::training)
  // Compute threads per rank; 0: ComputeThreadsPerRank(ranks in this process, usable cores).
  int threads = 0;
  // Forward+backward(+sync) repetitions: `warmup` untimed, then `repeat` timed (the last one is
  // reported).
  int warmup = 0;
  int repeat = 1;
  // Records every rank's events of the last repetition (ranks of other processes: gathered at
  // rank 0). May be null.
  Tracer* tracer = nullptr;
};

// What one rank did (for timing reports and tests).
struct RankReport {
  RankCoords coords;
  int64_t tokens = 0;
  CommStats forward, backward, sync;  // of the last repetition
  std::vector<double> step_seconds;   // wall time of each timed repetition on this rank
};

struct LayerRunResult {
  bool is_root = true;  // false on the processes of ranks other than 0 (which hold only their own
                        // entry in `ranks`)
  // As moe::LayerOutput for the whole batch: y [T, M] (x's dtype), routing [T, k], the
  // expert loads / counts summed over the data shards. kPerRank scope: l_aux and z_loss are the
  // mean over the data shards that hold tokens (a shard without tokens reports 0 and is left
  // out; their own values in l_aux_per_shard), capacity the largest.
  moe::LayerOutput output;
  std::vector<float> l_aux_per_shard;
  // With dy: gradients for x [T, M] and the parameters (full shapes, summed over data shards).
  bool has_gradients = false;
  Tensor grad_x;
  moe::LayerParams grads;
  int adaptive_r = 1;
  double predicted_volume = 0;
  int64_t buffer_capacity = 0;
  int overlap_degree = 1;  // as ParallelOutput (rank 0's)
  int smart_group = 0;
  std::vector<int64_t> shadowed;
  CostModel cost_model;           // rank 0's, resolved
  std::vector<RankReport> ranks;  // by world rank
};

// Runs the layer on the launcher's ranks. x [T, M]; dy [T, M] or undefined (forward only).
// Throws what the layer throws (InvalidArgument for bad options or shapes) on the calling thread.
// Sets no process-wide state: the program sets the BLAS threads (kernels::SetBlasThreads).
LayerRunResult RunLayerOnRanks(comm::Launcher& launcher, const moe::LayerConfig& config,
                               const moe::LayerParams& params, const Tensor& x, const Tensor& dy,
                               const DriverOptions& options);

// The contiguous split of T tokens over D shards used when token_split is empty.
std::vector<int64_t> EvenSplit(int64_t num_tokens, int shards);

}  // namespace switchyard::parallel
