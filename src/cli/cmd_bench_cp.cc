// `switchyard bench cp`: the context-parallel attention core of train/context_parallel.h (forward +
// backward, causal) on one long batch, P ranks as threads of this process over emulated links, for
// each algorithm (ring, ulysses) and sequence split (plain, zigzag):
//   - per-rank attention time: each rank's time outside blocking waits (CommStats compute), and
//     the imbalance max/min over ranks, with the deterministic per-rank work (score elements);
//   - the hidden fraction of the transfers: the same collectives alone (no attention) take `comm`;
//     the rank that waited least in them (the busiest: the others also wait for its compute)
//     waited `blocked`, so hidden = 1 - blocked / comm (in [0, 1], per iteration, then the
//     median), next to the bound of the schedule (the ring's last gradient hop has no compute
//     left to hide behind; Ulysses's all-to-alls are not overlapped);
//   - bytes per rank against the closed form (docs/context_parallel.md);
//   - the peak bytes of the tensors a rank holds in forward and in backward (CpWork), next to the
//     [batch, heads, seq, seq] softmax the single-rank core of train/layers.h keeps.
//
//   switchyard bench cp                              # cp 1, 2, 4; seq 4096
//   switchyard bench cp --cp 2 --algos ring --seq 8192 --intra-gbps 0.05 --json
//
// Each GEMM runs on one thread per rank (ranks beyond the cores time-share them).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/bench_common.h"
#include "cli/bench_setup.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/timing.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/parallel/comm_stats.h"
#include "switchyard/train/context_parallel.h"

namespace switchyard::cli {
namespace {

using parallel::CommStats;
using parallel::Traffic;
using train::CpAlgorithm;
using train::SequenceSplitKind;

struct BenchCpOptions {
  std::vector<int> cp = {1, 2, 4};
  std::vector<std::string> algos = {"ring", "ulysses"};
  std::vector<std::string> splits = {"plain", "zigzag"};
  int64_t seq = 4096;
  int64_t batch = 1;
  int64_t heads = 8;
  int64_t head_dim = 32;
  BenchLoopFlags loop{.iters = 2, .warmup = 0};
  UniformLinkFlags link{.timeout_ms = 600000};
};

struct Config {
  CpAlgorithm algo;
  SequenceSplitKind split;
};
const char* AlgoName(CpAlgorithm a) { return a == CpAlgorithm::kRing ? "ring" : "ulysses"; }
const char* SplitName(SequenceSplitKind s) {
  return s == SequenceSplitKind::kPlain ? "plain" : "zigzag";
}

// Bytes one rank sends per forward + backward (docs/context_parallel.md): a = batch * seq / P *
// D * 4 is one activation of this rank's tokens. Ulysses: 4 activations all-to-all'd each way,
// (P-1)/P of them leave the rank: 8 (P-1)/P a. Ring: (P-1) k|v blocks forward, (P-1) k|v blocks
// and (P-1) of their gradients backward: 6 (P-1) a.
double ClosedFormBytes(CpAlgorithm algo, int64_t p, const BenchCpOptions& o) {
  const double a = static_cast<double>(o.batch * (o.seq / p) * o.heads * o.head_dim) * 4;
  const double pm = static_cast<double>(p - 1);
  return algo == CpAlgorithm::kUlysses ? 8 * pm / static_cast<double>(p) * a : 6 * pm * a;
}

// The share of the transfers the schedule can hide: the ring overlaps every hop with a step's
// attention except the backward's last gradient hop (1 of 3 (P - 1)); Ulysses none.
double HiddenBound(CpAlgorithm algo, int64_t p) {
  if (algo == CpAlgorithm::kUlysses || p == 1) return 0;
  const double hops = 3.0 * static_cast<double>(p - 1);
  return (hops - 1) / hops;
}

struct Result {
  Config config{};
  std::vector<double> step, comm, blocked, blocked_max, hidden;
  std::vector<double> rank_compute_max, rank_compute_min;  // per iteration
  int64_t score_max = 0, score_min = 0;                    // forward + backward
  int64_t peak_fwd = 0, peak_bwd = 0;                      // max over ranks
  double bytes_max = 0, bytes_min = 0;
};

// The collectives of one forward + backward with no attention: Ulysses's four all-to-alls, the
// ring's 3 (P - 1) hops (as all-to-all-v with one non-empty message).
// act/act3 [P * n, D / P] and [P * n, 3 D / P] for n rows per rank; kv [2 n D] (a k|v block).
void CommOnly(comm::Communicator& g, CpAlgorithm algo, const Tensor& act, const Tensor& act3,
              const Tensor& recv, const Tensor& recv3, const Tensor& kv, const Tensor& kv_recv) {
  const int p = g.size();
  if (p == 1) return;
  if (algo == CpAlgorithm::kUlysses) {
    g.AllToAll(act3, recv3).Wait();
    g.AllToAll(act, recv).Wait();
    g.AllToAll(act, recv).Wait();
    g.AllToAll(act3, recv3).Wait();
    return;
  }
  const int64_t count = kv.numel();
  std::vector<int64_t> send(static_cast<size_t>(p), 0), rc(send);
  send[static_cast<size_t>((g.rank() + 1) % p)] = count;
  rc[static_cast<size_t>((g.rank() - 1 + p) % p)] = count;
  for (int h = 0; h < 3 * (p - 1); ++h)
    g.AllToAllV(kv.data<float>(), send, {}, kv_recv.data<float>(), rc, {}, DType::kFloat32).Wait();
}

std::vector<Result> RunCp(const BenchCpOptions& o, int p, const std::vector<Config>& configs) {
  const int64_t d = o.heads * o.head_dim;
  std::unique_ptr<comm::Launcher> launcher = MakeUniformLinkLauncher(
      p, o.link, static_cast<uint64_t>(o.batch * o.seq * 3 * d) * sizeof(float), "bench cp");
  std::vector<Result> results(configs.size());
  const Tensor qkv = RandomTensor({o.batch * o.seq, 3 * d}, 1);
  const Tensor datt = RandomTensor({o.batch * o.seq, d}, 2);
  std::vector<double> compute(static_cast<size_t>(p)), blocked(static_cast<size_t>(p));
  std::vector<int64_t> scores(static_cast<size_t>(p));
  std::vector<train::CpWork> fw(static_cast<size_t>(p)), bw(static_cast<size_t>(p));
  std::vector<double> bytes(static_cast<size_t>(p));
  launcher->Run([&](comm::Communicator& world) {
    const auto r = static_cast<size_t>(world.rank());
    const int64_t rows = o.batch * (o.seq / p);
    const int64_t dl = std::max<int64_t>(d / p, 1);  // Ulysses: d divides by p
    const Tensor act = Tensor::Zeros({p * rows, dl}), act3 = Tensor::Zeros({p * rows, 3 * dl});
    const Tensor recv = Tensor::Zeros(act.shape()), recv3 = Tensor::Zeros(act3.shape());
    const Tensor kv = Tensor::Zeros({2 * rows * d}), kv_recv = Tensor::Zeros({2 * rows * d});
    for (size_t c = 0; c < configs.size(); ++c) {
      const Config& cfg = configs[c];
      train::ContextParallelAttention attn(world, o.heads, o.seq, {cfg.algo, cfg.split, true});
      const Tensor x = attn.split().Shard(qkv, o.batch);
      const Tensor dy = attn.split().Shard(datt, o.batch);
      Result& res = results[c];
      res.config = cfg;
      for (int it = 0; it < o.loop.warmup + o.loop.iters; ++it) {
        CommStats fs, bs;
        train::CpWork fwork, bwork;
        train::ContextParallelCache cache;  // outside the timing: its release is not timed
        const double step = TimedOnAllRanks(world, [&] {
          (void)attn.Forward(x, o.batch, &cache, 1, &fs, &fwork);
          (void)attn.Backward(cache, dy, 1, &bs, &bwork);
        });
        compute[r] = fs.compute_seconds() + bs.compute_seconds();
        blocked[r] = fs.comm_seconds + bs.comm_seconds;
        scores[r] = fwork.score_elements + bwork.score_elements;
        fw[r] = fwork;
        bw[r] = bwork;
        bytes[r] = fs.Bytes(Traffic::kContext) + bs.Bytes(Traffic::kContext);
        const double comm = TimedOnAllRanks(
            world, [&] { CommOnly(world, cfg.algo, act, act3, recv, recv3, kv, kv_recv); });
        world.Barrier().Wait();  // every rank's figures are written
        if (r == 0 && it >= o.loop.warmup) {
          const double blk = *std::min_element(blocked.begin(), blocked.end());
          res.step.push_back(step);
          res.comm.push_back(comm);
          res.blocked.push_back(blk);
          res.blocked_max.push_back(*std::max_element(blocked.begin(), blocked.end()));
          if (const auto h = Quotient(comm - blk, comm)) {
            res.hidden.push_back(std::clamp(*h, 0.0, 1.0));
          }
          res.rank_compute_max.push_back(*std::max_element(compute.begin(), compute.end()));
          res.rank_compute_min.push_back(*std::min_element(compute.begin(), compute.end()));
          res.score_max = *std::max_element(scores.begin(), scores.end());
          res.score_min = *std::min_element(scores.begin(), scores.end());
          res.peak_fwd = res.peak_bwd = 0;
          for (size_t q = 0; q < fw.size(); ++q) {
            res.peak_fwd = std::max(res.peak_fwd, fw[q].peak_bytes);
            res.peak_bwd = std::max(res.peak_bwd, bw[q].peak_bytes);
          }
          res.bytes_max = *std::max_element(bytes.begin(), bytes.end());
          res.bytes_min = *std::min_element(bytes.begin(), bytes.end());
        }
        world.Barrier().Wait();
      }
    }
  });
  return results;
}

const TextTable& CpTable() {
  static const TextTable table("  ", {{"algo", 8, true},
                                      {"split", 7, true},
                                      {"step ms", 8},
                                      {"rank ms min..max", 17},
                                      {"imbalance", 9},
                                      {"scores m/m", 10},
                                      {"comm ms", 8},
                                      {"blocked min..max", 15},
                                      {"hidden", 7},
                                      {"bound", 6},
                                      {"MB/rank", 8},
                                      {"agree", 6},
                                      {"peak fwd", 9},
                                      {"peak bwd", 9}});
  return table;
}

int RunBenchCp(const BenchCpOptions& o) {
  std::vector<Config> all;
  for (const std::string& a : o.algos)
    for (const std::string& s : o.splits) {
      const Config c{a == "ring" ? CpAlgorithm::kRing : CpAlgorithm::kUlysses,
                     s == "plain" ? SequenceSplitKind::kPlain : SequenceSplitKind::kZigzag};
      if (std::none_of(all.begin(), all.end(),
                       [&](const Config& x) { return x.algo == c.algo && x.split == c.split; }))
        all.push_back(c);
    }
  // Every size product below is checked for overflow first (each flag alone may be up to 2^40).
  const int64_t d = CheckedMul(o.heads, o.head_dim, "bench cp: --heads x --head-dim");
  const int64_t tokens = CheckedMul(o.batch, o.seq, "bench cp: --batch x --seq");
  // The inputs, outputs, gradients and communication buffers (about 24 floats per token and
  // model column) and the per-head statistics (log-sum-exp and its gradient's row sums).
  // (Each term is below 2^63, so their sum fits in uint64.)
  const uint64_t need =
      static_cast<uint64_t>(CheckedMul(CheckedMul(tokens, d, "bench cp: tokens x model dim"),
                                       4 * 24, "bench cp: bytes")) +
      static_cast<uint64_t>(CheckedMul(CheckedMul(tokens, o.heads, "bench cp: tokens x heads"),
                                       4 * 4, "bench cp: bytes"));
  for (int p : o.cp) {
    for (const Config& c : all) {
      const int64_t m = train::SequenceSplit::Multiple(c.split, p);
      SY_REQUIRE(o.seq % m == 0, InvalidArgument,
                 "bench cp: --seq {} does not divide into {} chunks (the {} split at --cp {}); "
                 "expected a multiple of {}",
                 o.seq, m, SplitName(c.split), p, m);
      SY_REQUIRE(c.algo != CpAlgorithm::kUlysses || o.heads % p == 0, InvalidArgument,
                 "bench cp: --heads {} does not divide by --cp {} (Ulysses gives each rank "
                 "heads / cp heads)",
                 o.heads, p);
    }
    RequireMemory(need, fmt::format("bench cp: --seq {} x --batch {} x {} model dim on --cp {}",
                                    o.seq, o.batch, d, p));
  }
  const int cores = PrepareOneThreadPerRank();
  const double softmax_mib = static_cast<double>(o.batch) * static_cast<double>(o.heads) *
                             static_cast<double>(o.seq) * static_cast<double>(o.seq) * 4 /
                             (1024.0 * 1024.0);
  if (!o.loop.json) {
    fmt::print(
        "# switchyard bench cp: causal attention core, forward + backward, batch {} x seq {}, "
        "{} heads x head_dim {}, float32\n",
        o.batch, o.seq, o.heads, o.head_dim);
    fmt::print(
        "# ranks as threads (in-process), EMULATED links: {:g} us + {:g} GB/s per message; {} "
        "core(s), 1 GEMM thread per rank; median of {} iterations\n",
        o.link.latency_us, o.link.gbps, cores, o.loop.iters);
    fmt::print(
        "# rank ms = a rank's time outside blocking waits (min..max over ranks), imbalance = "
        "max/min; scores = score elements per rank (max/min); comm = the same collectives "
        "alone; blocked = the least and the most a rank waited in them; hidden = 1 - least "
        "blocked / comm; bound = what the schedule can hide\n");
    fmt::print(
        "# peak = the most bytes of tensors a rank holds (forward, backward); the single-rank "
        "core of train/layers.h keeps the softmax [batch, heads, seq, seq]: {:.1f} MiB\n",
        softmax_mib);
  }
  for (int p : o.cp) {
    const std::vector<Result> results = RunCp(o, p, all);
    if (!o.loop.json) {
      fmt::print("\ncp {}{}\n", p, OversubscribedNote(p, cores, "they time-share the cores"));
      CpTable().PrintHeader();
    }
    for (const Result& r : results) {
      const double step = SummarizeTimes(r.step).median_s;
      const double cmax = SummarizeTimes(r.rank_compute_max).median_s;
      const double cmin = SummarizeTimes(r.rank_compute_min).median_s;
      std::vector<double> ratios;
      for (size_t i = 0; i < r.rank_compute_max.size(); ++i)
        if (const auto q = Quotient(r.rank_compute_max[i], r.rank_compute_min[i]))
          ratios.push_back(*q);
      const std::optional<double> imbalance = MedianIfAny(ratios);
      const std::optional<double> score_ratio =
          Quotient(static_cast<double>(r.score_max), static_cast<double>(r.score_min));
      const double comm = SummarizeTimes(r.comm).median_s,
                   blocked = SummarizeTimes(r.blocked).median_s,
                   blocked_max = SummarizeTimes(r.blocked_max).median_s;
      const std::optional<double> hidden = p > 1 ? MedianIfAny(r.hidden) : std::nullopt;
      const double bound = HiddenBound(r.config.algo, p);  // shown for p > 1
      const double closed = ClosedFormBytes(r.config.algo, p, o);
      const bool agree = std::fabs(r.bytes_max - closed) <= 1e-9 * std::max(closed, 1.0) &&
                         std::fabs(r.bytes_min - closed) <= 1e-9 * std::max(closed, 1.0);
      if (o.loop.json) {
        const nlohmann::json j = {
            {"op", "cp"},
            {"cp", p},
            {"algo", AlgoName(r.config.algo)},
            {"split", SplitName(r.config.split)},
            {"seq", o.seq},
            {"batch", o.batch},
            {"heads", o.heads},
            {"head_dim", o.head_dim},
            {"iters", o.loop.iters},
            {"cores", cores},
            {"emulation", o.link.Json()},
            {"step_median_ms", step * 1e3},
            {"rank_compute_max_ms", cmax * 1e3},
            {"rank_compute_min_ms", cmin * 1e3},
            {"imbalance", JsonOf(imbalance)},
            {"score_elements_max", r.score_max},
            {"score_elements_min", r.score_min},
            {"score_imbalance", JsonOf(score_ratio)},
            {"comm_alone_ms", comm * 1e3},
            {"blocked_ms", blocked * 1e3},
            {"blocked_max_ms", blocked_max * 1e3},
            {"hidden_fraction", JsonOf(hidden)},
            {"hidden_fraction_bound", p > 1 ? nlohmann::json(bound) : nlohmann::json(nullptr)},
            {"bytes_per_rank_max", r.bytes_max},
            {"bytes_per_rank_min", r.bytes_min},
            {"closed_form_bytes", closed},
            {"bytes_agree", agree},
            {"peak_forward_bytes", r.peak_fwd},
            {"peak_backward_bytes", r.peak_bwd},
            {"single_rank_softmax_bytes", o.batch * o.heads * o.seq * o.seq * 4}};
        fmt::print("{}\n", j.dump());
        continue;
      }
      CpTable().PrintRow(
          {AlgoName(r.config.algo), SplitName(r.config.split), fmt::format("{:.1f}", step * 1e3),
           fmt::format("{:.1f}..{:.1f}", cmin * 1e3, cmax * 1e3), Fixed2(imbalance),
           Fixed2(score_ratio), fmt::format("{:.1f}", comm * 1e3),
           fmt::format("{:.1f}..{:.1f}", blocked * 1e3, blocked_max * 1e3), Percent(hidden),
           p > 1 ? fmt::format("{:.0f}%", 100 * bound) : std::string("-"),
           fmt::format("{:.2f}", r.bytes_max / 1e6), agree ? "yes" : "NO",
           fmt::format("{:>5.1f} MiB", static_cast<double>(r.peak_fwd) / (1024.0 * 1024.0)),
           fmt::format("{:>5.1f} MiB", static_cast<double>(r.peak_bwd) / (1024.0 * 1024.0))});
    }
  }
  if (!o.loop.json) {
    fmt::print(
        "\nbytes per rank per forward + backward, a = batch x seq/P x D x 4: ulysses 8 (P-1)/P a, "
        "ring 6 (P-1) a (docs/context_parallel.md)\n");
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "cp",
    "Context-parallel attention (ring, Ulysses; plain and zigzag splits): per-rank time and "
    "imbalance, hidden fraction of the transfers, bytes, peak memory per rank",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchCpOptions>();
      AddIntListOption(app, "--cp", &o->cp, 1, 256,
                       "context-parallel sizes, comma-separated (ranks as threads)");
      app.add_option("--algos", o->algos, "comma-separated: ring, ulysses")
          ->delimiter(',')
          ->check(CLI::IsMember({"ring", "ulysses"}));
      app.add_option("--splits", o->splits, "comma-separated: plain, zigzag")
          ->delimiter(',')
          ->check(CLI::IsMember({"plain", "zigzag"}));
      AddIntOption(app, "--seq", &o->seq, int64_t{1}, int64_t{1} << 40,
                   "tokens per sequence (a multiple of 2 x every cp)");
      AddIntOption(app, "--batch", &o->batch, int64_t{1}, int64_t{1} << 40, "sequences");
      AddIntOption(app, "--heads", &o->heads, int64_t{1}, int64_t{1} << 40,
                   "attention heads (divisible by every cp for ulysses)");
      AddIntOption(app, "--head-dim", &o->head_dim, int64_t{1}, int64_t{1} << 40,
                   "columns per head");
      AddBenchLoopFlags(app, &o->loop, {.json_help = "one JSON line per cp, algorithm and split"});
      AddUniformLinkFlags(app, &o->link, "the cp ranks");
      return [o] { return RunBenchCp(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
