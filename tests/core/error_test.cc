#include "switchyard/core/error.h"

#include <gtest/gtest.h>

#include <string>

#include "switchyard/core/threading.h"

namespace switchyard {
namespace {

TEST(Error, CheckReportsFileLineAndMessage) {
  try {
    int x = 3;
    SY_CHECK(x == 4, "x was {}", x);
    FAIL() << "no error";
  } catch (const InternalError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("error_test.cc:"), std::string::npos) << what;
    EXPECT_NE(what.find("'x == 4'"), std::string::npos) << what;
    EXPECT_NE(what.find("x was 3"), std::string::npos) << what;
  }
}

TEST(Error, RequireThrowsTheGivenTypeWithMessage) {
  try {
    SY_REQUIRE(false, TimeoutError, "peer {} did not answer within {} ms", 2, 50);
    FAIL() << "no error";
  } catch (const TimeoutError& e) {
    EXPECT_STREQ(e.what(), "peer 2 did not answer within 50 ms");
  }
  // Every kind is a switchyard::Error.
  EXPECT_THROW(SY_REQUIRE(false, IoError, "x"), Error);
  EXPECT_NO_THROW(SY_REQUIRE(true, IoError, "x"));
}

TEST(Threading, PolicyNeverOversubscribes) {
  EXPECT_GE(UsableCores(), 1);
  EXPECT_EQ(ComputeThreadsPerRank(1, 2), 2);
  EXPECT_EQ(ComputeThreadsPerRank(2, 2), 1);
  EXPECT_EQ(ComputeThreadsPerRank(4, 2), 1);
  EXPECT_EQ(ComputeThreadsPerRank(2, 8), 4);
  EXPECT_EQ(ComputeThreadsPerRank(0, 8), 8);
  for (int ranks = 1; ranks <= 16; ++ranks) {
    for (int cores = 1; cores <= 16; ++cores) {
      int t = ComputeThreadsPerRank(ranks, cores);
      EXPECT_GE(t, 1);
      if (ranks <= cores) {
        EXPECT_LE(t * ranks, cores);
      }
    }
  }
}

}  // namespace
}  // namespace switchyard
