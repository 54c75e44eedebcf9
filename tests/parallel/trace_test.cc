// The trace of the parallel layer: a Chrome trace-event file with one track per rank and stream
// whose events name each chunk's send / experts / return, carry byte counts, and show the
// communication of one chunk running while another chunk computes (D > 1, emulated link so that
// transfers take a while); every collective's event carries the bytes its closed form gives.
#include "switchyard/parallel/trace.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/parallel_cases.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/parallel/driver.h"

namespace switchyard::parallel {
namespace {

struct Span {
  double begin, end;
};

bool Overlap(const Span& a, const Span& b) { return a.begin < b.end && b.begin < a.end; }

TEST(Trace, ChromeTraceEventsWithOverlappingChunks) {
  moe::LayerConfig config = testing::SmallConfig(4, true);
  config.model_dim = 128;
  config.hidden_dim = 1024;
  const testing::Inputs in = testing::MakeInputs(config, 512, 31);
  DriverOptions o;
  o.parallel.mesh.world_size = 2;
  o.parallel.dispatch = DispatchKind::kAllToAllV;
  o.parallel.overlap_degree = 2;
  o.threads = 1;
  // 20 MB/s: a chunk of ~256 rows x 512 bytes takes ~6 ms on the wire; its experts about as
  // long (long enough for the progress thread to be scheduled on a loaded machine).
  comm::InProcessOptions inprocess;
  inprocess.ranks_per_node = 1;
  inprocess.emulation = comm::EmulationOptions{{1, 0.02}, {1, 0.02}};
  inprocess.timeout = comm::Milliseconds(20000);
  Tracer tracer;
  o.tracer = &tracer;
  RunLayerOnRanks(config, in.params, in.x, in.dy, o, inprocess);

  const nlohmann::json j = nlohmann::json::parse(tracer.ToJson());
  ASSERT_TRUE(j.contains("traceEvents"));
  std::map<int, std::string> track_names;
  // (tid, category, name) -> span
  std::map<std::tuple<int, std::string, std::string>, Span> spans;
  std::set<std::string> names;
  for (const auto& e : j["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("name") && e.contains("pid") && e.contains("tid"));
    if (e["ph"] == "M") {
      if (e["name"] == "thread_name") track_names[e["tid"].get<int>()] = e["args"]["name"];
      continue;
    }
    ASSERT_EQ(e["ph"], "X");
    ASSERT_GE(e["ts"].get<double>(), 0.0);
    ASSERT_GE(e["dur"].get<double>(), 0.0);
    const int tid = e["tid"].get<int>();
    const int rank = e["args"]["rank"].get<int>();
    const std::string stream = e["args"]["stream"];
    EXPECT_EQ(tid, 2 * rank + (stream == "comm" ? 1 : 0));
    const std::string name = e["name"];
    names.insert(name);
    if (name.starts_with("send c") || name.starts_with("return c")) {
      EXPECT_EQ(stream, "comm") << name;
      EXPECT_TRUE(e["args"].contains("bytes")) << name;
    }
    if (name.starts_with("experts c")) {
      EXPECT_EQ(stream, "compute");
    }
    const double ts = e["ts"].get<double>();
    spans[{tid, e["cat"].get<std::string>(), name}] = Span{ts, ts + e["dur"].get<double>()};
  }
  EXPECT_EQ(track_names[0], "rank 0 compute");
  EXPECT_EQ(track_names[1], "rank 0 comm");
  EXPECT_EQ(track_names[2], "rank 1 compute");
  EXPECT_EQ(track_names[3], "rank 1 comm");
  for (const char* n :
       {"gate", "encode", "decode", "send c0", "send c1", "experts c0", "experts c1", "return c0",
        "return c1", "decode backward", "encode backward", "gate backward", "alltoall routing"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  // Forward and backward on both ranks: chunk 1 travels to the experts while chunk 0 computes,
  // or chunk 0 travels back while chunk 1 computes. Scheduling on a loaded 2-core machine can
  // delay a progress thread now and then, so at least one of the four (rank, pass) pipelines must
  // show it (in practice all do).
  int overlapping = 0;
  std::string detail;
  for (int rank : {0, 1}) {
    for (const char* cat : {"forward", "backward"}) {
      const int compute = 2 * rank, comm = 2 * rank + 1;
      ASSERT_TRUE(spans.count({compute, cat, "experts c0"})) << rank << cat;
      const Span c0 = spans.at({compute, cat, "experts c0"});
      const Span c1 = spans.at({compute, cat, "experts c1"});
      const Span s1 = spans.at({comm, cat, "send c1"});
      const Span r0 = spans.at({comm, cat, "return c0"});
      if (Overlap(s1, c0) || Overlap(r0, c1)) ++overlapping;
      detail += fmt::format(
          "\n  rank {} {}: send c1 [{:.0f}, {:.0f}] experts c0 [{:.0f}, {:.0f}] return c0 [{:.0f}, "
          "{:.0f}] experts c1 [{:.0f}, {:.0f}]",
          rank, cat, s1.begin, s1.end, c0.begin, c0.end, r0.begin, r0.end, c1.begin, c1.end);
    }
  }
  EXPECT_GE(overlapping, 1) << detail;
}

// Every collective of a small known step on the comm tracks, with the bytes (and traffic class)
// its closed form gives: W = 4, ep 2 (two expert groups of P = 2 ranks, replicas of each other),
// E = 4 (E_l = 2 per rank), fixed capacity C = 3, per-rank scope, M = 16, H = 32, float32.
TEST(Trace, CollectiveEventsCarryTheirBytes) {
  const int64_t e = 4, e_local = 2, c = 3, m = 16, h = 32;
  const double p = 2;        // expert group: the token all-to-alls and the routing collectives
  const double tokens = 4;   // token group (the world): the gate gradient's all-reduce
  const double holders = 2;  // ranks holding the same experts: the expert gradients' all-reduce
  moe::LayerConfig config = testing::SmallConfig(e, false);
  config.capacity = c;
  ASSERT_EQ(config.model_dim, m);
  ASSERT_EQ(config.hidden_dim, h);
  const testing::Inputs in = testing::MakeInputs(config, 24, 41);
  DriverOptions o;
  o.parallel.mesh.world_size = 4;
  o.parallel.mesh.ep = 2;
  o.parallel.batch_scope = BatchScope::kPerRank;
  o.threads = 1;
  Tracer tracer;
  o.tracer = &tracer;
  const LayerRunResult run = RunLayerOnRanks(config, in.params, in.x, in.dy, o);
  ASSERT_EQ(run.buffer_capacity, c);

  // (category, name, bytes, traffic), as nccl-tests count bytes on the wire (docs/parallel.md).
  using Collective = std::tuple<std::string, std::string, double, int>;
  const int kTokens = static_cast<int>(Traffic::kTokens);
  const int kRouting = static_cast<int>(Traffic::kRouting);
  const int kWeights = static_cast<int>(Traffic::kWeights);
  const double all_to_all = (p - 1) / p, f32 = 4, i64 = 8;
  auto all_reduce = [](double ranks, double bytes) { return 2 * (ranks - 1) / ranks * bytes; };
  const double token_bytes = all_to_all * static_cast<double>(e * c * m) * f32;
  std::vector<Collective> expected = {
      {"forward", "allreduce max routing", all_reduce(p, i64), kRouting},  // wire capacity
      {"forward", "alltoall routing", all_to_all * static_cast<double>(e) * i64, kRouting},
      {"forward", "send c0", token_bytes, kTokens},
      {"forward", "return c0", token_bytes, kTokens},
      {"backward", "send c0", token_bytes, kTokens},
      {"backward", "return c0", token_bytes, kTokens},
      {"sync", "allreduce weights", all_reduce(tokens, static_cast<double>(e * m) * f32), kWeights},
  };
  for (int64_t numel : {e_local * h * m, e_local * h, e_local * m * h, e_local * m}) {
    expected.emplace_back("sync", "allreduce weights",
                          all_reduce(holders, static_cast<double>(numel) * f32), kWeights);
  }
  std::sort(expected.begin(), expected.end());

  const nlohmann::json j = nlohmann::json::parse(tracer.ToJson());
  std::map<int, std::vector<Collective>> seen;  // by rank
  for (const auto& ev : j["traceEvents"]) {
    if (ev["ph"] != "X" || ev["args"]["stream"] != "comm") continue;
    const std::string name = ev["name"];
    ASSERT_TRUE(ev["args"].contains("bytes")) << name;
    ASSERT_TRUE(ev["args"].contains("traffic")) << name;
    seen[ev["args"]["rank"].get<int>()].emplace_back(
        ev["cat"].get<std::string>(), name, ev["args"]["bytes"].get<double>(),
        static_cast<int>(ev["args"]["traffic"].get<double>()));
  }
  ASSERT_EQ(seen.size(), 4u);
  for (auto& [rank, collectives] : seen) {
    std::sort(collectives.begin(), collectives.end());
    EXPECT_EQ(collectives, expected) << "rank " << rank;
  }
}

TEST(Trace, SerializeMergeRoundTrip) {
  Tracer a;
  a.Add(TraceEvent{"send c0", "forward", 3, TraceStream::kComm, 10.5, 10.75, {{"bytes", 4096}}});
  a.Add(TraceEvent{"gate", "forward", 3, TraceStream::kCompute, 10.0, 10.25, {}});
  Tracer b;
  b.Merge(a.Serialize());
  ASSERT_EQ(b.size(), 2u);
  std::vector<TraceEvent> ev = b.Events();
  EXPECT_EQ(ev[0].name, "send c0");
  EXPECT_EQ(ev[0].rank, 3);
  EXPECT_EQ(ev[0].stream, TraceStream::kComm);
  EXPECT_DOUBLE_EQ(ev[0].begin_s, 10.5);
  ASSERT_EQ(ev[0].args.size(), 1u);
  EXPECT_EQ(ev[0].args[0].second, 4096);
  EXPECT_THROW(b.Merge("garbage\n"), InvalidArgument);
  // ts relative to the earliest event, in microseconds.
  const nlohmann::json j = nlohmann::json::parse(a.ToJson());
  double send_ts = -1;
  for (const auto& e : j["traceEvents"]) {
    if (e["name"] == "send c0") send_ts = e["ts"].get<double>();
  }
  EXPECT_NEAR(send_ts, 0.5e6, 1e-3);
}

}  // namespace
}  // namespace switchyard::parallel
