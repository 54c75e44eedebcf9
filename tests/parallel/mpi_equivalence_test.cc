// The parallel MoE layer against the single-rank layer on the MPI transport (ranks are processes):
// the main layouts, in dropless and global-batch capacity mode (equal to moe::MoeLayer on the
// whole batch) and per-rank capacity mode (equal to one layer per data shard). Every rank runs the
// same tests in the same order; rank 0 receives the assembled results and checks them:
//   scripts/mpirun.sh -np 4 build/release/tests/parallel/parallel_mpi_test  (ctest: np 2 and 4)
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "parallel/parallel_cases.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/parallel/driver.h"

namespace switchyard::parallel {
namespace {

int g_world_size = 0;

std::vector<testing::Layout> MpiLayouts(int64_t experts) {
  std::vector<testing::Layout> out;
  for (testing::Layout& l : testing::LayoutsFor(g_world_size, experts)) {
    for (const char* name :
         {"ds_alltoall", "ds_alltoallv", "ds_allgather", "ds_2dh", "ds_tp2_dedup", "ds_ep_replicas",
          "ds_sharded_r1", "ds_sharded_r2", "ds_r0", "mg_etp2", "mg_tp2_sp"}) {
      if (l.name == name) out.push_back(l);
    }
  }
  return out;
}

void CheckLayouts(bool dropless, BatchScope scope, int64_t experts) {
  const moe::LayerConfig config = testing::SmallConfig(experts, dropless, 0.75f);
  const testing::Inputs in = testing::MakeInputs(config, 45, 91);
  const std::vector<testing::Layout> layouts = MpiLayouts(experts);
  ASSERT_GE(layouts.size(), 5u) << "W=" << g_world_size << " E=" << experts;
  for (const testing::Layout& layout : layouts) {
    DriverOptions o;
    o.parallel = layout.options;
    o.parallel.batch_scope = scope;
    o.threads = 1;  // 4 processes share 2 cores
    Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
    o.token_split = EvenSplit(in.x.size(0), mesh.data_shards());
    if (o.token_split.size() > 1) {  // one rank without tokens
      o.token_split[0] += o.token_split[1];
      o.token_split[1] = 0;
    }
    LayerRunResult run = RunLayerOnMpiRanks(config, in.params, in.x, in.dy, o);
    if (!run.is_root) continue;
    const testing::Reference ref = scope == BatchScope::kGlobal
                                       ? testing::WholeBatchReference(config, in)
                                       : testing::PerShardReference(config, in, o.token_split);
    EXPECT_TRUE(testing::MatchesReference(run, ref))
        << layout.name << (dropless ? " dropless" : " capacity") << " " << BatchScopeName(scope)
        << " E=" << experts;
  }
}

TEST(MpiEquivalence, DroplessEqualsWholeBatch) {
  CheckLayouts(true, BatchScope::kGlobal, 4);
  CheckLayouts(true, BatchScope::kGlobal, 2);
}

TEST(MpiEquivalence, GlobalCapacityEqualsWholeBatch) {
  CheckLayouts(false, BatchScope::kGlobal, 4);
  CheckLayouts(false, BatchScope::kGlobal, 2);
}

TEST(MpiEquivalence, OverlapSchedulesEqualWholeBatch) {
  // The main schedules of docs/overlap.md over processes: overlap degree (fixed and variable size),
  // the smart schedule, shadow experts; one rank without tokens.
  for (bool dropless : {true, false}) {
    const moe::LayerConfig config = testing::SmallConfig(4, dropless, 0.75f);
    const testing::Inputs in = testing::MakeInputs(config, 45, 92);
    const testing::Reference ref = testing::WholeBatchReference(config, in);
    int checked = 0;
    for (const testing::Layout& layout : testing::OverlapLayoutsFor(g_world_size, 4)) {
      bool main = false;
      for (const char* name : {"a2a_d2", "a2av_d2", "a2a_d2_2dh", "smart_g1", "smart_auto",
                               "shadow_auto", "shadow_0_a2av", "shadow_0_1_d2_smart_g1"}) {
        main |= layout.name == name;
      }
      if (!main) continue;
      DriverOptions o;
      o.parallel = layout.options;
      o.threads = 1;
      o.token_split = EvenSplit(in.x.size(0), g_world_size);
      if (g_world_size > 1) {
        o.token_split[0] += o.token_split[1];
        o.token_split[1] = 0;
      }
      LayerRunResult run = RunLayerOnMpiRanks(config, in.params, in.x, in.dy, o);
      ++checked;
      if (!run.is_root) continue;
      EXPECT_TRUE(testing::MatchesReference(run, ref))
          << layout.name << (dropless ? " dropless" : " capacity");
    }
    EXPECT_GE(checked, 6) << "W=" << g_world_size;
  }
}

TEST(MpiEquivalence, PerRankCapacityEqualsOneLayerPerShard) {
  CheckLayouts(false, BatchScope::kPerRank, 4);
}

// Prints failures of ranks other than 0, prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_,
                   result.file_name() ? result.file_name() : "", result.line_number(),
                   result.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace switchyard::parallel

int main(int argc, char** argv) {
  using namespace switchyard;
  ::testing::InitGoogleTest(&argc, argv);
  if (!comm::RunningUnderMpi()) {
    std::fprintf(stderr, "parallel_mpi_test: run me under MPI, e.g. scripts/mpirun.sh -np 4 %s\n",
                 argv[0]);
    return 2;
  }
  std::unique_ptr<comm::Communicator> world = comm::CreateMpiWorld();
  parallel::g_world_size = world->size();
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new parallel::RankFailurePrinter(world->rank()));
  }
  int rc = RUN_ALL_TESTS();
  int32_t worst = rc;
  comm::AllReduceOptions max;
  max.reduce_op = comm::ReduceOp::kMax;
  world->AllReduce(&worst, &worst, 1, DType::kInt32, max).Wait();
  world.reset();
  comm::FinalizeMpi();
  return worst;
}
