// The trace of the parallel layer: a Chrome trace-event file with one track per rank and stream
// whose events name each chunk's send / experts / return, carry byte counts, and show the
// communication of one chunk running while another chunk computes (D > 1, emulated link so that
// transfers take a while).
#include "switchyard/parallel/trace.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "parallel/parallel_cases.h"
#include "switchyard/core/error.h"
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
  o.inprocess.ranks_per_node = 1;
  o.inprocess.emulation = comm::EmulationOptions{{1, 0.02}, {1, 0.02}};
  o.inprocess.timeout = comm::Milliseconds(20000);
  Tracer tracer;
  o.tracer = &tracer;
  RunLayerOnRanks(config, in.params, in.x, in.dy, o);

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
