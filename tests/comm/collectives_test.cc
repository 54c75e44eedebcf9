// Every collective x algorithm x dtype x reduce op x element count {0, 1, odd, large} on the
// in-process transport, for W in {1..9, 16} (the hierarchical all-to-all for every divisor of W
// as ranks per node), against the naive reference (collective_cases.h). One test per
// (collective, W): W rank threads run all of that collective's cases in turn. Plus bfloat16 sums
// that tell float32 accumulation from per-step rounding.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "comm/collective_cases.h"
#include "switchyard/comm/inprocess.h"

namespace switchyard::comm {
namespace {

using testing::Case;

struct Param {
  CollectiveKind kind;
  int world_size;
};

class CollectivesTest : public ::testing::TestWithParam<Param> {};

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
// Sanitizer builds look for races and memory errors, not for more combinations: a reduced
// crossing keeps the tsan/asan stages to minutes on 2 cores (the release run crosses everything).
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// Sized so that the large case spans many copy chunks (the test fabric uses 4 KiB chunks).
constexpr size_t kLarge = kSanitized ? 1031 : 5003;

TEST_P(CollectivesTest, MatchesReference) {
  const Param p = GetParam();
  std::vector<Case> cases = testing::CasesFor(p.kind, p.world_size, /*native=*/false, kLarge);
  if (kSanitized && p.world_size > 8) {
    std::erase_if(cases, [](const Case& c) {
      return c.count == 1 || (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16);
    });
  }
  ASSERT_FALSE(cases.empty());
  std::mutex mu;
  std::vector<std::string> failures;
  InProcessOptions options;
  options.copy_chunk_bytes = 4096;  // exercise the chunked, shared copy
  options.timeout = Milliseconds(30000);
  RunInProcess(
      p.world_size,
      [&](Communicator& comm) {
        for (const Case& c : cases) {
          ::testing::AssertionResult ok = testing::RunCase(comm, c);
          if (!ok) {
            std::lock_guard<std::mutex> lock(mu);
            failures.push_back(ok.message());
          }
        }
      },
      options);
  for (size_t i = 0; i < failures.size() && i < 20; ++i) ADD_FAILURE() << failures[i];
  EXPECT_TRUE(failures.empty()) << failures.size() << " failures in " << cases.size() << " cases";
}

// bfloat16 reductions accumulate in float32: non-integer sums, where rounding every partial sum
// to bfloat16 gives other values, against the float64 sum rounded once.
TEST(BFloat16Reductions, AccumulateInFloat32AndRoundOnce) {
  struct Run {
    CollectiveKind kind;
    Algorithm algorithm;
  };
  const std::vector<Run> runs = {
      {CollectiveKind::kAllReduce, Algorithm::kAuto},
      {CollectiveKind::kAllReduce, Algorithm::kRing},
      {CollectiveKind::kAllReduce, Algorithm::kTree},
      {CollectiveKind::kReduce, Algorithm::kTree},
      {CollectiveKind::kReduce, Algorithm::kReduceScatterGather},
      {CollectiveKind::kReduceScatter, Algorithm::kRing},
  };
  InProcessOptions options;
  options.copy_chunk_bytes = 4096;
  options.timeout = Milliseconds(30000);
  for (int w : {2, 3, 4, 5, 8}) {
    RunInProcess(
        w,
        [&](Communicator& comm) {
          for (const Run& run : runs) {
            for (size_t count : {size_t{1}, size_t{37}, kLarge}) {
              EXPECT_TRUE(testing::RunBFloat16SumCase(comm, run.kind, run.algorithm, count));
            }
          }
        },
        options);
  }
}

std::vector<Param> AllParams() {
  std::vector<Param> params;
  for (CollectiveKind kind : testing::CoveredKinds()) {
    for (int w : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16}) params.push_back({kind, w});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(InProcess, CollectivesTest, ::testing::ValuesIn(AllParams()),
                         [](const ::testing::TestParamInfo<Param>& param_info) {
                           return std::string(CollectiveName(param_info.param.kind)) + "_W" +
                                  std::to_string(param_info.param.world_size);
                         });

}  // namespace
}  // namespace switchyard::comm
