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

TEST(ParseInt64InRange, ReadsTheWholeNumberBeforeComparing) {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(ParseInt64InRange("0", "--x", 0, 10), 0);
  EXPECT_EQ(ParseInt64InRange("+7", "--x", 0, 10), 7);
  EXPECT_EQ(ParseInt64InRange("-3", "--x", -5, 10), -3);
  EXPECT_EQ(ParseInt64InRange("010", "--x", 0, 100), 10);  // decimal, never octal
  EXPECT_EQ(ParseInt64InRange("9223372036854775807", "--x", kMin, kMax), kMax);
  EXPECT_EQ(ParseInt64InRange("-9223372036854775808", "--x", kMin, kMax), kMin);
  EXPECT_EQ(ParseInt64InRange("-0000000000000000000009223372036854775808", "--x", kMin, kMax),
            kMin);
  // Values that wrapped or saturated in a narrower type (4294967297 is 1 as a 32-bit int) or
  // beyond 64 bits: refused, quoting the text as given.
  for (const char* text :
       {"4294967297", "4294967296", "18446744073709551617", "-1", "9223372036854775808",
        "-9223372036854775809", "99999999999999999999", "11"}) {
    SCOPED_TRACE(text);
    try {
      ParseInt64InRange(text, "--ranks", 0, 10);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()), std::string("--ranks: '") + text +
                                           "' is out of range; expected an integer in [0, 10]");
    }
  }
  EXPECT_THROW(ParseInt64InRange("9223372036854775808", "--x", kMin, kMax), InvalidArgument);
  // Not integers: hex and octal prefixes, exponents, fractions, spaces, signs alone, nothing.
  for (const char* text :
       {"0x10", "1e3", "1.0", "1.", " 1", "1 ", "1k", "--1", "+-1", "-", "+", "", "nan", "inf"}) {
    SCOPED_TRACE(text);
    try {
      ParseInt64InRange(text, "--pp", 1, 64);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                std::string("--pp: '") + text +
                    "' is not an integer; expected a whole decimal number in [1, 64]");
    }
  }
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
