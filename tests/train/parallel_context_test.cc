// The trainer's parallel structure: the ParallelContext built from a mesh's process groups, and
// the named step sums the trainer reduces over the ranks.
#include "switchyard/train/parallel_context.h"

#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "train/step_sums.h"

namespace switchyard::train {
namespace {

parallel::MeshConfig Mesh(int world, int tp, int cp, int pp) {
  parallel::MeshConfig c;
  c.world_size = world;
  c.tp = tp;
  c.cp = cp;
  c.pp = pp;
  return c;
}

TEST(ParallelContextTest, DefaultIsOneRank) {
  const ParallelContext c;
  EXPECT_EQ(c.world_size, 1);
  EXPECT_EQ(c.data_size, 1);
  EXPECT_EQ(c.pp_size, 1);
  EXPECT_TRUE(c.reports_loss);
  EXPECT_TRUE(c.reports_routing);
  EXPECT_TRUE(c.writes_run_directory());
  EXPECT_EQ(c.pipeline, nullptr);
  EXPECT_EQ(c.tensor_parallel.group, nullptr);
}

// Every rank's context agrees with the mesh's coordinates and groups (tp 2 x cp 2 x dp 1 x pp 2).
TEST(ParallelContextTest, FollowsTheMeshCoordinatesAndGroups) {
  const parallel::MeshConfig config = Mesh(8, 2, 2, 2);
  std::mutex mu;
  std::vector<ParallelContext> contexts(8);
  comm::RunInProcess(8, [&](comm::Communicator& world) {
    const parallel::Mesh mesh(config);
    parallel::ProcessGroups groups(world, mesh);
    const ContextParallelOptions cp{.algorithm = CpAlgorithm::kUlysses};
    ParallelContext c = MakeParallelContext(groups, 8, {}, cp, {.zero_stage = 2});
    const parallel::RankCoords& coords = groups.coords();
    EXPECT_EQ(c.rank, world.rank());
    EXPECT_EQ(c.world_size, 8);
    EXPECT_EQ(c.ranks_in_process, 8);
    EXPECT_EQ(c.tp_rank, coords.tp_rank);
    EXPECT_EQ(c.cp_rank, coords.cp_rank);
    EXPECT_EQ(c.pp_rank, coords.pp_rank);
    EXPECT_EQ(c.data_rank, coords.dp_rank);
    EXPECT_EQ(c.data_size, 1);
    EXPECT_EQ(c.routing_replicas, mesh.data_shards());
    ASSERT_NE(c.pipeline, nullptr);
    EXPECT_EQ(c.pipeline->size(), 2);
    EXPECT_EQ(c.pipeline->rank(), coords.pp_rank);
    ASSERT_NE(c.tensor_parallel.group, nullptr);
    EXPECT_EQ(c.tensor_parallel.group->size(), 2);
    ASSERT_NE(c.context_parallel.group, nullptr);
    EXPECT_EQ(c.context_parallel.group->size(), 2);
    EXPECT_EQ(c.context_parallel.options.algorithm, CpAlgorithm::kUlysses);
    // Without sequence parallelism the tp ranks share the loss and the routing.
    EXPECT_EQ(c.reports_loss, coords.tp_rank == 0);
    EXPECT_EQ(c.reports_routing, coords.tp_rank == 0);
    EXPECT_EQ(c.writes_run_directory(), world.rank() == 0);
    c.pipeline = nullptr;  // the groups go with this thread
    c.tensor_parallel.group = c.context_parallel.group = nullptr;
    std::lock_guard<std::mutex> lock(mu);
    contexts[static_cast<size_t>(world.rank())] = c;
  });
  EXPECT_EQ(contexts[0].description, "8 ranks = tp 2 x dp 1 x pp 2 x cp 2 (ulysses); ZeRO stage 2");
  // Each (tp, cp, pp) position is taken by exactly one rank.
  std::vector<int> seen(8, 0);
  for (const ParallelContext& c : contexts)
    ++seen[static_cast<size_t>((c.pp_rank * 2 + c.cp_rank) * 2 + c.tp_rank)];
  for (int n : seen) EXPECT_EQ(n, 1);
}

// One pipeline stage still has its (one-rank) pipeline group: every step runs its schedule on it.
TEST(ParallelContextTest, OneStageHasAOneRankPipelineGroup) {
  comm::RunInProcess(2, [&](comm::Communicator& world) {
    const parallel::Mesh mesh(Mesh(2, 1, 1, 1));
    parallel::ProcessGroups groups(world, mesh);
    const ParallelContext c = MakeParallelContext(groups, 2, {}, {}, {.experts = true});
    ASSERT_NE(c.pipeline, nullptr);
    EXPECT_EQ(c.pipeline->size(), 1);
    EXPECT_EQ(c.tensor_parallel.group, nullptr);
    EXPECT_EQ(c.context_parallel.group, nullptr);
    EXPECT_EQ(c.data_size, 2);
    EXPECT_EQ(c.data_rank, world.rank());
    EXPECT_EQ(c.description,
              "2 ranks = tp 1 x dp 2; experts: ep 2 (deepspeed arrangement), ZeRO stage 0");
  });
}

TEST(ParallelContextTest, RefusesAModelWhoseSequenceParallelismIsNotTheMeshs) {
  comm::RunInProcess(2, [&](comm::Communicator& world) {
    parallel::MeshConfig config = Mesh(2, 2, 1, 1);
    config.sequence_parallel = false;
    const parallel::Mesh mesh(config);
    parallel::ProcessGroups groups(world, mesh);
    EXPECT_THROW(MakeParallelContext(groups, 2, {.sequence_parallel = true}, {}, {}),
                 InvalidArgument);
  });
}

TEST(StepSumsTest, PackPutsTheFieldsInWireOrderAndUnpackInvertsIt) {
  internal::StepSums s;
  double v = 1;
  for (double* f :
       {&s.ce_sum, &s.tokens, &s.ffn_loss, &s.aux_loss, &s.z_loss, &s.moe_s, &s.moe_comm_s,
        &s.nonfinite, &s.rank_time_s, &s.tp_bytes, &s.tp_comm_s, &s.cp_bytes, &s.cp_comm_s}) {
    *f = v++;
  }
  s.routing.push_back({.routed = 20, .dropped = 21, .expert_loads = {22, 23}, .expert_counts = {}});
  s.routing.push_back(
      {.routed = 30, .dropped = 31, .expert_loads = {32, 33, 34}, .expert_counts = {}});
  const std::vector<double> packed = s.Pack();
  const std::vector<double> expected = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                                        12, 13, 20, 21, 22, 23, 30, 31, 32, 33, 34};
  EXPECT_EQ(packed, expected);
  const std::vector<int64_t> experts = {2, 3};
  const internal::StepSums u = internal::StepSums::Unpack(packed, experts);
  EXPECT_EQ(u.Pack(), packed);
  EXPECT_EQ(u.ce_sum, 1);
  EXPECT_EQ(u.cp_comm_s, 13);
  ASSERT_EQ(u.routing.size(), 2u);
  EXPECT_EQ(u.routing[1].dropped, 31);
  EXPECT_EQ(u.routing[1].expert_loads, (std::vector<double>{32, 33, 34}));
  // A dense model: the scalars only.
  internal::StepSums dense;
  dense.tokens = 5;
  EXPECT_EQ(internal::StepSums::Unpack(dense.Pack(), {}).tokens, 5);
}

// The kept counts go after every existing field (the wire order above unchanged).
TEST(StepSumsTest, KeptCountsAreAppendedAfterTheOtherFields) {
  internal::StepSums s;
  s.tokens = 2;
  s.cp_comm_s = 13;
  s.routing.push_back(
      {.routed = 20, .dropped = 21, .expert_loads = {22, 23}, .expert_counts = {40, 41}});
  s.routing.push_back(
      {.routed = 30, .dropped = 31, .expert_loads = {32, 33, 34}, .expert_counts = {50, 51, 52}});
  const std::vector<double> packed = s.Pack();
  const std::vector<double> expected = {0,  2,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  13, 20,
                                        21, 22, 23, 30, 31, 32, 33, 34, 40, 41, 50, 51, 52};
  EXPECT_EQ(packed, expected);
  const internal::StepSums u = internal::StepSums::Unpack(packed, std::vector<int64_t>{2, 3});
  EXPECT_EQ(u.Pack(), packed);
  EXPECT_EQ(u.routing[0].expert_loads, (std::vector<double>{22, 23}));
  EXPECT_EQ(u.routing[0].expert_counts, (std::vector<double>{40, 41}));
  EXPECT_EQ(u.routing[1].expert_counts, (std::vector<double>{50, 51, 52}));
}

}  // namespace
}  // namespace switchyard::train
