// `switchyard bench layer --ranks W` with routing options: the token all-to-all bytes each rank
// measured equal the formula recounted from the routes (docs/moe.md, "Device-limited routing and
// the all-to-all volume"); group-limited routing bounds the other ranks a token reaches, and
// the per-destination-rank dispatch then moves fewer bytes than one row per pair;
// --imbalance (Zipf forced routes) loads the busiest rank more than uniform routes; bad uses are
// exit 2.
#include <gtest/gtest.h>

#include <string>

#include "cli/run_switchyard.h"

namespace switchyard::testing {
namespace {

const std::string kLayer =
    "bench layer --tokens 64 --model-dim 16 --hidden-dim 16 --experts 8 --top-k 2 --dropless "
    "--dispatch alltoallv --rounds 1 --repeat 1 --warmup 0 --no-reference --json ";

nlohmann::json Routing(const std::string& flags) {
  const CliResult r = RunSwitchyard(kLayer + flags);
  EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.err;
  const auto lines = JsonLinesOf(r.out);
  if (lines.size() != 1) {
    ADD_FAILURE() << flags << ": expected one JSON line, got\n" << r.out;
    return nlohmann::json::object();
  }
  return lines[0].at("routing");
}

// Measured (the dispatcher's counters) equals the formula (a recount of the routes), and the
// pairs are the batch's: W x 64 tokens x k 2.
void ExpectVolumeMatches(const nlohmann::json& v, int ranks, const std::string& what) {
  ASSERT_TRUE(v.is_object()) << what << ": " << v.dump();
  EXPECT_EQ(v.at("pairs").get<int64_t>(), ranks * 64 * 2) << what;
  EXPECT_GT(v.at("max_rank_token_bytes").get<double>(), 0) << what;
  EXPECT_EQ(v.at("max_rank_token_bytes").get<double>(),
            v.at("max_rank_token_bytes_formula").get<double>())
      << what;
}

TEST(BenchRoutingTest, GroupLimitBoundsTheRanksOfEveryToken) {
  const nlohmann::json free = Routing("--ranks 4");
  const nlohmann::json limited = Routing("--ranks 4 --num-groups 4 --group-topk 1");
  ExpectVolumeMatches(free.at("volume"), 4, "no limit");
  ExpectVolumeMatches(limited.at("volume"), 4, "group_topk 1");
  EXPECT_EQ(limited.at("group_topk").get<int64_t>(), 1);
  // With one group (one rank's experts) per token, at most one other rank; without, more.
  const double limited_ranks = limited["volume"]["distinct_other_ranks_per_token"].get<double>();
  const double free_ranks = free["volume"]["distinct_other_ranks_per_token"].get<double>();
  EXPECT_LE(limited_ranks, 1.0);
  EXPECT_GT(free_ranks, limited_ranks);
}

// alltoallv sends a token once per destination rank by default: with group_topk 1 a token's two
// experts sit on one rank, so it moves fewer bytes than one row per pair (--no-dispatch-dedup),
// and each run's measured bytes equal its own formula.
TEST(BenchRoutingTest, PerRankDispatchMovesFewerBytesUnderTheGroupLimit) {
  const std::string limit = "--ranks 4 --num-groups 4 --group-topk 1";
  const nlohmann::json per_rank = Routing(limit).at("volume");
  const nlohmann::json per_pair = Routing(limit + " --no-dispatch-dedup").at("volume");
  ExpectVolumeMatches(per_rank, 4, "per rank");
  ExpectVolumeMatches(per_pair, 4, "per pair");
  EXPECT_TRUE(per_rank.at("per_rank_dispatch").get<bool>());
  EXPECT_FALSE(per_pair.at("per_rank_dispatch").get<bool>());
  EXPECT_EQ(per_pair.at("max_rank_token_bytes").get<double>(),
            per_pair.at("max_rank_token_bytes_formula_per_pair").get<double>());
  EXPECT_LT(per_rank.at("max_rank_token_bytes").get<double>(),
            per_pair.at("max_rank_token_bytes").get<double>());
}

TEST(BenchRoutingTest, ImbalanceLoadsTheBusiestRankMoreThanUniformRoutes) {
  const nlohmann::json j = Routing("--ranks 4 --imbalance 2");
  EXPECT_EQ(j.at("imbalance").get<double>(), 2.0);
  ExpectVolumeMatches(j.at("volume"), 4, "Zipf(2)");
  ExpectVolumeMatches(j.at("uniform_volume"), 4, "uniform");
  EXPECT_GT(j["volume"]["max_rank_token_bytes"].get<double>(),
            j["uniform_volume"]["max_rank_token_bytes"].get<double>());
  EXPECT_GT(j.at("step_median_ms").get<double>(), 0);
  EXPECT_GT(j.at("uniform_step_median_ms").get<double>(), 0);
}

TEST(BenchRoutingTest, BadUsesAreExit2) {
  for (const std::string& flags :
       {std::string("--imbalance 1"), std::string("--ranks 2 --imbalance -1"),
        std::string("--ranks 2 --num-groups 3 --group-topk 1")}) {
    const CliResult r = RunSwitchyard(kLayer + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.err;
  }
  const CliResult r = RunSwitchyard(kLayer + "--imbalance 1");
  EXPECT_NE(r.err.find("--imbalance"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace switchyard::testing
