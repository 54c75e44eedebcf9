// The command line's number grammar (src/cli/parse_numbers.h) and the library's check of the
// in-process emulation options: every bad value is an InvalidArgument naming the flag (or field)
// and the value.
#include "cli/parse_numbers.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"

namespace switchyard::cli {
namespace {

// The message of the InvalidArgument `fn` throws ("" if it throws none).
template <typename Fn>
std::string ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(ParseByteSize, SuffixesArePowersOf1024) {
  EXPECT_EQ(ParseByteSize("0", "--sizes"), 0u);
  EXPECT_EQ(ParseByteSize("4096", "--sizes"), 4096u);
  EXPECT_EQ(ParseByteSize("64K", "--sizes"), 65536u);
  EXPECT_EQ(ParseByteSize("64k", "--sizes"), 65536u);
  EXPECT_EQ(ParseByteSize("64KiB", "--sizes"), 65536u);
  EXPECT_EQ(ParseByteSize("1.5M", "--sizes"), 1572864u);
  EXPECT_EQ(ParseByteSize("2G", "--sizes"), uint64_t{2} << 30);
  EXPECT_EQ(ParseByteSize("1T", "--sizes"), uint64_t{1} << 40);
  EXPECT_EQ(ParseByteSize("1P", "--sizes"), uint64_t{1} << 50);
  EXPECT_EQ(ParseByteSize("2e3", "--sizes"), 2000u);
  EXPECT_EQ(ParseByteSize("1e12", "--sizes"), uint64_t{1000000000000});
  EXPECT_EQ(ParseByteSize(".5K", "--sizes"), 512u);
  EXPECT_EQ(ParseByteSize("12B", "--sizes"), 12u);
}

TEST(ParseByteSize, RejectsWhatIsNotANonNegativeWholeNumberOfBytes) {
  for (const char* bad : {"-1", "-1M", "+1", "nan", "NaN", "inf", "-inf", "infinity", "", " 1",
                          "1 ", "0x10", "K", "1X", "1KK", "1e", "1.5.5", "1,5", "e3"}) {
    SCOPED_TRACE(bad);
    const std::string e = ErrorOf([&] { ParseByteSize(bad, "--sizes"); });
    EXPECT_NE(e.find("--sizes"), std::string::npos) << e;
    EXPECT_NE(e.find(std::string("'") + bad + "'"), std::string::npos) << e;
  }
  EXPECT_NE(ErrorOf([] { ParseByteSize("1.5", "--sizes"); }).find("not a whole number"),
            std::string::npos);
  EXPECT_NE(ErrorOf([] { ParseByteSize("0.3K", "--sizes"); }).find("not a whole number"),
            std::string::npos);
  for (const char* huge : {"2P", "1e300", "1e400", "18446744073709551616", "99999999999999999T"}) {
    SCOPED_TRACE(huge);
    EXPECT_NE(ErrorOf([&] { ParseByteSize(huge, "--sizes"); }).find("too large"),
              std::string::npos);
  }
}

TEST(ParseSizeList, ListsAndRanges) {
  EXPECT_EQ(ParseSizeList("1K,64K,1M", "--sizes"), (std::vector<uint64_t>{1024, 65536, 1 << 20}));
  EXPECT_EQ(ParseSizeList("1K:64K", "--sizes"), (std::vector<uint64_t>{1024, 4096, 16384, 65536}));
  EXPECT_EQ(ParseSizeList("1K:5K:2", "--sizes"), (std::vector<uint64_t>{1024, 2048, 4096}));
  EXPECT_EQ(ParseSizeList("0,1K:2K:2", "--sizes"), (std::vector<uint64_t>{0, 1024, 2048}));
  // The largest range ends (does not wrap around and loop).
  EXPECT_EQ(ParseSizeList("1:1P:2", "--sizes").size(), 51u);
  EXPECT_EQ(ParseSizeList("512T:1P:1024", "--sizes").size(), 1u);
}

TEST(ParseSizeList, BadListsAndRangesNameTheProblem) {
  struct Case {
    const char* text;
    const char* says;
  };
  for (const Case& c : std::vector<Case>{{"", "empty item"},
                                         {"1K,,2K", "empty item"},
                                         {"1K,", "empty item"},
                                         {"0:4K", "1 <= FROM <= TO"},
                                         {"4K:1K", "1 <= FROM <= TO"},
                                         {"1K:4K:1", "FACTOR"},
                                         {"1K:4K:0", "FACTOR"},
                                         {"1K:4K:2.5", "FACTOR"},
                                         {"1K:4K:-2", "FACTOR"},
                                         {"1K:4K:nan", "FACTOR"},
                                         {"1K:4K:2:3", "not a range"},
                                         {"1:18446744073709551615", "too large"},
                                         {"1:2P", "too large"},
                                         {"-1:4K", "not a size"},
                                         {"1:nan", "not a size"}}) {
    SCOPED_TRACE(c.text);
    const std::string e = ErrorOf([&] { ParseSizeList(c.text, "--sizes"); });
    EXPECT_NE(e.find("--sizes"), std::string::npos) << e;
    EXPECT_NE(e.find(c.says), std::string::npos) << e;
  }
  // More sizes than anyone benchmarks.
  std::string many;
  for (int i = 0; i < 300; ++i) many += (i ? "," : "") + std::to_string(i + 1);
  EXPECT_NE(ErrorOf([&] { ParseSizeList(many, "--sizes"); }).find("more than"), std::string::npos);
}

TEST(RoundUpToMultiple, RoundsUpAndChecksTheLimit) {
  EXPECT_EQ(RoundUpToMultiple(0, 4, "--sizes"), 0u);
  EXPECT_EQ(RoundUpToMultiple(1, 4, "--sizes"), 4u);
  EXPECT_EQ(RoundUpToMultiple(4096, 12, "--sizes"), 4104u);
  EXPECT_EQ(RoundUpToMultiple(4104, 12, "--sizes"), 4104u);
  EXPECT_NE(ErrorOf([] { RoundUpToMultiple(kMaxFlagBytes - 1, 1000, "--sizes"); }).find("limit"),
            std::string::npos);
}

TEST(ParseFiniteDouble, AcceptsFiniteNumbersInRangeOnly) {
  EXPECT_EQ(ParseFiniteDouble("12.5", "--x", 0, 100), 12.5);
  EXPECT_EQ(ParseFiniteDouble("-1e-3", "--x", -1, 1), -1e-3);
  EXPECT_EQ(ParseFiniteDouble("0", "--x", 0, 0), 0);
  for (const char* bad : {"nan", "inf", "-inf", "1e999", "0x1p3", "", "1.0f", "--1", "1e"}) {
    SCOPED_TRACE(bad);
    EXPECT_NE(ErrorOf([&] { ParseFiniteDouble(bad, "--x", -1e300, 1e300); }).find("--x"),
              std::string::npos);
  }
  EXPECT_NE(ErrorOf([] { ParseFiniteDouble("-1", "--x", 0, 1); }).find("out of range"),
            std::string::npos);
}

TEST(EmulationOptions, TheLibraryRefusesLinksThatCannotMeetTheDeadline) {
  const comm::Milliseconds deadline{1000};
  EXPECT_EQ(ErrorOf([&] { comm::ValidateEmulationOptions({{5, 10}, {999999, 0}}, deadline); }), "");
  struct Case {
    comm::EmulationOptions e;
    const char* says;
  };
  for (const Case& c :
       std::vector<Case>{{{{1e12, 0}, {0, 0}}, "emulation.intra_node.latency_us is 1e+12 us"},
                         {{{0, 0}, {1e6, 0}}, "emulation.inter_node.latency_us"},
                         {{{NAN, 0}, {0, 0}}, "intra_node.latency_us"},
                         {{{-1, 0}, {0, 0}}, "intra_node.latency_us"},
                         {{{0, -1}, {0, 0}}, "intra_node.bandwidth_gbps"},
                         {{{0, 0}, {0, INFINITY}}, "inter_node.bandwidth_gbps"},
                         {{{0, 0}, {0, 1e-300}}, "inter_node.bandwidth_gbps"}}) {
    SCOPED_TRACE(c.says);
    const std::string e = ErrorOf([&] { comm::ValidateEmulationOptions(c.e, deadline); });
    EXPECT_NE(e.find(c.says), std::string::npos) << e;
  }
  // And RunInProcess checks before any rank runs.
  comm::InProcessOptions options;
  options.timeout = deadline;
  options.emulation = comm::EmulationOptions{{2e6, 0}, {0, 0}};
  EXPECT_NE(ErrorOf([&] {
              comm::RunInProcess(
                  2, [](comm::Communicator&) {}, options);
            }).find("collective deadline (timeout 1000 ms)"),
            std::string::npos);
}

}  // namespace
}  // namespace switchyard::cli
