// The integer flags of flags.h on their own: AddIntOption / AddIntListOption read the whole
// 64-bit value and range-check it before the (narrower) target sees it, and WithFlagConventions
// gives an integer option that a command binds directly (CLI11 would read it with strtoll, base
// 0: "010" = 8, "0x10" = 16, saturating past 64 bits, "-1" = 2^64 - 1 unsigned) the same strict
// reading, so that no command can wrap a value by forgetting the helper.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/parse_flags.h"
#include "switchyard/core/error.h"

namespace switchyard::cli {
namespace {

TEST(AddIntOption, ChecksTheWholeValueBeforeNarrowing) {
  int ranks = 7;
  auto setup = [&](CLI::App& app) { AddIntOption(app, "--ranks", &ranks, 1, 4096, "W"); };
  EXPECT_EQ(Parse(setup, {"--ranks", "16"}), "");
  EXPECT_EQ(ranks, 16);
  EXPECT_EQ(Parse(setup, {"--ranks", "010"}), "");
  EXPECT_EQ(ranks, 10);
  ranks = 7;
  EXPECT_EQ(Parse(setup, {"--ranks", "4294967297"}),
            "--ranks: '4294967297' is out of range; expected an integer in [1, 4096]");
  EXPECT_EQ(Parse(setup, {"--ranks", "0x10"}),
            "--ranks: '0x10' is not an integer; expected a whole decimal number in [1, 4096]");
  EXPECT_EQ(ranks, 7);  // a refused value is never stored
  // A range wider than the type is a bug in the command, found when it declares the flag.
  int16_t small = 0;
  EXPECT_THROW(Parse([&](CLI::App& app) { AddIntOption(app, "--s", &small, 0, 1 << 20, ""); }, {}),
               InternalError);
}

TEST(AddIntListOption, ChecksEveryItem) {
  std::vector<int> cp = {1};
  auto setup = [&](CLI::App& app) { AddIntListOption(app, "--cp", &cp, 1, 256, "sizes"); };
  EXPECT_EQ(Parse(setup, {"--cp", "1,2,4"}), "");
  EXPECT_EQ(cp, (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(Parse(setup, {"--cp", "2,4294967298"}),
            "--cp: '4294967298' is out of range; expected an integer in [1, 256]");
  EXPECT_EQ(Parse(setup, {"--cp", "2,,4"}),
            "--cp: '' is not an integer; expected a whole decimal number in [1, 256]");
}

TEST(WithFlagConventions, AnIntegerBoundDirectlyIsReadWholeToo) {
  int pp = 3;
  uint64_t step = 5;
  auto setup = [&](CLI::App& app) {
    app.add_option("--pp", pp, "stages");
    app.add_option("--step", step, "step");
  };
  EXPECT_EQ(Parse(setup, {"--pp", "12", "--step", "9"}), "");
  EXPECT_EQ(pp, 12);
  EXPECT_EQ(step, 9u);
  EXPECT_EQ(Parse(setup, {"--step", "-1"}),
            "--step: '-1' is out of range; expected an integer in [0, 9223372036854775807]");
  EXPECT_EQ(Parse(setup, {"--pp", "0x10"}),
            "--pp: '0x10' is not an integer; expected a whole decimal number in "
            "[-9223372036854775808, 9223372036854775807]");
  EXPECT_EQ(Parse(setup, {"--pp", "99999999999999999999"}),
            "--pp: '99999999999999999999' is out of range; expected an integer in "
            "[-9223372036854775808, 9223372036854775807]");
  // A 64-bit value that the int cannot hold: CLI11's own conversion refuses it, quoting it (the
  // parse fails, so the command never runs with it; AddIntOption refuses it before storing).
  EXPECT_EQ(Parse(setup, {"--pp", "4294967297"}), "Could not convert: --pp = 4294967297");
}

}  // namespace
}  // namespace switchyard::cli
