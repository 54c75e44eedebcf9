// Shared by the in-process and MPI suites: layer configs, layouts and the comparison of a
// parallel run against the single-rank layer (moe::MoeLayer), which is the reference.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "switchyard/parallel/driver.h"

namespace switchyard::parallel::testing {

// A small layer: M = 16, H = 32 (divisible by 8 shards), k = 2, gelu, biases.
moe::LayerConfig SmallConfig(int64_t num_experts, bool dropless, float capacity_factor = 1.0f);

// Parameters with a skewed gate (experts 0 and 1 popular, the last ones rarely or never chosen)
// and tokens x [T, M] and dy [T, M].
struct Inputs {
  moe::LayerParams params;
  Tensor x, dy;
};
Inputs MakeInputs(const moe::LayerConfig& config, int64_t num_tokens, uint64_t seed);

// What the reference computes for the whole batch (or per shard, assembled like the driver).
struct Reference {
  moe::LayerOutput output;
  std::vector<float> l_aux_per_shard;
  Tensor grad_x;
  moe::LayerParams grads;
};

// moe::MoeLayer on all tokens at once.
Reference WholeBatchReference(const moe::LayerConfig& config, const Inputs& in);

// One moe::MoeLayer per data shard (per-rank batch scope): outputs concatenated, l_aux the mean,
// parameter gradients summed. global_max_load: for capacity_factor <= 0, the largest expert load
// over the expert group (as the parallel layer computes it), per shard.
Reference PerShardReference(const moe::LayerConfig& config, const Inputs& in,
                            const std::vector<int64_t>& split,
                            const std::vector<int64_t>& global_max_load = {});

// Outputs, losses, routing and every gradient within tolerance; routing exactly.
::testing::AssertionResult MatchesReference(const LayerRunResult& run, const Reference& ref,
                                            double rtol = 2e-4, double atol = 2e-5);

// A named layout for parameterized suites.
struct Layout {
  std::string name;
  ParallelOptions options;  // options.mesh.world_size set
};

// The layouts under test for W ranks and E experts (those valid for that W and E): DeepSpeed
// all-to-all / all-to-all-v / allgather, 2DH, tp 2 with and without de-duplication, EP groups
// replicated (ep < W), Tutel's sharded experts with every r, Megatron's folding.
std::vector<Layout> LayoutsFor(int world_size, int64_t num_experts);

// The overlap and scheduling layouts (docs/overlap.md) valid for W ranks and E experts: Tutel's
// overlap degree D for the fixed and variable all-to-all (also with 2DH, TP de-duplication and
// sharded experts), FasterMoE's smart schedule (g = 1, 2, auto; with D = 2), shadow experts (auto
// with a compute-bound cost model, an explicit list; with D and the smart schedule).
std::vector<Layout> OverlapLayoutsFor(int world_size, int64_t num_experts);

// Both functions decide whether a layout applies from the divisibility rules of docs/parallel.md
// ("Layouts and groups"), not by trying the mesh: they throw std::logic_error naming the layout
// when the mesh rejects one the rules call valid, and the suites compare the names with lists
// written out per (W, E).

// The layouts' names, in order.
std::vector<std::string> LayoutNames(const std::vector<Layout>& layouts);

}  // namespace switchyard::parallel::testing

namespace switchyard::parallel {

// The tests are programs too and choose the ranks: RunLayerOnRanks on
// o.parallel.mesh.world_size ranks as threads of this process (with `inprocess`; the cost model
// takes an emulated link's figures unless o.parallel.cost_model has them, as the CLI does) ...
LayerRunResult RunLayerOnRanks(const moe::LayerConfig& config, const moe::LayerParams& params,
                               const Tensor& x, const Tensor& dy, const DriverOptions& o,
                               const comm::InProcessOptions& inprocess = {});
// ... or with this process as one rank of the MPI job.
LayerRunResult RunLayerOnMpiRanks(const moe::LayerConfig& config, const moe::LayerParams& params,
                                  const Tensor& x, const Tensor& dy, const DriverOptions& o);

}  // namespace switchyard::parallel
