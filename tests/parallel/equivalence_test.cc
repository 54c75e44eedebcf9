// The parallel MoE layer against the single-rank layer, ranks as threads (in-process transport):
// every layout of parallel_cases.h for W in {1, 2, 3, 4, 8}, in dropless mode and in global-batch
// capacity mode (equal to moe::MoeLayer on the whole batch), and in per-rank capacity mode (equal
// to one moe::MoeLayer per data shard). Uneven loads and experts without tokens come from the
// skewed gate of MakeInputs; ranks without tokens from uneven token splits. Which layouts run for
// each (W, E) is written out below and checked, so a layout cannot drop out unnoticed.
#include <gtest/gtest.h>

#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "parallel/parallel_cases.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/losses.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::parallel {
namespace {

using testing::Inputs;
using testing::Layout;
using testing::MakeInputs;
using testing::MatchesReference;
using testing::SmallConfig;

// W ranks with E experts, and the layouts expected to run there, written out: a layout that
// stops being generated (or a new one) fails ListsExactlyTheExpectedLayouts and the runs below
// instead of silently changing what is tested.
struct WorldCase {
  int world_size;
  int64_t num_experts;
  std::vector<std::string> layouts;
};

void PrintTo(const WorldCase& wc, std::ostream* os) {
  *os << "W=" << wc.world_size << " E=" << wc.num_experts;
}

std::vector<WorldCase> WorldCases() {
  // Every W: the DeepSpeed all-to-all, all-to-all-v and allgather dispatchers and ZeRO-style r 0.
  const std::vector<std::string> w1 = {"ds_alltoall", "ds_alltoallv", "ds_allgather", "ds_r0"};
  // Even W, experts not sharded (E >= W): tp 2 with and without de-duplication, EP replicas,
  // Megatron's folding.
  const std::vector<std::string> w2 = {
      "ds_alltoall",    "ds_alltoallv",      "ds_allgather",
      "ds_r0",          "ds_tp2_dedup",      "ds_tp2_dedup_alltoallv",
      "ds_tp2_nodedup", "ds_ep_replicas",    "mg_etp2",
      "mg_etp2_r1",     "mg_etp2_allgather", "mg_tp2_sp"};
  const std::vector<std::string> w4 = {
      "ds_alltoall",  "ds_alltoallv",           "ds_allgather",   "ds_r0",          "ds_2dh",
      "ds_tp2_dedup", "ds_tp2_dedup_alltoallv", "ds_tp2_nodedup", "ds_ep_replicas", "mg_etp2",
      "mg_etp2_r1",   "mg_etp2_allgather",      "mg_tp2_sp"};
  std::vector<std::string> w8_e8 = w4;
  w8_e8.push_back("mg_etp2_ep2_edp2");
  return {
      {1, 4, w1},
      {2, 4, w2},
      {3, 6, w1},
      {4, 4, w4},
      {4, 8, w4},
      // E = 2 < W = 4: experts split in n = 2 (r 1, 2, auto); Megatron tp 2 (ep 4) does not fit.
      {4,
       2,
       {"ds_alltoall", "ds_alltoallv", "ds_allgather", "ds_r0", "ds_2dh", "ds_tp2_dedup",
        "ds_tp2_dedup_alltoallv", "ds_tp2_nodedup", "ds_ep_replicas", "ds_sharded_r1",
        "ds_sharded_r2", "ds_sharded_auto", "ds_sharded_r1_alltoallv", "ds_sharded_r1_allgather",
        "mg_etp2", "mg_etp2_r1", "mg_etp2_allgather"}},
      {8, 8, w8_e8},
      // E = 2 < W = 8: n = 4 (r 1, 2, 4, auto); of Megatron's layouts only ep 2 fits E = 2.
      {8,
       2,
       {"ds_alltoall", "ds_alltoallv", "ds_allgather", "ds_r0", "ds_2dh", "ds_tp2_dedup",
        "ds_tp2_dedup_alltoallv", "ds_tp2_nodedup", "ds_ep_replicas", "ds_sharded_r1",
        "ds_sharded_r2", "ds_sharded_r4", "ds_sharded_auto", "ds_sharded_r1_alltoallv",
        "ds_sharded_r1_allgather", "mg_etp2_ep2_edp2"}},
  };
}

// An uneven split with a rank (or two) holding no tokens.
std::vector<int64_t> UnevenSplit(int64_t tokens, int shards) {
  if (shards == 1) return {tokens};
  std::vector<int64_t> split(static_cast<size_t>(shards), 0);
  int64_t left = tokens;
  for (int d = 1; d < shards; ++d) {
    int64_t part = d == 1 ? 0 : std::min<int64_t>(left, (tokens * d) / (shards * 2) + 1);
    split[static_cast<size_t>(d)] = part;
    left -= part;
  }
  split[0] = left;
  return split;
}

class EquivalenceTest : public ::testing::TestWithParam<WorldCase> {};

TEST_P(EquivalenceTest, ListsExactlyTheExpectedLayouts) {
  const WorldCase& wc = GetParam();
  EXPECT_EQ(testing::LayoutNames(testing::LayoutsFor(wc.world_size, wc.num_experts)), wc.layouts)
      << "W=" << wc.world_size << " E=" << wc.num_experts;
}

TEST_P(EquivalenceTest, GlobalScopeEqualsWholeBatch) {
  const WorldCase& wc = GetParam();
  for (bool dropless : {true, false}) {
    const moe::LayerConfig config = SmallConfig(wc.num_experts, dropless, 0.75f);
    const Inputs in = MakeInputs(config, 37, 11);
    const testing::Reference ref = testing::WholeBatchReference(config, in);
    ASSERT_GT(ref.output.dropped, dropless ? -1 : 0) << "the capacity case should drop tokens";
    std::vector<std::string> ran;
    for (const Layout& layout : testing::LayoutsFor(wc.world_size, wc.num_experts)) {
      ran.push_back(layout.name);
      for (bool uneven : {false, true}) {
        DriverOptions o;
        o.parallel = layout.options;
        if (uneven) {
          Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
          o.token_split = UnevenSplit(in.x.size(0), mesh.data_shards());
        }
        LayerRunResult run;
        ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
        EXPECT_TRUE(MatchesReference(run, ref))
            << "W=" << wc.world_size << " E=" << wc.num_experts << " " << layout.name
            << (dropless ? " dropless" : " capacity") << (uneven ? " uneven split" : "");
      }
    }
    EXPECT_EQ(ran, wc.layouts);
  }
}

TEST_P(EquivalenceTest, PerRankScopeEqualsOneLayerPerShard) {
  const WorldCase& wc = GetParam();
  const moe::LayerConfig config = SmallConfig(wc.num_experts, false, 0.75f);
  const Inputs in = MakeInputs(config, 37, 12);
  std::vector<std::string> ran;
  for (const Layout& layout : testing::LayoutsFor(wc.world_size, wc.num_experts)) {
    ran.push_back(layout.name);
    DriverOptions o;
    o.parallel = layout.options;
    o.parallel.batch_scope = BatchScope::kPerRank;
    Mesh mesh = ExpertMesh(layout.options.mesh, config.num_experts, config.hidden_dim);
    o.token_split = UnevenSplit(in.x.size(0), mesh.data_shards());
    const testing::Reference ref = testing::PerShardReference(config, in, o.token_split);
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
    EXPECT_TRUE(MatchesReference(run, ref))
        << "W=" << wc.world_size << " E=" << wc.num_experts << " " << layout.name;
    EXPECT_EQ(run.l_aux_per_shard, ref.l_aux_per_shard) << layout.name;
  }
  EXPECT_EQ(ran, wc.layouts);
}

INSTANTIATE_TEST_SUITE_P(Worlds, EquivalenceTest, ::testing::ValuesIn(WorldCases()),
                         [](const ::testing::TestParamInfo<WorldCase>& param_info) {
                           return "W" + std::to_string(param_info.param.world_size) + "_E" +
                                  std::to_string(param_info.param.num_experts);
                         });

}  // namespace
}  // namespace switchyard::parallel
