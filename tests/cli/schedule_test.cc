// `switchyard schedule` and `switchyard bench pipeline`: the JSON of a schedule (ops per rank,
// bubble against the theory, peak in flight), the SVG timeline, and one-line errors for bad flags.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/run_switchyard.h"

namespace switchyard {
namespace {

using testing::RunSwitchyard;

TEST(ScheduleCli, JsonAndSvgOfEveryKind) {
  struct Case {
    const char* kind;
    int virtual_stages;
    double bubble;  // simulated with F 1, B 2 (Bi 1 + W 1), p 4, m 8
  };
  for (const Case& c : {Case{"fthenb", 1, 9.0 / 33}, Case{"1f1b", 1, 9.0 / 33},
                        Case{"interleaved", 2, 0.0}, Case{"zb-h1", 1, 4.0 / 28}}) {
    const std::string svg = ::testing::TempDir() + "/schedule_" + c.kind + ".svg";
    const auto r = RunSwitchyard(
        fmt::format("schedule --pp 4 --microbatches 8 --kind {} --virtual {} --out {} --json",
                    c.kind, c.virtual_stages, svg));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("ranks").size(), 4u);
    const double bubble = j.at("bubble_fraction").get<double>();
    if (c.bubble > 0) {
      EXPECT_NEAR(bubble, c.bubble, 1e-9) << c.kind;
    } else {  // interleaved: the theory (p - 1) / (v m + p - 1)
      EXPECT_NEAR(bubble, 3.0 / 19, 1e-9) << c.kind;
    }
    if (std::string(c.kind) == "fthenb") {
      EXPECT_EQ(j.at("ranks")[0].at("peak_in_flight"), 8);
    }
    if (std::string(c.kind) == "1f1b") {
      EXPECT_EQ(j.at("ranks")[0].at("peak_in_flight"), 4);
    }
    std::ifstream in(svg);
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_EQ(text.str().rfind("<?xml", 0), 0u) << c.kind;
    EXPECT_NE(text.str().find("</svg>"), std::string::npos) << c.kind;
    EXPECT_NE(text.str().find("#4e79a7"), std::string::npos) << c.kind;  // forward blocks
  }
}

TEST(ScheduleCli, BadFlagsAreOneLineErrors) {
  for (const char* args : {"schedule --pp 0", "schedule --microbatches -1", "schedule --kind gpipe",
                           "schedule --kind 1f1b --virtual 2",
                           "schedule --kind interleaved --pp 4 --microbatches 6 --virtual 2"}) {
    const auto r = RunSwitchyard(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.err.find("error"), std::string::npos) << args << ": " << r.err;
  }
}

// `switchyard bench pipeline`: the executor over emulated links; the activation memory it holds
// per rank is what the simulation predicts (deterministic), the timing is only reported.
TEST(BenchPipelineCli, MeasuredMemoryIsTheSchedulesPeak) {
  for (const char* kind : {"fthenb", "1f1b", "zb-h1"}) {
    const auto r = RunSwitchyard(fmt::format(
        "bench pipeline --pp 3 --microbatches 4 --kind {} --forward-ms 0.5 --activation-kib 4 "
        "--json",
        kind));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    ASSERT_EQ(j.at("ranks").size(), 3u);
    for (const auto& rank : j.at("ranks")) {
      EXPECT_EQ(rank.at("peak_activation_bytes").get<int64_t>(),
                rank.at("simulated_peak_in_flight").get<int64_t>() * 4096)
          << kind;
      EXPECT_EQ(rank.at("peak_in_flight"), rank.at("simulated_peak_in_flight")) << kind;
    }
    const double measured = j.at("measured_bubble_fraction").get<double>();
    EXPECT_GE(measured, 0.0);
    EXPECT_LT(measured, 1.0);
  }
  const auto bad = RunSwitchyard("bench pipeline --pp 0");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--pp"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace switchyard
