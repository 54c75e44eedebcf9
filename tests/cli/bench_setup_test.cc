// The setup the bench commands share (src/cli/bench_setup.h, layout_flags.h) on its own: the
// flags turn into the library's options, the interleaved loop runs what it is given in order and
// times every run, the table's header and rows line up, and ranks over an emulated link that a
// message cannot cross before the deadline are refused naming the flag.
#include "cli/bench_setup.h"

#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "cli/layout_flags.h"
#include "cli/parse_flags.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/ops.h"

namespace switchyard::cli {
namespace {

TEST(MoeLayerFlags, BecomeTheLayerConfigWithinTheCommandsBounds) {
  MoeLayerFlags f;
  const MoeLayerFlagSpec spec{.max_size = 1 << 10, .max_experts = 16, .tokens_help = "T"};
  auto setup = [&](CLI::App& app) { AddMoeLayerFlags(app, &f, spec); };
  ASSERT_EQ(Parse(setup, {"--tokens", "64", "--model-dim", "32", "--hidden-dim", "48", "--experts",
                          "8", "--top-k", "3", "--capacity-factor", "0.5", "--activation", "silu",
                          "--gated", "--dropless"}),
            "");
  const moe::LayerConfig c = f.Config();
  EXPECT_EQ(f.tokens, 64);
  EXPECT_EQ(c.model_dim, 32);
  EXPECT_EQ(c.hidden_dim, 48);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k, 3);
  EXPECT_FLOAT_EQ(c.capacity_factor, 0.5f);
  EXPECT_TRUE(c.dropless);
  EXPECT_TRUE(c.gated);
  EXPECT_EQ(c.activation, kernels::ActivationFromName("silu"));
  // The command's bounds, not another command's.
  EXPECT_NE(Parse(setup, {"--experts", "17"}).find("--experts: '17' is out of range"),
            std::string::npos);
  EXPECT_NE(Parse(setup, {"--tokens", "1025"}).find("--tokens: '1025' is out of range"),
            std::string::npos);
  EXPECT_NE(Parse(setup, {"--capacity-factor", "nan"}), "");
}

TEST(MoeLayerFlags, PresetsSetTheLayerAndGivenFlagsOverrideThem) {
  MoeLayerFlags f;
  std::string preset;
  std::string error;
  auto setup = [&](CLI::App& app) {
    AddMoeLayerFlags(app, &f, {});
    app.add_option("--preset", preset);
    app.final_callback([&] {
      try {
        ApplyMoeLayerPreset(app, preset, &f);
      } catch (const InvalidArgument& e) {
        error = e.what();
      }
    });
  };
  // F: the fine-grained SwiGLU layer (64 experts top-8, docs/PERFORMANCE.md).
  ASSERT_EQ(Parse(setup, {"--preset", "F"}), "");
  EXPECT_EQ(error, "");
  EXPECT_EQ(f.tokens, 4096);
  EXPECT_EQ(f.model_dim, 512);
  EXPECT_EQ(f.hidden_dim, 256);
  EXPECT_EQ(f.experts, 64);
  EXPECT_EQ(f.top_k, 8);
  EXPECT_TRUE(f.dropless);
  EXPECT_TRUE(f.gated);
  EXPECT_EQ(f.activation, "silu");
  // A flag given with the preset wins; the rest is the preset's.
  f = MoeLayerFlags{};
  ASSERT_EQ(Parse(setup, {"--preset", "C", "--tokens", "100", "--activation", "relu"}), "");
  EXPECT_EQ(f.tokens, 100);
  EXPECT_EQ(f.activation, "relu");
  EXPECT_EQ(f.model_dim, 256);
  EXPECT_EQ(f.hidden_dim, 1024);
  EXPECT_EQ(f.experts, 64);
  EXPECT_EQ(f.top_k, 1);
  EXPECT_FALSE(f.dropless);
  EXPECT_FALSE(f.gated);
  // An unknown name is refused, naming the presets.
  ASSERT_EQ(Parse(setup, {"--preset", "Z"}), "");
  EXPECT_NE(error.find("--preset: unknown layer 'Z', expected one of A, B, C, F"),
            std::string::npos)
      << error;
  EXPECT_NE(MoeLayerPresetNames().find('F'), std::string::npos);
}

TEST(BenchLoopFlags, SpellTheIterationsAsTheCommandDoes) {
  BenchLoopFlags f{.iters = 5, .warmup = 1};
  // The options belong to the App that Parse owns: their counts are read while it lives.
  size_t iters_count = 99, warmup_count = 99;
  auto setup = [&](CLI::App& app) {
    const BenchLoopOptions given =
        AddBenchLoopFlags(app, &f, {.iters_name = "--repeat", .max_iters = 100});
    app.final_callback([&iters_count, &warmup_count, given] {
      iters_count = given.iters->count();
      warmup_count = given.warmup->count();
    });
  };
  ASSERT_EQ(Parse(setup, {"--repeat", "7", "--json"}), "");
  EXPECT_EQ(f.iters, 7);
  EXPECT_EQ(f.warmup, 1);
  EXPECT_TRUE(f.json);
  EXPECT_EQ(iters_count, 1u);
  EXPECT_EQ(warmup_count, 0u);
  EXPECT_NE(Parse(setup, {"--iters", "7"}), "");  // not this command's spelling
  EXPECT_NE(Parse(setup, {"--repeat", "101"}).find("out of range"), std::string::npos);
}

TEST(MoeLayoutFlags, BecomeTheParallelOptions) {
  MoeLayoutFlags f;
  auto setup = [&](CLI::App& app) { AddMoeLayoutFlags(app, &f, "trace"); };
  ASSERT_EQ(
      Parse(setup, {"--tp", "2", "--ep", "4", "--arrangement", "megatron", "--dispatch",
                    "alltoallv", "--scope", "per_rank", "--overlap-degree", "2", "--no-tp-dedup"}),
      "");
  const parallel::ParallelOptions p = f.Options(8);
  EXPECT_EQ(p.mesh.world_size, 8);
  EXPECT_EQ(p.mesh.tp, 2);
  EXPECT_EQ(p.mesh.ep, 4);
  EXPECT_EQ(p.mesh.arrangement, parallel::Arrangement::kMegatron);
  EXPECT_EQ(p.dispatch, parallel::DispatchKind::kAllToAllV);
  EXPECT_EQ(p.batch_scope, parallel::BatchScope::kPerRank);
  EXPECT_EQ(p.overlap_degree, 2);
  EXPECT_FALSE(p.tp_dedup);
  // The defaults are the library's defaults.
  const parallel::ParallelOptions d = MoeLayoutFlags{}.Options(4);
  const parallel::ParallelOptions lib;
  EXPECT_EQ(d.dispatch, lib.dispatch);
  EXPECT_EQ(d.adaptive_r, lib.adaptive_r);
  EXPECT_EQ(d.tp_dedup, lib.tp_dedup);
  EXPECT_EQ(d.batch_scope, lib.batch_scope);
  EXPECT_EQ(d.smart_group, lib.smart_group);
  EXPECT_EQ(d.shadow.policy, lib.shadow.policy);
  EXPECT_NE(Parse(setup, {"--dispatch", "ring"}), "");
  f.smart = "banana";
  EXPECT_THROW(f.Options(2), InvalidArgument);
}

TEST(TimeInterleaved, RunsEveryMeasurementOncePerRoundInOrder) {
  std::string order;
  const InterleavedTimes t = TimeInterleaved(
      {[&] { order += 'a'; }, [&] { order += 'b'; },
       [&] {  // 20 ms of this thread's CPU time
         timespec t0{}, now{};
         clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
         do {
           clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
         } while ((now.tv_sec - t0.tv_sec) + 1e-9 * (now.tv_nsec - t0.tv_nsec) < 0.02);
       }},
      /*warmup=*/2, /*iters=*/3, /*cpu_too=*/true);
  EXPECT_EQ(order, "ababababab");  // 2 warm-up and 3 timed rounds
  ASSERT_EQ(t.wall.size(), 3u);
  ASSERT_EQ(t.cpu.size(), 3u);
  for (size_t m = 0; m < 3; ++m) {
    EXPECT_EQ(t.wall[m].size(), 3u);
    EXPECT_EQ(t.cpu[m].size(), 3u);
  }
  // The work is in both clocks: the process's CPU time holds at least this thread's 20 ms (other
  // threads of the test process may add theirs, so no upper bound is asserted).
  for (double s : t.wall[2]) EXPECT_GE(s, 0.020);
  for (double s : t.cpu[2]) EXPECT_GE(s, 0.020);
  EXPECT_TRUE(TimeInterleaved({[] {}}, 0, 2).cpu.empty());
}

TEST(Median, OfAllAndOfATail) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 2, 3}), 2.5);
  EXPECT_EQ(MedianFrom({100, 1, 3}, 1), 2);
  EXPECT_EQ(Median({}), 0);
}

TEST(TextTable, HeaderAndRowsShareTheColumns) {
  const TextTable table("  ", {{"mode", 6, true}, {"ms", 7}, {"agree", 5}});
  testing::internal::CaptureStdout();
  table.PrintHeader();
  table.PrintRow({"tp", "12.5", "yes"});
  table.PrintRow({"overlap", "1234567.5", "-"});  // wider than its column: not cut
  EXPECT_EQ(testing::internal::GetCapturedStdout(),
            "  mode        ms agree\n"
            "  tp        12.5   yes\n"
            "  overlap 1234567.5     -\n");
}

TEST(UniformLink, RanksRunOverTheLinkAndTheSlowestRankIsTimed) {
  const UniformLinkFlags link{.latency_us = 10, .gbps = 1, .timeout_ms = 10000};
  EXPECT_EQ(link.Json(), (nlohmann::json{{"latency_us", 10.0}, {"gbps", 1.0}}));
  auto launcher = MakeUniformLinkLauncher(2, link, 1 << 20, "bench test");
  std::vector<double> seen(2);
  launcher->Run([&](comm::Communicator& world) {
    seen[static_cast<size_t>(world.rank())] = TimedOnAllRanks(world, [&] {
      if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    });
  });
  EXPECT_GE(seen[0], 0.02);  // rank 0 reports rank 1's time
  EXPECT_EQ(seen[0], seen[1]);
}

TEST(UniformLink, ALinkSlowerThanTheDeadlineIsRefusedNamingTheFlag) {
  const UniformLinkFlags slow_latency{.latency_us = 2e6, .gbps = 0, .timeout_ms = 1000};
  try {
    (void)MakeUniformLinkLauncher(2, slow_latency, 0, "bench test");
    FAIL() << "accepted a latency beyond the deadline";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--intra-latency-us"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--timeout-ms 1000 ms"), std::string::npos) << e.what();
  }
  const UniformLinkFlags slow_bandwidth{.latency_us = 0, .gbps = 1e-3, .timeout_ms = 1000};
  try {
    (void)MakeUniformLinkLauncher(2, slow_bandwidth, 1 << 30, "bench test");
    FAIL() << "accepted a message that cannot cross the link before the deadline";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--intra-gbps"), std::string::npos) << e.what();
  }
}

TEST(OversubscribedNote, OnlyWhenRanksOutnumberCores) {
  EXPECT_EQ(OversubscribedNote(2, 2, "x"), "");
  EXPECT_EQ(OversubscribedNote(4, 2, "they time-share the cores"),
            " (4 ranks on 2 cores: they time-share the cores)");
}

}  // namespace
}  // namespace switchyard::cli
