// `switchyard bench cp` end to end (a smoke test: a short sequence, one iteration): every --json
// line carries its fields; the bytes each rank put on the wire equal the closed form of
// docs/context_parallel.md; the per-rank work shows the plain split's causal imbalance and the
// zigzag split's balance; the peak bytes shrink with cp; bad flags exit with code 2 or a clear
// error. Speed is not asserted.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "cli/run_switchyard.h"

namespace switchyard {
namespace {

using testing::CliResult;
using testing::JsonLinesOf;
using testing::RunSwitchyard;

constexpr int64_t kSeq = 128, kHeads = 4, kHeadDim = 8, kD = kHeads * kHeadDim;

TEST(CliBenchCp, JsonLinesCarryEveryFieldBytesAndBalance) {
  CliResult r = RunSwitchyard(
      "bench cp --cp 1,2,4 --seq 128 --heads 4 --head-dim 8 --iters 1 --warmup 0 "
      "--intra-latency-us 10 --intra-gbps 0.5 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<nlohmann::json> lines = JsonLinesOf(r.out);
  ASSERT_EQ(lines.size(), 12u) << r.out;  // 3 cp x 2 algorithms x 2 splits
  std::map<std::tuple<int, std::string, std::string>, nlohmann::json> by;
  for (const nlohmann::json& j : lines) {
    SCOPED_TRACE(j.dump());
    EXPECT_EQ(j.at("op"), "cp");
    EXPECT_EQ(j.at("seq"), kSeq);
    EXPECT_EQ(j.at("heads"), kHeads);
    EXPECT_EQ(j.at("head_dim"), kHeadDim);
    EXPECT_EQ(j.at("emulation").at("gbps"), 0.5);
    const int p = j.at("cp");
    const std::string algo = j.at("algo"), split = j.at("split");
    by[std::make_tuple(p, algo, split)] = j;
    // Bytes per rank per forward + backward, a = seq / P x D x 4.
    const double a = static_cast<double>(kSeq / p * kD * 4);
    const double want = algo == "ulysses" ? 8.0 * (p - 1) / p * a : 6.0 * (p - 1) * a;
    EXPECT_DOUBLE_EQ(j.at("bytes_per_rank_max").get<double>(), want);
    EXPECT_DOUBLE_EQ(j.at("bytes_per_rank_min").get<double>(), want);
    EXPECT_EQ(j.at("bytes_agree"), true);
    EXPECT_EQ(j.at("single_rank_softmax_bytes").get<int64_t>(), kHeads * kSeq * kSeq * 4);
    EXPECT_LT(j.at("peak_forward_bytes").get<int64_t>(), kHeads * kSeq * kSeq * 4);
    EXPECT_GT(j.at("peak_forward_bytes").get<int64_t>(), 0);
    for (const char* key : {"step_median_ms", "rank_compute_max_ms", "rank_compute_min_ms",
                            "comm_alone_ms", "blocked_ms"})
      EXPECT_GE(j.at(key).get<double>(), 0) << key;
    if (p == 1) {
      EXPECT_TRUE(j.at("hidden_fraction").is_null());
    }
    // The ring hides all but its last gradient hop of 3 (P - 1); Ulysses overlaps nothing.
    if (p > 1) {
      EXPECT_DOUBLE_EQ(j.at("hidden_fraction_bound").get<double>(),
                       algo == "ring" ? (3.0 * (p - 1) - 1) / (3.0 * (p - 1)) : 0.0);
    }
    if (!j.at("hidden_fraction").is_null()) {
      EXPECT_GE(j.at("hidden_fraction").get<double>(), 0);
      EXPECT_LE(j.at("hidden_fraction").get<double>(), 1);
    }
  }
  // Work per rank (deterministic): ring + plain gives the last rank cp times the first's; the
  // zigzag split and Ulysses are balanced.
  auto field = [&](int p, const std::string& algo, const std::string& split, const char* key) {
    return by[std::make_tuple(p, algo, split)].at(key);
  };
  for (int p : {2, 4}) {
    EXPECT_EQ(field(p, "ring", "plain", "score_imbalance").get<double>(), p);
    EXPECT_EQ(field(p, "ring", "zigzag", "score_imbalance").get<double>(), 1.0);
    EXPECT_EQ(field(p, "ulysses", "plain", "score_imbalance").get<double>(), 1.0);
    EXPECT_EQ(field(p, "ulysses", "zigzag", "score_imbalance").get<double>(), 1.0);
  }
  // Peak bytes per rank shrink with cp.
  for (const char* algo : {"ring", "ulysses"}) {
    EXPECT_LT(field(4, algo, "zigzag", "peak_forward_bytes").get<int64_t>(),
              field(2, algo, "zigzag", "peak_forward_bytes").get<int64_t>());
    EXPECT_LT(field(2, algo, "zigzag", "peak_forward_bytes").get<int64_t>(),
              field(1, algo, "zigzag", "peak_forward_bytes").get<int64_t>());
  }
}

TEST(CliBenchCp, BadSizesAreRejected) {
  // 100 tokens do not split into 2 x 4 chunks.
  CliResult r = RunSwitchyard("bench cp --cp 4 --seq 100 --iters 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--seq 100"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("multiple of 8"), std::string::npos) << r.err;
  // Ulysses needs the heads divisible by cp.
  r = RunSwitchyard("bench cp --cp 3 --seq 96 --heads 4 --algos ulysses --iters 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--heads 4"), std::string::npos) << r.err;
  r = RunSwitchyard("bench cp --algos flash");
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

}  // namespace
}  // namespace switchyard
