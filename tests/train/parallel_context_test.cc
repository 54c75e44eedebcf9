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
  // Per block its 9 scalars (routed, dropped, tokens, entropy, l_aux, z_loss, calls, bias range),
  // then its loads.
  s.routing.push_back({.routed = 20,
                       .dropped = 21,
                       .num_tokens = 22,
                       .entropy = 23,
                       .l_aux = 24,
                       .z_loss = 25,
                       .calls = 26,
                       .bias_min = 27,
                       .bias_max = 28,
                       .expert_loads = {29, 30},
                       .expert_counts = {}});
  s.routing.push_back({.routed = 40,
                       .dropped = 41,
                       .num_tokens = 42,
                       .entropy = 43,
                       .l_aux = 44,
                       .z_loss = 45,
                       .calls = 46,
                       .bias_min = 47,
                       .bias_max = 48,
                       .expert_loads = {49, 50, 51},
                       .expert_counts = {}});
  const std::vector<double> packed = s.Pack();
  const std::vector<double> expected = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12,
                                        13, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
                                        40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51};
  EXPECT_EQ(packed, expected);
  const std::vector<int64_t> experts = {2, 3};
  const internal::StepSums u = internal::StepSums::Unpack(packed, experts);
  EXPECT_EQ(u.Pack(), packed);
  EXPECT_EQ(u.ce_sum, 1);
  EXPECT_EQ(u.cp_comm_s, 13);
  ASSERT_EQ(u.routing.size(), 2u);
  EXPECT_EQ(u.routing[1].dropped, 41);
  EXPECT_EQ(u.routing[1].num_tokens, 42);
  EXPECT_EQ(u.routing[1].calls, 46);
  EXPECT_EQ(u.routing[1].bias_max, 48);
  EXPECT_EQ(u.routing[1].expert_loads, (std::vector<double>{49, 50, 51}));
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
  const std::vector<double> expected = {0,  2, 0, 0, 0, 0,  0,  0,  0,  0,  0,  0,  13, 20,
                                        21, 0, 0, 0, 0, 0,  0,  0,  22, 23, 30, 31, 0,  0,
                                        0,  0, 0, 0, 0, 32, 33, 34, 40, 41, 50, 51, 52};
  EXPECT_EQ(packed, expected);
  const internal::StepSums u = internal::StepSums::Unpack(packed, std::vector<int64_t>{2, 3});
  EXPECT_EQ(u.Pack(), packed);
  EXPECT_EQ(u.routing[0].expert_loads, (std::vector<double>{22, 23}));
  EXPECT_EQ(u.routing[0].expert_counts, (std::vector<double>{40, 41}));
  EXPECT_EQ(u.routing[1].expert_counts, (std::vector<double>{50, 51, 52}));
}

// A block's routing sums add calls, and its statistics are those of the sums: loads 3 and 1 over
// two calls of 2 tokens (top-2) with one drop, entropies and losses summed, the bias range of
// the calls (each the same) taken once.
TEST(StepSumsTest, RoutingAddsCallsAndItsStatisticsAreThoseOfTheSums) {
  internal::StepSums::Routing r;
  RoutingStats call{.expert_loads = {2, 0},
                    .expert_counts = {2, 0},
                    .routed = 2,
                    .dropped = 1,
                    .num_tokens = 1,
                    .entropy_sum = 0.5,
                    .l_aux = 1.5,
                    .z_loss = 0.25,
                    .bias_min = -0.5,
                    .bias_max = 0.75,
                    .concat_sums = {}};
  r.Add(call);
  call.expert_loads = {1, 1};
  call.dropped = 0;
  call.entropy_sum = 0.25;
  call.l_aux = 0.5;
  call.z_loss = 0.75;
  r.Add(call);
  EXPECT_EQ(r.calls, 2);
  EXPECT_EQ(r.expert_loads, (std::vector<double>{3, 1}));
  const moe::RouterStats st = r.Stats();
  EXPECT_EQ(st.num_tokens, 2);
  EXPECT_EQ(st.routed, 4);
  EXPECT_EQ(st.min_load, 1);
  EXPECT_EQ(st.max_load, 3);
  EXPECT_DOUBLE_EQ(st.max_over_mean, 1.5);
  EXPECT_DOUBLE_EQ(st.cv, 0.5);  // std 1 over mean 2
  EXPECT_DOUBLE_EQ(st.dropped_share, 0.25);
  EXPECT_DOUBLE_EQ(st.entropy, 0.375);  // 0.75 over 2 tokens
  EXPECT_DOUBLE_EQ(st.l_aux, 1.0);
  EXPECT_DOUBLE_EQ(st.z_loss, 0.5);
  EXPECT_EQ(st.bias_min, -0.5);
  EXPECT_EQ(st.bias_max, 0.75);
}

}  // namespace
}  // namespace switchyard::train
