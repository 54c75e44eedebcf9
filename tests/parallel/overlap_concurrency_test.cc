// The overlap pipelines' concurrency, small enough to run under ThreadSanitizer: ranks as threads
// computing while their communicators' progress threads run the chunk transfers, for one layout of
// each schedule kind (W = 4). The full schedule matrix, and ranks that disagree on the schedule
// failing instead of hanging, are in overlap_test.cc (that failure path trips a ThreadSanitizer
// report inside the comm layer's in-process transport: OpContext::CheckHeader reads the header of
// a receive the peer may be matching at that moment).
#include <gtest/gtest.h>

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
    o.inprocess.timeout = comm::Milliseconds(60000);
    LayerRunResult run;
    ASSERT_NO_THROW(run = RunLayerOnRanks(config, in.params, in.x, in.dy, o)) << layout.name;
    EXPECT_TRUE(testing::MatchesReference(run, ref)) << layout.name;
    ++ran;
  }
  EXPECT_EQ(ran, 4);
}

}  // namespace
}  // namespace switchyard::parallel
