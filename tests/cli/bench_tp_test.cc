// `switchyard bench tp` end to end (a smoke test: a tiny block, few iterations): every --json line
// carries its fields; the bytes each rank put on the wire equal the closed form of
// docs/tensor_parallel.md exactly; the activation bytes read from the layers' caches are those of
// the shapes (the norm region 1/P with sequence parallelism); bad flags exit with code 2 saying
// what is wrong. Speed is not asserted.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cli/run_switchyard.h"

namespace switchyard {
namespace {

using testing::CliResult;
using testing::JsonLinesOf;
using testing::RunSwitchyard;

constexpr int64_t kTokens = 64, kModelDim = 32, kHiddenDim = 64;

// docs/tensor_parallel.md, "Bytes per call", per rank per step of the block: fc1 and fc2 forward
// and backward move 16 (P-1) (N/P) d bytes in every mode; sequence parallelism adds the
// all-reduce 8 (P-1)/P of the 3d gradients of the norm's weight and bias and fc2's bias.
int64_t ClosedForm(const std::string& mode, int64_t p, int64_t n, int64_t d) {
  const int64_t activations = 16 * (p - 1) * (n / p) * d;
  return mode == "tp" ? activations : activations + 8 * (p - 1) * 3 * d / p;
}

// The --json lines of `switchyard bench tp <args>`; a failure (and no lines) unless it exits 0
// with `expected` lines.
std::vector<nlohmann::json> BenchTpJson(const std::string& args, size_t expected) {
  CliResult r = RunSwitchyard("bench tp " + args + " --json");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> lines = JsonLinesOf(r.out);
  EXPECT_EQ(lines.size(), expected) << r.out;
  if (r.exit_code != 0 || lines.size() != expected) return {};
  return lines;
}

TEST(CliBenchTp, JsonLinesCarryEveryFieldAndBytesEqualTheClosedForm) {
  const std::vector<nlohmann::json> lines = BenchTpJson(
      "--tp 2,4 --tokens 64 --model-dim 32 --hidden-dim 64 --iters 2 --warmup 1 "
      "--intra-latency-us 10 --intra-gbps 0.5",
      6);  // 2 tp sizes x 3 modes
  ASSERT_FALSE(lines.empty());
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::set<std::pair<int, std::string>> seen;
  for (const nlohmann::json& j : lines) {
    SCOPED_TRACE(j.dump());
    const int p = j.at("tp");
    const std::string mode = j.at("mode");
    seen.insert({p, mode});
    EXPECT_EQ(j.at("op"), "tp");
    EXPECT_EQ(j.at("tokens"), kTokens);
    EXPECT_EQ(j.at("model_dim"), kModelDim);
    EXPECT_EQ(j.at("hidden_dim"), kHiddenDim);
    EXPECT_EQ(j.at("iters"), 2);
    EXPECT_EQ(j.at("gemm_threads_per_rank"), 1);
    EXPECT_EQ(j.at("oversubscribed"), p > j.at("cores").get<int>());
    EXPECT_LE(j.at("cores").get<int>(), cores);
    EXPECT_EQ(j.at("emulation").at("latency_us"), 10.0);
    EXPECT_EQ(j.at("emulation").at("gbps"), 0.5);

    // Bytes: measured on every rank, equal to the closed form to the byte.
    const int64_t expected = ClosedForm(mode, p, kTokens, kModelDim);
    EXPECT_EQ(j.at("bytes_per_rank_step").get<int64_t>(), expected);
    EXPECT_EQ(j.at("bytes_per_rank_step_min").get<int64_t>(), expected);
    EXPECT_EQ(j.at("closed_form_bytes").get<double>(), static_cast<double>(expected));
    EXPECT_EQ(j.at("bytes_agree"), true);

    // Activation memory from the caches: the LayerNorm keeps its input [rows, d], mean and rstd
    // [rows]: all N tokens without sequence parallelism, N/P with it; the tensor-parallel region
    // keeps fc1's input [N, d] (gathered under sp), the activation's input and fc2's input
    // [N, h/P] in every mode.
    const int64_t rows = mode == "tp" ? kTokens : kTokens / p;
    EXPECT_EQ(j.at("norm_region_activation_bytes").get<int64_t>(),
              (rows * kModelDim + 2 * rows) * 4);
    EXPECT_EQ(j.at("tp_region_activation_bytes").get<int64_t>(),
              (kTokens * kModelDim + 2 * kTokens * (kHiddenDim / p)) * 4);
    EXPECT_EQ(j.at("norm_region_saving").get<double>(), mode == "tp" ? 1.0 : p);

    // Times are measured (not asserted beyond being there and consistent).
    for (const char* key : {"step_median_ms", "step_min_ms", "comm_alone_ms", "compute_alone_ms",
                            "blocked_ms", "collectives_ran_ms"}) {
      EXPECT_GE(j.at(key).get<double>(), 0) << key;
    }
    EXPECT_GT(j.at("comm_alone_ms").get<double>(), 0);
    EXPECT_GT(j.at("compute_alone_ms").get<double>(), 0);
    EXPECT_LE(j.at("step_min_ms").get<double>(), j.at("step_median_ms").get<double>());
    EXPECT_GT(j.at("comm_over_compute").get<double>(), 0);  // median of the iterations' ratios
    if (!j.at("hidden_fraction").is_null()) {
      EXPECT_GE(j.at("hidden_fraction").get<double>(), 0);
      EXPECT_LE(j.at("hidden_fraction").get<double>(), 1);
    }
    // The bound exists for the rings only.
    if (mode == "overlap") {
      EXPECT_GT(j.at("overlappable_compute_ms").get<double>(), 0);
      EXPECT_GE(j.at("hidden_fraction_bound").get<double>(), 0);
      EXPECT_LE(j.at("hidden_fraction_bound").get<double>(), 1);
    } else {
      EXPECT_TRUE(j.at("overlappable_compute_ms").is_null());
      EXPECT_TRUE(j.at("hidden_fraction_bound").is_null());
    }
  }
  EXPECT_EQ(seen, (std::set<std::pair<int, std::string>>{
                      {2, "tp"}, {2, "sp"}, {2, "overlap"}, {4, "tp"}, {4, "sp"}, {4, "overlap"}}));
}

// Three ranks and a model dimension that P does not divide (nothing requires it to): the counts
// still agree with the closed form (within the rounding of the library's (P-1)/P in double).
TEST(CliBenchTp, ThreeRanksAndAnOddModelDim) {
  const std::vector<nlohmann::json> lines = BenchTpJson(
      "--tp 3 --modes sp,tp --tokens 66 --model-dim 10 --hidden-dim 66 --iters 1 --warmup 0", 2);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0].at("mode"), "sp");  // in the order given
  EXPECT_EQ(lines[1].at("mode"), "tp");
  for (const nlohmann::json& j : lines) {
    SCOPED_TRACE(j.dump());
    EXPECT_EQ(j.at("bytes_agree"), true);
    EXPECT_EQ(j.at("bytes_per_rank_step").get<int64_t>(), ClosedForm(j.at("mode"), 3, 66, 10));
  }
  EXPECT_EQ(lines[0].at("norm_region_saving").get<double>(), 3.0);
}

TEST(CliBenchTp, TextReportHasItsColumnsAndTheMemoryLine) {
  CliResult r = RunSwitchyard(
      "bench tp --tp 2 --tokens 64 --model-dim 32 --hidden-dim 64 --iters 1 --warmup 0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* text :
       {"EMULATED links: 50 us + 0.1 GB/s per message", "1 GEMM thread per rank", "step ms",
        "comm ms", "compute ms", "comm/cmp", "hidden", "bound", "MB/step", "closed form",
        "norm KiB", "tp 2", "overlap", "1/2.00 (tp 2)", "16 (P-1) (N/P) d"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " missing:\n" << r.out;
  }
  EXPECT_EQ(r.out.find(" NO "), std::string::npos) << r.out;  // every row's bytes agree
}

TEST(CliBenchTp, BadFlagsExitWithCodeTwoSayingWhy) {
  const std::map<std::string, std::string> cases = {
      {"--tp 0", "--tp: '0' is out of range; expected an integer in [1, 256]"},
      {"--tp 2,0", "--tp: '0' is out of range; expected an integer in [1, 256]"},
      {"--tokens -8", "--tokens: '-8' is out of range; expected an integer in [1, 1099511627776]"},
      {"--model-dim 0",
       "--model-dim: '0' is out of range; expected an integer in [1, 1099511627776]"},
      {"--hidden-dim -64",
       "--hidden-dim: '-64' is out of range; expected an integer in [1, 1099511627776]"},
      {"--tp 4 --hidden-dim 66", "--hidden-dim 66 does not divide by --tp 4"},
      {"--tp 3 --tokens 64", "--tokens 64 does not divide by --tp 3"},
      {"--modes tp,ring", "--modes: ring not in"},
      {"--intra-gbps -1", "--intra-gbps: '-1' is not a finite number"},
      {"--iters 0", "--iters: '0' is out of range; expected an integer in [1, 10000]"},
  };
  for (const auto& [flags, message] : cases) {
    CliResult r = RunSwitchyard("bench tp " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << ": " << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << flags << ": " << r.err;
  }
}

}  // namespace
}  // namespace switchyard
