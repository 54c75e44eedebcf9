#include "switchyard/core/limits.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cmath>
#include <limits>

#include "switchyard/core/error.h"
#include "switchyard/core/hash.h"

namespace switchyard {
namespace {

TEST(CheckedToInt64, AcceptsIntegersInRange) {
  EXPECT_EQ(CheckedToInt64(0.0, "x", 0, 10), 0);
  EXPECT_EQ(CheckedToInt64(10.0, "x", 0, 10), 10);
  EXPECT_EQ(CheckedToInt64(-3.0, "x", -5, 10), -3);
  EXPECT_EQ(CheckedToInt64(4.9, "x", 0, 10), 4);  // truncates: the caller rounds first
}

TEST(CheckedToInt64, RejectsOutOfRangeAndNonFinite) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double v : {11.0, -1.0, 1e30, -1e30, 3e18, 9.3e18, inf, -inf, std::nan("")}) {
    try {
      CheckedToInt64(v, "capacity", 0, 10);
      ADD_FAILURE() << "accepted " << v;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
    }
  }
  // The full int64 range: 2^63 itself does not fit.
  EXPECT_THROW(CheckedToInt64(9223372036854775808.0, "x", std::numeric_limits<int64_t>::min(),
                              std::numeric_limits<int64_t>::max()),
               InvalidArgument);
}

TEST(CheckedMul, DetectsOverflowAndNegatives) {
  EXPECT_EQ(CheckedMul(1 << 20, 1 << 20, "x"), int64_t{1} << 40);
  EXPECT_THROW(CheckedMul(int64_t{1} << 40, int64_t{1} << 40, "x"), InvalidArgument);
  EXPECT_THROW(CheckedMul(-1, 5, "x"), InvalidArgument);
}

TEST(RequireMemory, RefusesMoreThanAvailableAndSaysHowMuch) {
  uint64_t available = AvailableMemoryBytes();
  ASSERT_GT(available, uint64_t{1} << 20);
  EXPECT_NO_THROW(RequireMemory(1 << 20, "a small buffer"));
  try {
    RequireMemory(available + (uint64_t{1} << 40), "the expert buffer");
    ADD_FAILURE() << "accepted more than available";
  } catch (const InvalidArgument& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("the expert buffer needs"), std::string::npos) << m;
    EXPECT_NE(m.find("TiB"), std::string::npos) << m;
  }
  EXPECT_THROW(RequireMemory(~uint64_t{0}, "x"), InvalidArgument);
}

TEST(FormatBytes, Units) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.0 GiB");
}

TEST(FnvHash, StandardVectorsAndContinuation) {
  auto bytes = [](std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); };
  EXPECT_EQ(FnvHash({}), kFnv1a64Basis);
  EXPECT_EQ(FnvHash(bytes("a")), 0xaf63dc4c8601ec8cull);  // published FNV-1a 64 vectors
  EXPECT_EQ(FnvHash(bytes("foobar")), 0x85944171f73967e8ull);
  EXPECT_EQ(FnvHash(bytes("bar"), FnvHash(bytes("foo"))), FnvHash(bytes("foobar")));
}

}  // namespace
}  // namespace switchyard
