// `switchyard bench comm`: collective bandwidth as nccl-tests reports it (time, algbw, busbw per
// size, the factors of docs/PERFORMANCE.md "Collectives"), on the in-process transport (with this
// machine's memcpy bandwidth measured in the same run as the limit) or under MPI (with MPI's own
// collective measured in the same run, interleaved, with --compare mpi).
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
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli/bench_common.h"
#include "cli/bench_setup.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "cli/parse_numbers.h"
#include "cli/timing.h"
#include "switchyard/comm/agree.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/core/dtype.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"

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
  BenchLoopFlags loop{.iters = 20, .warmup = 3};
  NodeLinkFlags links;  // links.ranks_per_node: the in-process topology, emulated or not
  bool emulate = false;
  int64_t timeout_ms = 120000;
};

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

bool IsBlockCollective(CollectiveKind kind) {
  return kind == CollectiveKind::kAllToAll || kind == CollectiveKind::kAllToAllV ||
         kind == CollectiveKind::kAllGather || kind == CollectiveKind::kReduceScatter ||
         kind == CollectiveKind::kScatter || kind == CollectiveKind::kGather;
}

// The sizes to run on W ranks: --sizes (parse_numbers.h's grammar), each rounded UP to a
// multiple of the unit a collective moves (one element; for the block collectives one element
// per rank, W elements), duplicates after rounding dropped.
struct SizePlan {
  std::vector<uint64_t> bytes;
  uint64_t unit = 1;
  bool rounded = false;
};
SizePlan PlanSizes(const BenchCommOptions& o, int w) {
  const CollectiveKind kind = comm::CollectiveFromName(o.op);
  SizePlan plan;
  plan.unit = DTypeSize(DTypeFromName(o.dtype)) *
              (IsBlockCollective(kind) ? static_cast<uint64_t>(w) : uint64_t{1});
  for (uint64_t requested : ParseSizeList(o.sizes, "--sizes")) {
    const uint64_t b = RoundUpToMultiple(requested, plan.unit, "--sizes");
    plan.rounded = plan.rounded || b != requested;
    if (std::find(plan.bytes.begin(), plan.bytes.end(), b) == plan.bytes.end()) {
      plan.bytes.push_back(b);
    }
  }
  return plan;
}

// What the largest size needs in this process, refused up front when it cannot fit
// (RequireMemory): per rank the input and output buffers, up to two buffers of algorithm scratch
// (the hierarchical all-to-all's, kept by the thread between sizes) and, for a bfloat16
// reduction, float32 copies of input and output (twice the bytes each); in-process, the memcpy
// limit's two buffers on each of the first min(W, cores) ranks.
void RequireBenchMemory(const BenchCommOptions& o, const SizePlan& plan, int ranks_in_process,
                        int copiers) {
  const uint64_t largest = *std::max_element(plan.bytes.begin(), plan.bytes.end());
  const bool bf16_reduction = DTypeFromName(o.dtype) == DType::kBFloat16;
  const int64_t per_rank =
      CheckedMul(static_cast<int64_t>(largest), bf16_reduction ? 8 : 4, "bench comm buffers");
  int64_t total = CheckedMul(per_rank, ranks_in_process, "bench comm buffers");
  total += CheckedMul(static_cast<int64_t>(largest) + 8192, 2 * int64_t{copiers},
                      "bench comm memcpy buffers");
  RequireMemory(
      static_cast<uint64_t>(total),
      fmt::format("bench comm --sizes: the largest size, {} per rank x {} rank(s) in "
                  "this process (input, output, algorithm scratch{}{})",
                  FormatBytes(largest), ranks_in_process, bf16_reduction ? ", float32 copies" : "",
                  copiers > 0 ? ", memcpy limit buffers" : ""));
}

// nccl-tests' bus bandwidth factor (docs/PERFORMANCE.md, "Collectives").
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
    const bool blocks = IsBlockCollective(kind);
    count_ = blocks ? bytes / es / w : bytes / es;  // elements per block or per message
    size_t total = blocks ? count_ * w : count_;
    in_ = Tensor::Full({static_cast<int64_t>(total)}, comm.rank() + 1.0, dtype);
    out_ = Tensor::Zeros({static_cast<int64_t>(total)}, dtype);
    counts_.assign(w, static_cast<int64_t>(count_));
  }

  // nccl-tests' size of what is moved (= `bytes`: PlanSizes rounded it to whole elements and
  // blocks).
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

struct Row {
  size_t bytes = 0;
  std::string algorithm;
  double time_s = 0;
  std::optional<double> algbw, busbw;  // GB/s; none when not meaningful (size 0)
  std::string check;
};

// Copiers of the memcpy limit: the first min(W, cores) ranks.
int MemcpyCopiers(int w) {
  return std::min(w, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

// num / den when both are finite, den > 0 and num >= 0; else nothing: a figure that would be
// nan, inf or negative is not printed ("-" in the table, null in --json).
std::optional<double> Ratio(double num, double den) {
  if (!std::isfinite(num) || !std::isfinite(den) || den <= 0 || num < 0) return std::nullopt;
  const double r = num / den;
  return std::isfinite(r) ? std::optional<double>(r) : std::nullopt;
}
std::string Cell(std::optional<double> v, int width = 10) {
  return v ? fmt::format("{:>{}.2f}", *v, width) : fmt::format("{:>{}}", "-", width);
}
// The table's preamble and header.
void PrintCommHeader(Communicator& comm, const BenchCommOptions& o, const SizePlan& plan,
                     bool compare) {
  const CollectiveKind kind = comm::CollectiveFromName(o.op);
  const bool inprocess = comm.transport_kind() == "inprocess";
  const int w = comm.size();
  const double factor = BusFactor(kind, w);
  const bool has_zero = std::find(plan.bytes.begin(), plan.bytes.end(), 0) != plan.bytes.end();
  fmt::print(
      "# switchyard bench comm: {} on {} ranks ({}{}), {}{}, median of {} iterations "
      "(each the max over ranks)\n",
      o.op, w, comm.transport_kind(),
      comm.topology().nodes > 1
          ? fmt::format(", {} nodes x {}", comm.topology().nodes, comm.topology().ranks_per_node)
          : "",
      o.dtype, o.emulate ? ", EMULATED links" : "", o.loop.iters);
  fmt::print("# busbw = algbw x {:.3f}{}\n", factor,
             inprocess
                 ? "; memcpy = one thread copying the same size, interleaved with the "
                   "collectives; memcpy*T = T = min(W, cores) ranks copying it at once (aggregate)"
                 : "");
  if (plan.rounded) {
    fmt::print("# sizes rounded up to a multiple of {} bytes ({} {}{})\n", plan.unit,
               IsBlockCollective(kind) ? fmt::format("{} ranks x", w) : std::string("one"), o.dtype,
               IsBlockCollective(kind) ? " element each" : " element");
  }
  if (has_zero) {
    fmt::print("# -: not meaningful (size 0 moves no bytes: no bandwidth, no ratio)\n");
  }
  std::string header = fmt::format("{:>12} {:>11} {:>22} {:>11} {:>10} {:>10}", "size(B)", "count",
                                   "algorithm", "time(us)", "algbw", "busbw");
  if (inprocess) header += fmt::format(" {:>10} {:>10} {:>10}", "memcpy", "bus/memcpy", "memcpy*T");
  if (compare) header += fmt::format(" {:>10}", "vs mpi");
  fmt::print("{}\n", header);
}

// In-process, the limit: one thread copying `bytes` (between two buffers of this rank) while the
// other ranks wait, timed in the same iterations as the collectives. Page-aligned buffers, the
// destination 64 bytes into its page: glibc's memcpy slows down badly when source and
// destination are a few bytes apart modulo 4 KiB (as two consecutive heap blocks can be), and the
// limit should be the best a copy can do. Also the limit for W ranks sharing the machine: the
// first T = min(W, cores) ranks copying `bytes` each at the same time (aggregate bytes / slowest
// copy).
class MemcpyLimit {
 public:
  MemcpyLimit(Communicator& comm, size_t bytes)
      : comm_(comm), bytes_(bytes), copiers_(MemcpyCopiers(comm.size())) {
    if (comm.rank() >= copiers_) return;
    src_buffer_.assign(bytes + 8192, std::byte{1});
    dst_buffer_.assign(bytes + 8192, std::byte{0});
    auto page = [](std::byte* p) {
      return p + (4096 - reinterpret_cast<uintptr_t>(p) % 4096) % 4096;
    };
    src_ = page(src_buffer_.data());
    dst_ = page(dst_buffer_.data()) + 64;
  }
  int copiers() const { return copiers_; }
  // One iteration: rank 0 copying alone, then the copiers at once; `timed` keeps the times.
  void Run(bool timed) {
    comm_.Barrier().Wait();
    if (comm_.rank() == 0) {
      const double t0 = NowSeconds();
      std::memcpy(dst_, src_, bytes_);
      if (timed) alone_.push_back(NowSeconds() - t0);
    }
    const double t = TimedOnAllRanks(comm_, [&] {
      if (comm_.rank() < copiers_) std::memcpy(dst_, src_, bytes_);
    });
    if (timed) concurrent_.push_back(t);
  }
  // GB/s of one copy, and of the copiers together (rank 0's view); none for 0 bytes.
  std::optional<double> AloneGbps() const {
    if (alone_.empty() || bytes_ == 0) return std::nullopt;
    return Ratio(static_cast<double>(bytes_), Median(alone_) * 1e9);
  }
  std::optional<double> ConcurrentGbps() const {
    if (alone_.empty() || bytes_ == 0) return std::nullopt;
    return Ratio(static_cast<double>(bytes_) * copiers_, Median(concurrent_) * 1e9);
  }

 private:
  Communicator& comm_;
  size_t bytes_;
  int copiers_;
  std::vector<std::byte> src_buffer_, dst_buffer_;
  std::byte *src_ = nullptr, *dst_ = nullptr;
  std::vector<double> alone_, concurrent_;
};

// One size's figures, printed by rank 0 as JSON lines or table rows.
struct SizeReport {
  std::vector<Row> rows = {};
  int32_t bad = 0;  // results that failed their check, over every rank
  bool inprocess = false, compare = false;
  int copiers = 0;
  std::optional<double> memcpy_gbps = {}, concurrent_gbps = {};
};

void PrintSizeReport(Communicator& comm, const BenchCommOptions& o, const SizeReport& s) {
  const std::optional<double> mpi_busbw = s.compare ? s.rows.back().busbw : std::nullopt;
  auto over = [](std::optional<double> a, std::optional<double> b) {
    return a && b ? Ratio(*a, *b) : std::nullopt;
  };
  for (const Row& row : s.rows) {
    if (o.loop.json) {
      nlohmann::json j = {{"op", o.op},
                          {"ranks", comm.size()},
                          {"transport", comm.transport_kind()},
                          {"algorithm", row.algorithm},
                          {"dtype", o.dtype},
                          {"bytes", row.bytes},
                          {"time_us", row.time_s * 1e6},
                          {"algbw_gbps", JsonOf(row.algbw)},
                          {"busbw_gbps", JsonOf(row.busbw)},
                          {"emulated", o.emulate},
                          {"check", s.bad == 0 ? "ok" : "FAILED"}};
      if (s.inprocess) {
        j["memcpy_gbps"] = JsonOf(s.memcpy_gbps);
        j["busbw_over_memcpy"] = JsonOf(over(row.busbw, s.memcpy_gbps));
        j["memcpy_concurrent_threads"] = s.copiers;
        j["memcpy_concurrent_gbps"] = JsonOf(s.concurrent_gbps);
      }
      if (s.compare) j["busbw_over_mpi"] = JsonOf(over(row.busbw, mpi_busbw));
      PrintJsonLine(j);
      continue;
    }
    std::string line = fmt::format("{:>12} {:>11} {:>22} {:>11.1f} {} {}", row.bytes,
                                   row.bytes / DTypeSize(DTypeFromName(o.dtype)), row.algorithm,
                                   row.time_s * 1e6, Cell(row.algbw), Cell(row.busbw));
    if (s.inprocess) {
      line += fmt::format(" {} {} {}", Cell(s.memcpy_gbps), Cell(over(row.busbw, s.memcpy_gbps)),
                          Cell(s.concurrent_gbps));
    }
    if (s.compare) line += " " + Cell(over(row.busbw, mpi_busbw));
    fmt::print("{}{}\n", line, s.bad == 0 ? "" : "  CHECK FAILED");
  }
  std::fflush(stdout);
}

void RunBench(Communicator& comm, const BenchCommOptions& o, const SizePlan& plan, bool print) {
  const CollectiveKind kind = comm::CollectiveFromName(o.op);
  const DType dtype = DTypeFromName(o.dtype);
  const comm::ReduceOp reduce_op = comm::ReduceOpFromName(o.reduce_op);
  std::vector<Algorithm> algos;
  for (const std::string& a : SplitList(o.algos, ',')) algos.push_back(comm::AlgorithmFromName(a));
  const bool compare = o.compare == "mpi";
  if (compare) algos.push_back(Algorithm::kNative);
  const bool inprocess = comm.transport_kind() == "inprocess";
  const double factor = BusFactor(kind, comm.size());
  if (print && !o.loop.json) PrintCommHeader(comm, o, plan, compare);

  for (uint64_t bytes : plan.bytes) {
    Job job(comm, kind, bytes, dtype, reduce_op);
    const size_t actual = job.actual_bytes();
    std::vector<std::vector<double>> times(algos.size());
    std::optional<MemcpyLimit> limit;
    if (inprocess) limit.emplace(comm, actual);
    for (int it = 0; it < o.loop.warmup + o.loop.iters; ++it) {
      const bool timed = it >= o.loop.warmup;
      if (limit) limit->Run(timed);
      for (size_t a = 0; a < algos.size(); ++a) {  // interleaved: same conditions for all
        const double t = TimedOnAllRanks(comm, [&] { job.Start(algos[a]).Wait(); });
        if (timed) times[a].push_back(t);
      }
    }
    SizeReport report{.inprocess = inprocess, .compare = compare};
    for (size_t a = 0; a < algos.size(); ++a) {
      Row row;
      row.bytes = actual;
      row.algorithm = std::string(comm::AlgorithmName(algos[a]));
      row.time_s = Median(times[a]);
      row.algbw = Ratio(static_cast<double>(actual), row.time_s * 1e9);
      if (actual == 0) row.algbw.reset();  // nothing moved: no bandwidth
      if (row.algbw) row.busbw = *row.algbw * factor;
      job.Start(algos[a]).Wait();
      row.check = job.Check();
      report.rows.push_back(row);
    }
    // Results of every rank are checked; failures are reported by rank 0 as a count.
    for (const Row& row : report.rows) report.bad += row.check.empty() ? 0 : 1;
    comm.AllReduce(&report.bad, &report.bad, 1, DType::kInt32).Wait();
    if (limit) {
      report.copiers = limit->copiers();
      report.memcpy_gbps = limit->AloneGbps();
      report.concurrent_gbps = limit->ConcurrentGbps();
    }
    if (print) PrintSizeReport(comm, o, report);
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
    // Sizes and memory checked before MPI starts (one rank per process; the rounding to W
    // blocks, known once the world exists, adds less than W elements).
    RequireBenchMemory(o, PlanSizes(o, 1), 1, 0);
    {
      auto world = comm::CreateMpiWorld({.timeout = comm::Milliseconds(o.timeout_ms)});
      comm::AgreeOnConfig(*world, "bench comm",
                          {{"op", o.op},
                           {"algo", o.algos},
                           {"sizes", o.sizes},
                           {"dtype", o.dtype},
                           {"reduce-op", o.reduce_op},
                           {"compare", o.compare},
                           {"iters", std::to_string(o.loop.iters)},
                           {"warmup", std::to_string(o.loop.warmup)},
                           {"ranks-per-node", std::to_string(o.links.ranks_per_node)},
                           {"timeout-ms", std::to_string(o.timeout_ms)}});
      const SizePlan plan = PlanSizes(o, world->size());
      RequireBenchMemory(o, plan, 1, 0);
      RunBench(*world, o, plan, world->rank() == 0);
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
  options.ranks_per_node = o.links.ranks_per_node;
  const SizePlan plan = PlanSizes(o, o.ranks);
  if (o.emulate) {
    options.emulation = o.links.Emulation();
    RequireEmulationFitsDeadline(*options.emulation, options.timeout, "--timeout-ms",
                                 *std::max_element(plan.bytes.begin(), plan.bytes.end()));
  }
  RequireBenchMemory(o, plan, o.ranks, MemcpyCopiers(o.ranks));
  comm::RunInProcess(
      o.ranks, [&](Communicator& c) { RunBench(c, o, plan, c.rank() == 0); }, options);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "comm", "Collective bandwidth (time, algbw, busbw) as nccl-tests reports it",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchCommOptions>();
      app.add_option("--op", o->op,
                     "allreduce, alltoall, alltoallv, allgather, reduce_scatter, broadcast, "
                     "reduce, scatter, gather");
      AddIntOption(app, "--ranks", &o->ranks, 1, 1024, "ranks (threads) for --transport inproc");
      app.add_option("--transport", o->transport,
                     "inproc or mpi (default: mpi when started by mpirun)");
      app.add_option("--algo", o->algos,
                     "algorithm(s), comma-separated: auto, ring, tree, pairwise, linear, "
                     "hierarchical, scatter_allgather, reduce_scatter_gather, native");
      app.add_option("--sizes", o->sizes,
                     "bytes per rank: list 1K,64K,1M or range FROM:TO[:FACTOR] (x4 default); "
                     "suffixes K M G T P = powers of 1024; each rounded up to whole elements "
                     "(x W for block collectives)")
          ->type_name("SIZES");
      app.add_option("--dtype", o->dtype, "float32, bfloat16, int32, int64");
      app.add_option("--reduce-op", o->reduce_op, "sum, max, min");
      app.add_option("--compare", o->compare,
                     "mpi: also time MPI's own collective in the same run (--transport mpi)")
          ->check(CLI::IsMember({"", "mpi"}));
      AddBenchLoopFlags(app, &o->loop,
                        {.max_iters = 100000, .json_help = "one JSON line per size and algorithm"});
      AddIntOption(app, "--ranks-per-node", &o->links.ranks_per_node, 0, 1024,
                   "in-process topology: ranks per node (0 = one node)");
      app.add_flag("--emulate", o->emulate,
                   "in-process: charge every message the alpha-beta cost of its link");
      AddEmulationLinkOptions(app, &o->links.intra_latency_us, &o->links.intra_gbps,
                              &o->links.inter_latency_us, &o->links.inter_gbps);
      AddIntOption(app, "--timeout-ms", &o->timeout_ms, int64_t{1}, int64_t{86400000},
                   "deadline of every collective");
      return [o] { return RunBenchComm(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
