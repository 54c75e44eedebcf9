// `switchyard bench comm`: collective bandwidth as nccl-tests reports it (time, algbw, busbw per
// size, SPEC §3 factors), on the in-process transport (with this machine's memcpy bandwidth
// measured in the same run as the limit) or under MPI (with MPI's own collective measured in the
// same run, interleaved, with --compare mpi).
//
//   switchyard bench comm --op alltoall --ranks 4 --sizes 64K:64M
//   scripts/mpirun.sh -np 4 build/release/src/cli/switchyard bench comm --transport mpi
//       --op allreduce --sizes 256K:32M --compare mpi
//
// Each iteration: barrier, time the collective on every rank, take the maximum over ranks; the
// reported time is the median over iterations (these machines are noisy).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "cli/timing.h"
#include "switchyard/comm/agree.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/core/dtype.h"
#include "switchyard/core/error.h"

namespace switchyard::cli {
namespace {

using comm::Algorithm;
using comm::CollectiveKind;
using comm::Communicator;

struct BenchCommOptions {
  std::string op = "alltoall";
  int ranks = 2;
  std::string transport;  // "" = mpi when launched by mpirun, else inproc
  std::string algos = "auto";
  std::string sizes = "64K:16M";
  std::string dtype = "float32";
  std::string reduce_op = "sum";
  std::string compare;
  int iters = 20;
  int warmup = 3;
  bool json = false;
  int ranks_per_node = 0;
  double intra_latency_us = 0, intra_gbps = 0, inter_latency_us = 0, inter_gbps = 0;
  bool emulate = false;
  int64_t timeout_ms = 120000;
};

// "64K" -> 65536; suffixes K, M, G (powers of 1024).
size_t ParseSize(const std::string& text) {
  size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    throw InvalidArgument(fmt::format("--sizes: cannot read '{}' as a size (e.g. 4K, 16M)", text));
  }
  std::string suffix = text.substr(end);
  double scale = 1;
  if (suffix == "K" || suffix == "k") scale = 1024.0;
  if (suffix == "M" || suffix == "m") scale = 1024.0 * 1024;
  if (suffix == "G" || suffix == "g") scale = 1024.0 * 1024 * 1024;
  SY_REQUIRE(suffix.empty() || scale > 1, InvalidArgument,
             "--sizes: unknown suffix '{}' in '{}' (K, M or G)", suffix, text);
  return static_cast<size_t>(value * scale);
}

std::vector<std::string> SplitList(const std::string& text, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    size_t at = text.find(sep, start);
    if (at == std::string::npos) at = text.size();
    if (at > start) parts.push_back(text.substr(start, at - start));
    start = at + 1;
  }
  return parts;
}

// "1K,64K,1M" (a list) or "1K:64M" (x4 steps) or "1K:64M:2" (x2 steps).
std::vector<size_t> ParseSizes(const std::string& text) {
  std::vector<size_t> sizes;
  if (text.find(':') != std::string::npos) {
    std::vector<std::string> p = SplitList(text, ':');
    SY_REQUIRE(p.size() == 2 || p.size() == 3, InvalidArgument,
               "--sizes: a range is FROM:TO or FROM:TO:FACTOR, got '{}'", text);
    size_t from = ParseSize(p[0]), to = ParseSize(p[1]);
    size_t factor = p.size() == 3 ? ParseSize(p[2]) : 4;
    SY_REQUIRE(from >= 1 && factor >= 2 && from <= to, InvalidArgument,
               "--sizes: range '{}' needs 1 <= FROM <= TO and FACTOR >= 2", text);
    for (size_t s = from; s <= to; s *= factor) sizes.push_back(s);
  } else {
    for (const std::string& s : SplitList(text, ',')) sizes.push_back(ParseSize(s));
  }
  SY_REQUIRE(!sizes.empty(), InvalidArgument, "--sizes: no sizes in '{}'", text);
  return sizes;
}

// nccl-tests' bus bandwidth factor (SPEC §3).
double BusFactor(CollectiveKind kind, int w) {
  double n = w;
  switch (kind) {
    case CollectiveKind::kAllReduce: return 2 * (n - 1) / n;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kAllToAllV:
    case CollectiveKind::kScatter:
    case CollectiveKind::kGather: return (n - 1) / n;
    default: return 1;
  }
}

// One collective at one size on one rank: buffers, the call, and a check of the result.
// `bytes` is nccl-tests' size: the per-rank buffer of the collective (for alltoall, allgather,
// reduce_scatter, scatter, gather the whole W-block buffer; else the message).
class Job {
 public:
  Job(Communicator& comm, CollectiveKind kind, size_t bytes, DType dtype, comm::ReduceOp op)
      : comm_(comm), kind_(kind), dtype_(dtype), op_(op) {
    const size_t w = static_cast<size_t>(comm.size()), es = DTypeSize(dtype);
    bool blocks = kind == CollectiveKind::kAllToAll || kind == CollectiveKind::kAllToAllV ||
                  kind == CollectiveKind::kAllGather || kind == CollectiveKind::kReduceScatter ||
                  kind == CollectiveKind::kScatter || kind == CollectiveKind::kGather;
    count_ = blocks ? bytes / es / w : bytes / es;  // elements per block or per message
    size_t total = blocks ? count_ * w : count_;
    in_ = Tensor::Full({static_cast<int64_t>(total)}, comm.rank() + 1.0, dtype);
    out_ = Tensor::Zeros({static_cast<int64_t>(total)}, dtype);
    counts_.assign(w, static_cast<int64_t>(count_));
  }

  // nccl-tests' size of what is actually moved (rounded down to whole elements and blocks).
  size_t actual_bytes() const { return in_.nbytes(); }

  comm::Work Start(Algorithm algorithm) {
    void* in = in_.raw();
    void* out = out_.raw();
    switch (kind_) {
      case CollectiveKind::kAllReduce:
        return comm_.AllReduce(in, out, count_, dtype_, {.reduce_op = op_, .algorithm = algorithm});
      case CollectiveKind::kBroadcast:
        return comm_.Broadcast(in, count_, dtype_, {.root = 0, .algorithm = algorithm});
      case CollectiveKind::kReduce:
        return comm_.Reduce(in, out, count_, dtype_,
                            {.root = 0, .reduce_op = op_, .algorithm = algorithm});
      case CollectiveKind::kAllGather:
        return comm_.AllGather(in, out, count_, dtype_, {.algorithm = algorithm});
      case CollectiveKind::kReduceScatter:
        return comm_.ReduceScatter(in, out, count_, dtype_,
                                   {.reduce_op = op_, .algorithm = algorithm});
      case CollectiveKind::kAllToAll:
        return comm_.AllToAll(in, out, count_, dtype_, {.algorithm = algorithm});
      case CollectiveKind::kAllToAllV:
        return comm_.AllToAllV(in, counts_, {}, out, counts_, {}, dtype_, {.algorithm = algorithm});
      case CollectiveKind::kScatter:
        return comm_.Scatter(in, out, count_, dtype_, {.root = 0, .algorithm = algorithm});
      case CollectiveKind::kGather:
        return comm_.Gather(in, out, count_, dtype_, {.root = 0, .algorithm = algorithm});
      default:
        throw InvalidArgument(
            fmt::format("bench comm: --op {} is not benchmarked", comm::CollectiveName(kind_)));
    }
  }

  // Checks the first and the last element of every block of the last result; "" if right.
  // Inputs are rank + 1 everywhere.
  std::string Check() const {
    const int w = comm_.size(), r = comm_.rank();
    double reduced = op_ == comm::ReduceOp::kSum   ? w * (w + 1) / 2.0
                     : op_ == comm::ReduceOp::kMax ? w
                                                   : 1.0;
    const auto n = static_cast<int64_t>(count_);
    // Block `b` (n elements from b * n) of t holds `want`.
    auto expect = [&](const Tensor& t, int64_t b, double want) -> std::string {
      if (n == 0) return "";
      for (int64_t i : {b * n, b * n + n - 1}) {
        if (i < t.numel() && t.At(i) != want) {
          return fmt::format("element {} is {}, expected {}", i, t.At(i), want);
        }
      }
      return "";
    };
    switch (kind_) {
      case CollectiveKind::kAllReduce: return expect(out_, 0, reduced);
      case CollectiveKind::kBroadcast: return expect(in_, 0, 1.0);
      case CollectiveKind::kReduce: return r == 0 ? expect(out_, 0, reduced) : "";
      case CollectiveKind::kReduceScatter: return expect(out_, 0, reduced);
      case CollectiveKind::kScatter: return expect(out_, 0, 1.0);
      case CollectiveKind::kGather:
        if (r != 0) return "";
        [[fallthrough]];
      case CollectiveKind::kAllToAll:
      case CollectiveKind::kAllToAllV:
      case CollectiveKind::kAllGather:
        for (int p = 0; p < w; ++p) {
          std::string e = expect(out_, p, p + 1.0);
          if (!e.empty()) return e;
        }
        return "";
      default: return "";
    }
  }

 private:
  Communicator& comm_;
  CollectiveKind kind_;
  DType dtype_;
  comm::ReduceOp op_;
  size_t count_ = 0;
  Tensor in_, out_;
  std::vector<int64_t> counts_;
};

// Max over ranks of each rank's seconds (as integer nanoseconds).
double MaxOverRanks(Communicator& comm, double seconds) {
  int64_t ns = static_cast<int64_t>(seconds * 1e9);
  comm.AllReduce(&ns, &ns, 1, DType::kInt64, {.reduce_op = comm::ReduceOp::kMax}).Wait();
  return static_cast<double>(ns) * 1e-9;
}

struct Row {
  size_t bytes = 0;
  std::string algorithm;
  double time_s = 0, algbw = 0, busbw = 0;
  std::string check;
};

void RunBench(Communicator& comm, const BenchCommOptions& o, bool print) {
  const CollectiveKind kind = comm::CollectiveFromName(o.op);
  const DType dtype = DTypeFromName(o.dtype);
  const comm::ReduceOp reduce_op = comm::ReduceOpFromName(o.reduce_op);
  std::vector<Algorithm> algos;
  for (const std::string& a : SplitList(o.algos, ',')) algos.push_back(comm::AlgorithmFromName(a));
  const bool compare = o.compare == "mpi";
  if (compare) algos.push_back(Algorithm::kNative);
  const bool inprocess = comm.transport_kind() == "inprocess";
  const int w = comm.size();
  const double factor = BusFactor(kind, w);

  if (print && !o.json) {
    fmt::print(
        "# switchyard bench comm: {} on {} ranks ({}{}), {}{}, median of {} iterations "
        "(each the max over ranks)\n",
        o.op, w, comm.transport_kind(),
        comm.topology().nodes > 1
            ? fmt::format(", {} nodes x {}", comm.topology().nodes, comm.topology().ranks_per_node)
            : "",
        o.dtype, o.emulate ? ", EMULATED links" : "", o.iters);
    fmt::print(
        "# busbw = algbw x {:.3f}{}\n", factor,
        inprocess ? "; memcpy = one thread copying the same size, interleaved with the "
                    "collectives; memcpy*T = T = min(W, cores) ranks copying it at once (aggregate)"
                  : "");
    std::string header = fmt::format("{:>12} {:>11} {:>22} {:>11} {:>10} {:>10}", "size(B)",
                                     "count", "algorithm", "time(us)", "algbw", "busbw");
    if (inprocess)
      header += fmt::format(" {:>10} {:>10} {:>10}", "memcpy", "bus/memcpy", "memcpy*T");
    if (compare) header += fmt::format(" {:>10}", "vs mpi");
    fmt::print("{}\n", header);
  }

  for (size_t bytes : ParseSizes(o.sizes)) {
    Job job(comm, kind, bytes, dtype, reduce_op);
    const size_t actual = job.actual_bytes();
    std::vector<std::vector<double>> times(algos.size());
    std::vector<double> memcpy_times;
    // In-process, the limit: one thread copying `actual` bytes (between two buffers of this
    // rank) while the other ranks wait, timed in the same iterations as the collectives.
    // Page-aligned buffers, the destination 64 bytes into its page: glibc's memcpy slows down
    // badly when source and destination are a few bytes apart modulo 4 KiB (as two consecutive
    // heap blocks can be), and the limit should be the best a copy can do.
    // Also the limit for W ranks sharing the machine: the first T = min(W, cores) ranks copying
    // `actual` bytes each at the same time (aggregate bytes / slowest copy).
    const int copiers =
        std::min(w, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    std::vector<double> concurrent_times;
    std::vector<std::byte> copy_src, copy_dst;
    std::byte *src = nullptr, *dst = nullptr;
    if (inprocess && comm.rank() < copiers) {
      copy_src.assign(actual + 8192, std::byte{1});
      copy_dst.assign(actual + 8192, std::byte{0});
      auto page = [](std::byte* p) {
        return p + (4096 - reinterpret_cast<uintptr_t>(p) % 4096) % 4096;
      };
      src = page(copy_src.data());
      dst = page(copy_dst.data()) + 64;
    }
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      if (inprocess) {
        comm.Barrier().Wait();
        if (comm.rank() == 0) {
          double t0 = NowSeconds();
          std::memcpy(dst, src, actual);
          if (it >= o.warmup) memcpy_times.push_back(NowSeconds() - t0);
        }
        comm.Barrier().Wait();
        double t0 = NowSeconds();
        if (comm.rank() < copiers) std::memcpy(dst, src, actual);
        double t = MaxOverRanks(comm, NowSeconds() - t0);
        if (it >= o.warmup) concurrent_times.push_back(t);
      }
      for (size_t a = 0; a < algos.size(); ++a) {  // interleaved: same conditions for all
        comm.Barrier().Wait();
        double t0 = NowSeconds();
        job.Start(algos[a]).Wait();
        double t = MaxOverRanks(comm, NowSeconds() - t0);
        if (it >= o.warmup) times[a].push_back(t);
      }
    }
    std::vector<Row> rows;
    for (size_t a = 0; a < algos.size(); ++a) {
      Row row;
      row.bytes = actual;
      row.algorithm = std::string(comm::AlgorithmName(algos[a]));
      row.time_s = SummarizeTimes(times[a]).median_s;
      row.algbw = static_cast<double>(actual) / row.time_s / 1e9;
      row.busbw = row.algbw * factor;
      job.Start(algos[a]).Wait();
      row.check = job.Check();
      rows.push_back(row);
    }
    // Results of every rank are checked; failures are reported by rank 0 as a count.
    int32_t bad = 0;
    for (const Row& row : rows) bad += row.check.empty() ? 0 : 1;
    comm.AllReduce(&bad, &bad, 1, DType::kInt32).Wait();
    double memcpy_gbps = 0, concurrent_gbps = 0;
    if (!memcpy_times.empty()) {
      memcpy_gbps = static_cast<double>(actual) / SummarizeTimes(memcpy_times).median_s / 1e9;
      concurrent_gbps =
          static_cast<double>(actual) * copiers / SummarizeTimes(concurrent_times).median_s / 1e9;
    }
    if (!print) continue;
    const double mpi_busbw = compare ? rows.back().busbw : 0;
    for (const Row& row : rows) {
      if (o.json) {
        nlohmann::json j = {{"op", o.op},
                            {"ranks", w},
                            {"transport", comm.transport_kind()},
                            {"algorithm", row.algorithm},
                            {"dtype", o.dtype},
                            {"bytes", row.bytes},
                            {"time_us", row.time_s * 1e6},
                            {"algbw_gbps", row.algbw},
                            {"busbw_gbps", row.busbw},
                            {"emulated", o.emulate},
                            {"check", bad == 0 ? "ok" : "FAILED"}};
        if (inprocess) {
          j["memcpy_gbps"] = memcpy_gbps;
          j["busbw_over_memcpy"] = row.busbw / memcpy_gbps;
          j["memcpy_concurrent_threads"] = copiers;
          j["memcpy_concurrent_gbps"] = concurrent_gbps;
        }
        if (compare) j["busbw_over_mpi"] = row.busbw / mpi_busbw;
        fmt::print("{}\n", j.dump());
      } else {
        std::string line = fmt::format("{:>12} {:>11} {:>22} {:>11.1f} {:>10.2f} {:>10.2f}",
                                       row.bytes, row.bytes / DTypeSize(dtype), row.algorithm,
                                       row.time_s * 1e6, row.algbw, row.busbw);
        if (inprocess)
          line += fmt::format(" {:>10.2f} {:>10.2f} {:>10.2f}", memcpy_gbps,
                              row.busbw / memcpy_gbps, concurrent_gbps);
        if (compare) line += fmt::format(" {:>10.2f}", row.busbw / mpi_busbw);
        fmt::print("{}{}\n", line, bad == 0 ? "" : "  CHECK FAILED");
      }
    }
    std::fflush(stdout);
  }
}

int RunBenchComm(const BenchCommOptions& o) {
  std::string transport = o.transport;
  if (transport.empty()) transport = comm::RunningUnderMpi() ? "mpi" : "inproc";
  if (transport == "mpi") {
    SY_REQUIRE(comm::MpiCompiledIn(), InvalidArgument,
               "--transport mpi: this build has no MPI transport (SY_WITH_MPI=OFF)");
    SY_REQUIRE(comm::RunningUnderMpi(), InvalidArgument,
               "--transport mpi: not started by an MPI launcher; run e.g. "
               "scripts/mpirun.sh -np 4 switchyard bench comm --transport mpi ...");
    {
      auto world = comm::CreateMpiWorld({.timeout = comm::Milliseconds(o.timeout_ms)});
      comm::AgreeOnConfig(*world, "bench comm",
                          {{"op", o.op},
                           {"algo", o.algos},
                           {"sizes", o.sizes},
                           {"dtype", o.dtype},
                           {"reduce-op", o.reduce_op},
                           {"compare", o.compare},
                           {"iters", std::to_string(o.iters)},
                           {"warmup", std::to_string(o.warmup)},
                           {"ranks-per-node", std::to_string(o.ranks_per_node)},
                           {"timeout-ms", std::to_string(o.timeout_ms)}});
      RunBench(*world, o, world->rank() == 0);
    }
    comm::FinalizeMpi();
    return 0;
  }
  SY_REQUIRE(transport == "inproc", InvalidArgument,
             "--transport: expected inproc or mpi, got '{}'", transport);
  SY_REQUIRE(o.compare.empty(), InvalidArgument,
             "--compare mpi needs --transport mpi (MPI's own collectives run between processes)");
  comm::InProcessOptions options;
  options.timeout = comm::Milliseconds(o.timeout_ms);
  options.ranks_per_node = o.ranks_per_node;
  if (o.emulate) {
    options.emulation = comm::EmulationOptions{{o.intra_latency_us, o.intra_gbps},
                                               {o.inter_latency_us, o.inter_gbps}};
  }
  comm::RunInProcess(
      o.ranks, [&](Communicator& c) { RunBench(c, o, c.rank() == 0); }, options);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "comm", "Collective bandwidth (time, algbw, busbw) as nccl-tests reports it",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchCommOptions>();
      app.add_option("--op", o->op,
                     "allreduce, alltoall, alltoallv, allgather, reduce_scatter, broadcast, "
                     "reduce, scatter, gather");
      app.add_option("--ranks", o->ranks, "ranks (threads) for --transport inproc")
          ->check(CLI::Range(1, 1024));
      app.add_option("--transport", o->transport,
                     "inproc or mpi (default: mpi when started by mpirun)");
      app.add_option("--algo", o->algos,
                     "algorithm(s), comma-separated: auto, ring, tree, pairwise, linear, "
                     "hierarchical, scatter_allgather, reduce_scatter_gather, native");
      app.add_option("--sizes", o->sizes,
                     "bytes per rank: list 1K,64K,1M or range FROM:TO[:FACTOR] (x4 default)");
      app.add_option("--dtype", o->dtype, "float32, bfloat16, int32, int64");
      app.add_option("--reduce-op", o->reduce_op, "sum, max, min");
      app.add_option("--compare", o->compare,
                     "mpi: also time MPI's own collective in the same run (--transport mpi)")
          ->check(CLI::IsMember({"", "mpi"}));
      app.add_option("--iters", o->iters, "timed iterations")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "untimed iterations")->check(CLI::Range(0, 1000));
      app.add_flag("--json", o->json, "one JSON line per size and algorithm");
      app.add_option("--ranks-per-node", o->ranks_per_node,
                     "in-process topology: ranks per node (0 = one node)")
          ->check(CLI::Range(0, 1024));
      app.add_flag("--emulate", o->emulate,
                   "in-process: charge every message the alpha-beta cost of its link");
      app.add_option("--intra-latency-us", o->intra_latency_us, "emulated intra-node latency");
      app.add_option("--intra-gbps", o->intra_gbps, "emulated intra-node GB/s (0 = unlimited)");
      app.add_option("--inter-latency-us", o->inter_latency_us, "emulated inter-node latency");
      app.add_option("--inter-gbps", o->inter_gbps, "emulated inter-node GB/s (0 = unlimited)");
      app.add_option("--timeout-ms", o->timeout_ms, "deadline of every collective")
          ->check(CLI::Range(int64_t{1}, int64_t{86400000}));
      return [o] { return RunBenchComm(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
