// The overlap pipelines' concurrency, small enough to run under ThreadSanitizer: ranks as threads
// computing while their communicators' progress threads run the chunk transfers, for one layout of
// each schedule kind (W = 4), and ranks that disagree on the schedule failing instead of hanging
// (the failure path: peers abandon their transfers while others are still matching them). The
// full schedule matrix is overlap_test.cc. CI's tsan stage runs this binary.
#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "parallel/parallel_cases.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::parallel {
namespace {

using testing::Inputs;
using testing::MakeInputs;
using testing::SmallConfig;

TEST(OverlapConcurrency, OneLayoutOfEachScheduleEqualsWholeBatch) {
  const moe::LayerConfig config = SmallConfig(4, true);
  const Inputs in = MakeInputs(config, 29, 41);
  const testing::Reference ref = testing::WholeBatchReference(config, in);
  int ran = 0;
  for (const testing::Layout& layout : testing::OverlapLayoutsFor(4, 4)) {
    if (layout.name != "a2a_d3" && layout.name != "a2av_d2" && layout.name != "smart_g1" &&
        layout.name != "shadow_0_1_d2_smart_g1") {
      continue;
    }
    DriverOptions o;
    o.parallel = layout.options;
    comm::InProcessOptions inprocess;
    inprocess.timeout = comm::Milliseconds(60000);
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o, inprocess))
        << layout.name;
    EXPECT_TRUE(testing::MatchesReference(run, ref)) << layout.name;
    ++ran;
  }
  EXPECT_EQ(ran, 4);
}

TEST(OverlapConcurrency, RanksDisagreeingOnTheScheduleFailInsteadOfHanging) {
  // Rank 0 pipelines in 3 chunks, the others in 1: their collectives do not match. Every rank
  // must come back with an error (PeerError or TimeoutError) within the deadline.
  const moe::LayerConfig config = SmallConfig(4, true);
  const Inputs in = MakeInputs(config, 16, 27);
  comm::InProcessOptions io;
  io.timeout = comm::Milliseconds(2000);
  std::atomic<int> failed{0};
  EXPECT_THROW(comm::RunInProcess(
                   4,
                   [&](comm::Communicator& world) {
                     ParallelOptions p;
                     p.mesh.world_size = 4;
                     p.dispatch = DispatchKind::kAllToAllV;
                     p.overlap_degree = world.rank() == 0 ? 3 : 1;
                     ParallelMoeLayer layer(config, p, MakeLayerGroups(world, config, p));
                     const moe::LayerParams params = layer.ShardParams(in.params);
                     const Tensor x = in.x.Slice(4 * world.rank(), 4 * world.rank() + 4);
                     try {
                       ParallelOutput out = layer.Forward(params, x);
                       layer.Backward(params, out, in.dy.Slice(0, 4));
                     } catch (const Error&) {
                       failed.fetch_add(1);
                       throw;
                     }
                   },
                   io),
               Error);
  EXPECT_GE(failed.load(), 1);
}

}  // namespace
}  // namespace switchyard::parallel
