// The parallel MoE layer against the single-rank layer, ranks as threads (in-process transport):
// every layout of the issue for W in {1, 2, 3, 4, 8}, in dropless mode and in global-batch
// capacity mode (equal to moe::MoeLayer on the whole batch), and in per-rank capacity mode (equal
// to one moe::MoeLayer per data shard). Uneven loads and experts without tokens come from the
// skewed gate of MakeInputs; ranks without tokens from uneven token splits.
#include <gtest/gtest.h>

#include <cstring>

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

// W ranks with E experts.
struct WorldCase {
  int world_size;
  int64_t num_experts;
};

std::vector<WorldCase> WorldCases() {
  return {{1, 4}, {2, 4}, {3, 6}, {4, 4}, {4, 8}, {4, 2}, {8, 8}, {8, 2}};
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

TEST_P(EquivalenceTest, GlobalScopeEqualsWholeBatch) {
  const WorldCase wc = GetParam();
  for (bool dropless : {true, false}) {
    const moe::LayerConfig config = SmallConfig(wc.num_experts, dropless, 0.75f);
    const Inputs in = MakeInputs(config, 37, 11);
    const testing::Reference ref = testing::WholeBatchReference(config, in);
    ASSERT_GT(ref.output.dropped, dropless ? -1 : 0) << "the capacity case should drop tokens";
    for (const Layout& layout : testing::LayoutsFor(wc.world_size, wc.num_experts)) {
      for (bool uneven : {false, true}) {
        DriverOptions o;
        o.parallel = layout.options;
        if (uneven) {
          Mesh mesh(layout.options.mesh, config.num_experts, config.hidden_dim);
          o.token_split = UnevenSplit(in.x.size(0), mesh.data_shards());
        }
        LayerRunResult run;
        ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
        EXPECT_TRUE(MatchesReference(run, ref))
            << "W=" << wc.world_size << " E=" << wc.num_experts << " " << layout.name
            << (dropless ? " dropless" : " capacity") << (uneven ? " uneven split" : "");
      }
    }
  }
}

TEST_P(EquivalenceTest, PerRankScopeEqualsOneLayerPerShard) {
  const WorldCase wc = GetParam();
  const moe::LayerConfig config = SmallConfig(wc.num_experts, false, 0.75f);
  const Inputs in = MakeInputs(config, 37, 12);
  for (const Layout& layout : testing::LayoutsFor(wc.world_size, wc.num_experts)) {
    DriverOptions o;
    o.parallel = layout.options;
    o.parallel.batch_scope = BatchScope::kPerRank;
    Mesh mesh(layout.options.mesh, config.num_experts, config.hidden_dim);
    o.token_split = UnevenSplit(in.x.size(0), mesh.data_shards());
    const testing::Reference ref = testing::PerShardReference(config, in, o.token_split);
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
    EXPECT_TRUE(MatchesReference(run, ref))
        << "W=" << wc.world_size << " E=" << wc.num_experts << " " << layout.name;
    EXPECT_EQ(run.l_aux_per_shard, ref.l_aux_per_shard) << layout.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, EquivalenceTest, ::testing::ValuesIn(WorldCases()),
                         [](const ::testing::TestParamInfo<WorldCase>& param_info) {
                           return "W" + std::to_string(param_info.param.world_size) + "_E" +
                                  std::to_string(param_info.param.num_experts);
                         });

}  // namespace
}  // namespace switchyard::parallel
