// `switchyard bench layer-parallel` (and `bench layer --ranks W`): one MoE layer on W ranks
// (threads of this process, or MPI processes), forward + backward + gradient sync per step: step
// time, tokens/s, and per rank the time blocked in communication vs. computing and the bytes put on
// the wire, against the adaptive-r volume model's prediction (docs/parallel.md, "Tutel's
// adaptive r"). Measured interleaved in the same run: the limit
// (in-process only), the single-rank layer on the same global batch with all the cores; and with
// an overlap schedule (--overlap-degree, --smart-schedule, --shadow), the plain path (D = 1, no
// smart schedule, no shadows) on the same batch, with the fraction of the token communication the
// schedule hid.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/bench_common.h"
#include "cli/bench_parallel.h"
#include "cli/bench_routing.h"
#include "cli/bench_setup.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/timing.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/expert_shard.h"
#include "switchyard/parallel/schedule.h"
#include "switchyard/parallel/trace.h"

namespace switchyard::cli {
namespace {

// Token all-to-alls of one run, averaged over the ranks (forward + backward of the last step):
// time blocked in them and time they ran.
struct TokenComm {
  double blocked = 0, busy = 0;
};
TokenComm TokenCommOf(const parallel::LayerRunResult& run) {
  TokenComm t;
  for (const parallel::RankReport& r : run.ranks) {
    t.blocked += r.forward.CommSeconds(parallel::Traffic::kTokens) +
                 r.backward.CommSeconds(parallel::Traffic::kTokens);
    t.busy += r.forward.BusySeconds(parallel::Traffic::kTokens) +
              r.backward.BusySeconds(parallel::Traffic::kTokens);
  }
  const auto n = static_cast<double>(std::max<size_t>(1, run.ranks.size()));
  t.blocked /= n;
  t.busy /= n;
  return t;
}

// Per repetition, the slowest rank's step time.
void AppendSteps(const parallel::LayerRunResult& run, std::vector<double>* steps) {
  for (size_t rep = 0; rep < run.ranks[0].step_seconds.size(); ++rep) {
    double worst = 0;
    for (const parallel::RankReport& r : run.ranks) worst = std::max(worst, r.step_seconds[rep]);
    steps->push_back(worst);
  }
}

// An estimate of the peak bytes this process holds (an upper bound within a small factor; it
// exists to refuse what cannot fit before allocating, not to account exactly), in float32:
//   batch: x and dy of the global batch, and the single-rank reference's output, dx and
//     activations (T x M each, 6 of them);
//   routed rows R = T x k x max(1, cf) (dropless: T x k): dispatched, expert output and their
//     gradients (R x M, 4) and the expert hidden activations with their gradients (R x H, 3; 4
//     gated);
//   parameters P (E (M H (2|3) + H + M)): weights, gradients and a copy, on every in-process
//     rank (an upper bound: ranks hold 1/ep of them).
// The parallel run holds the same activations split over its ranks, so they count twice.
}  // namespace

double MoeExpertRows(const moe::LayerConfig& c, int64_t tokens) {
  const double t = static_cast<double>(tokens), e = static_cast<double>(c.num_experts);
  const double tk = t * static_cast<double>(moe::EffectiveTopK(c));
  if (c.dropless) return tk;
  const double cf = c.capacity_factor;
  if (cf == 0) return tk;  // the largest load: about T k / E per expert when balanced
  // cf > 0: exactly the layer's capacity; cf < 0: at most that of |cf|, and never more than
  // every token on every expert. A capacity beyond the int32 rows the layer allows counts as
  // T k |cf| rows, which no memory holds either: the estimate is refused as too large.
  moe::LayerConfig positive = c;
  positive.capacity_factor = static_cast<float>(std::fabs(cf));
  double rows = tk * std::fabs(cf);
  try {
    rows = e * static_cast<double>(moe::ComputeCapacity(positive, tokens, tokens));
  } catch (const InvalidArgument&) {
  }
  return cf > 0 ? rows : std::min(rows, e * t);
}

uint64_t EstimateMoeStepBytes(const moe::LayerConfig& c, int64_t tokens, double param_copies,
                              double extra_floats) {
  const double t = static_cast<double>(tokens), m = static_cast<double>(c.model_dim),
               h = static_cast<double>(c.hidden_dim), e = static_cast<double>(c.num_experts);
  const double k = static_cast<double>(moe::EffectiveTopK(c));
  const double rows = MoeExpertRows(c, tokens);
  const double params = e * (m * h * (c.gated ? 3.0 : 2.0) + h + m) + e * m;
  const double floats = 2 * (6 * t * m + 4 * rows * m + (c.gated ? 4.0 : 3.0) * rows * h) +
                        4 * t * e + 8 * t * k + 3 * params * param_copies + extra_floats;
  const double bytes = floats * 4;
  return bytes >= 0x1p62 ? uint64_t{1} << 62 : static_cast<uint64_t>(bytes);
}

namespace {

// The runs one round makes and what they share: the layer, the layout, the launchers, the batch.
struct ParallelSetup {
  moe::LayerConfig config;
  parallel::DriverOptions run;    // the layout and schedules asked for
  parallel::DriverOptions plain;  // the same layout on the plain path (D 1, no smart, no shadows)
  std::string transport;
  bool emulated = false;
  std::unique_ptr<comm::Launcher> launcher;
  // With emulated links: the same ranks over free links (see with_free).
  std::unique_ptr<comm::Launcher> free_launcher;
  int per_rank_threads = 0;
  int cores = 0;
  std::optional<parallel::Mesh> mesh;
  int64_t t_global = 0;
  moe::LayerParams params;
  moe::LayerParams balanced_params;  // params with the gate not skewed (with_balanced)
  Tensor x, dy;
  bool reference = false;  // the single-rank layer on the same batch, all the cores
  bool compare = false;    // with a schedule: the plain path
  // With emulated links, the plain path over free links (no emulated cost) too: the step without
  // communication cost, so that (plain - free) is what communication costs the plain path.
  bool with_free = false;
  // With a skewed gate and shadows, the plain path with the gate not skewed too: the step without
  // the hot expert's imbalance, so that (plain - balanced) is what the skew costs the plain path.
  bool with_balanced = false;
  // --imbalance: `run` forces Zipf routes, `uniform` the same layout with uniform routes.
  bool imbalance = false;
  parallel::DriverOptions uniform;
};

// The layout and schedules of the flags (named values parsed here: a bad one throws).
parallel::DriverOptions DriverOptionsOf(const BenchParallelOptions& o) {
  parallel::DriverOptions d;
  d.parallel = o.layout.Options(o.ranks);
  d.threads = o.threads;
  d.repeat = o.loop.iters;
  d.warmup = o.loop.warmup;
  return d;
}

// The in-process options of --emulate-ranks-per-node (none without it); the schedules' cost
// model assumes the emulated link unless given one.
comm::InProcessOptions EmulationOf(const BenchParallelOptions& o, bool mpi,
                                   parallel::ParallelOptions* p) {
  comm::InProcessOptions inprocess;
  if (o.links.ranks_per_node <= 0) return inprocess;
  SY_REQUIRE(!mpi, InvalidArgument, "--emulate-ranks-per-node applies to the in-process transport");
  inprocess.ranks_per_node = o.links.ranks_per_node;
  inprocess.emulation = o.links.Emulation();
  RequireEmulationFitsDeadline(*inprocess.emulation, inprocess.timeout, "", 0);
  const std::optional<comm::LinkModel> link = comm::EmulatedLink(inprocess, o.ranks);
  if (link && p->cost_model.link_gbps <= 0) {
    p->cost_model.link_gbps = link->bandwidth_gbps;
    p->cost_model.link_latency_us = link->latency_us;
  }
  return inprocess;
}

ParallelSetup MakeParallelSetup(const BenchParallelOptions& o) {
  ParallelSetup s;
  s.config = o.layer.Config();
  s.config.expert_bias = o.hot_expert_bias > 0;
  moe::ValidateConfig(s.config);
  s.run = DriverOptionsOf(o);
  const parallel::ParallelOptions& p = s.run.parallel;
  s.transport = ResolveTransport(o.layout.transport);
  const bool mpi = s.transport == "mpi";
  const comm::InProcessOptions inprocess = EmulationOf(o, mpi, &s.run.parallel);
  s.emulated = inprocess.emulation.has_value();
  s.launcher = MakeLauncher(s.transport, o.ranks, inprocess, "bench layer-parallel");
  if (s.emulated) s.free_launcher = MakeLauncher(s.transport, o.ranks, {}, "bench layer-parallel");
  s.per_rank_threads = o.threads > 0
                           ? o.threads
                           : ComputeThreadsPerRank(s.launcher->ranks_in_process(), UsableCores());
  s.mesh.emplace(parallel::ExpertMesh(p.mesh, s.config.num_experts, s.config.hidden_dim));
  s.t_global = o.global_tokens > 0 ? o.global_tokens : o.layer.tokens * s.mesh->data_shards();

  RequireMemory(
      EstimateMoeStepBytes(s.config, s.t_global, mpi ? 1.0 : static_cast<double>(o.ranks)),
      fmt::format("bench layer-parallel: {} tokens x model_dim {} on {} rank(s) ({} "
                  "experts of hidden_dim {}), estimated peak",
                  s.t_global, o.layer.model_dim, o.ranks, o.layer.experts, o.layer.hidden_dim));
  s.params = moe::InitParams(s.config, 1);
  if (s.config.expert_bias) {
    // A skewed gate: expert 0's choice score is raised by the bias (gate values unchanged).
    s.params.expert_bias = Tensor::Zeros({s.config.num_experts});
    s.params.expert_bias.data<float>()[0] = static_cast<float>(o.hot_expert_bias);
  }
  s.x = RandomTensor({s.t_global, o.layer.model_dim}, 2);
  s.dy = RandomTensor({s.t_global, o.layer.model_dim}, 3);
  s.reference = !o.no_reference && !mpi;
  s.cores = UsableCores();
  s.imbalance = o.layer.imbalance > 0;
  if (s.imbalance) {
    const int64_t k = moe::EffectiveTopK(s.config);
    s.uniform = s.run;
    s.run.forced_experts = ZipfRoutes(s.t_global, s.config.num_experts, k, o.layer.imbalance, 7);
    s.uniform.forced_experts = ZipfRoutes(s.t_global, s.config.num_experts, k, 0, 7);
  }

  s.plain = s.run;
  s.plain.parallel.overlap_degree = 1;
  s.plain.parallel.smart_group = parallel::kSmartOff;
  s.plain.parallel.shadow = parallel::ShadowOptions{};
  const bool shadows = p.shadow.policy != parallel::ShadowPolicy::kNone;
  const bool pipelined = p.overlap_degree > 1 || p.smart_group != parallel::kSmartOff;
  s.compare = (pipelined || shadows) && !o.no_baseline;
  s.with_free = s.compare && pipelined && s.free_launcher != nullptr;
  s.with_balanced = s.compare && s.config.expert_bias && shadows;
  s.balanced_params = s.params;
  if (s.with_balanced) s.balanced_params.expert_bias = Tensor::Zeros({s.config.num_experts});
  return s;
}

// What the interleaved rounds measured (on rank 0): per repetition the slowest rank's step of
// each run, and per round the figures derived from them.
struct ParallelSamples {
  std::vector<double> steps, plain_steps, free_steps, balanced_steps, single;
  std::vector<double> hidden, saved_of_plain, hidden_of_cost, removed_of_skew;
  std::vector<double> blocked, busy, plain_blocked;
  std::vector<double> uniform_steps;  // --imbalance: the run with uniform routes
  parallel::LayerRunResult last, uniform_last;
};

// One round's runs: the one asked for (`last`), and as the setup says, the plain path, the plain
// path over free links, the plain path with the gate not skewed.
struct RoundRuns {
  parallel::LayerRunResult base, free_run, balanced, uniform;
};

void RecordRound(const ParallelSetup& s, const RoundRuns& r, ParallelSamples* out) {
  const size_t first = out->steps.size(), plain_first = out->plain_steps.size();
  AppendSteps(out->last, &out->steps);
  const TokenComm tc = TokenCommOf(out->last);
  out->blocked.push_back(tc.blocked);
  out->busy.push_back(tc.busy);
  if (tc.busy > 0) out->hidden.push_back(1.0 - tc.blocked / tc.busy);
  const double v_ms = MedianFrom(out->steps, first);
  if (s.compare) {
    AppendSteps(r.base, &out->plain_steps);
    const TokenComm pc = TokenCommOf(r.base);
    out->plain_blocked.push_back(pc.blocked);
    const double dt = MedianFrom(out->plain_steps, plain_first) - v_ms;
    if (pc.blocked > 0) out->saved_of_plain.push_back(dt / pc.blocked);
  }
  const double p_ms = s.compare ? MedianFrom(out->plain_steps, plain_first) : 0;
  if (s.with_free) {
    const size_t free_first = out->free_steps.size();
    AppendSteps(r.free_run, &out->free_steps);
    const double f_ms = MedianFrom(out->free_steps, free_first);
    if (p_ms > f_ms) out->hidden_of_cost.push_back((p_ms - v_ms) / (p_ms - f_ms));
  }
  if (s.imbalance) {
    AppendSteps(r.uniform, &out->uniform_steps);
    out->uniform_last = r.uniform;
  }
  if (s.with_balanced) {
    const size_t b_first = out->balanced_steps.size();
    AppendSteps(r.balanced, &out->balanced_steps);
    const double b_ms = MedianFrom(out->balanced_steps, b_first);
    if (p_ms > b_ms) out->removed_of_skew.push_back((p_ms - v_ms) / (p_ms - b_ms));
  }
}

// The single-rank layer on the whole batch with all the cores: warm-up, then timed steps.
void TimeSingleRank(const BenchParallelOptions& o, const ParallelSetup& s,
                    std::vector<double>* single) {
  kernels::SetBlasThreads(s.cores);
  moe::MoeLayer layer(s.config);
  moe::ForwardOptions fo;
  fo.threads = s.cores;
  auto step = [&] {
    moe::LayerOutput out = layer.Forward(s.params, s.x, fo);
    layer.Backward(s.params, out, s.dy, s.cores);
  };
  const InterleavedTimes t = TimeInterleaved({step}, o.loop.warmup, o.loop.iters);
  single->insert(single->end(), t.wall[0].begin(), t.wall[0].end());
}

// Interleaved rounds: the parallel run, the plain path, then the single-rank layer on the same
// batch. Every MPI rank makes the same runs; rank 0 records.
ParallelSamples MeasureRounds(const BenchParallelOptions& o, ParallelSetup& s,
                              parallel::Tracer* tracer) {
  ParallelSamples out;
  const int rounds = std::max(1, o.rounds);
  for (int round = 0; round < rounds; ++round) {
    s.run.tracer = !o.layout.trace_path.empty() && round == rounds - 1 ? tracer : nullptr;
    kernels::SetBlasThreads(s.per_rank_threads);
    out.last = parallel::RunLayerOnRanks(*s.launcher, s.config, s.params, s.x, s.dy, s.run);
    RoundRuns r;
    if (s.compare) {
      r.base = parallel::RunLayerOnRanks(*s.launcher, s.config, s.params, s.x, s.dy, s.plain);
    }
    if (s.with_free) {
      r.free_run =
          parallel::RunLayerOnRanks(*s.free_launcher, s.config, s.params, s.x, s.dy, s.plain);
    }
    if (s.with_balanced) {
      r.balanced =
          parallel::RunLayerOnRanks(*s.launcher, s.config, s.balanced_params, s.x, s.dy, s.plain);
    }
    if (s.imbalance) {
      r.uniform = parallel::RunLayerOnRanks(*s.launcher, s.config, s.params, s.x, s.dy, s.uniform);
    }
    if (!out.last.is_root) continue;
    RecordRound(s, r, &out);
    if (s.reference) TimeSingleRank(o, s, &out.single);
  }
  return out;
}

// Per rank: the last step's traffic (forward + backward + sync), and the largest over the ranks.
struct RankTraffic {
  nlohmann::json per_rank = nlohmann::json::array();
  double max_bytes = 0, max_token_bytes = 0, max_weight_bytes = 0;
};
RankTraffic RankTrafficOf(const parallel::LayerRunResult& last) {
  using parallel::Traffic;
  RankTraffic t;
  for (const parallel::RankReport& r : last.ranks) {
    parallel::CommStats s = r.forward;
    s += r.backward;
    s += r.sync;
    const double weights = r.forward.Bytes(Traffic::kWeights) + r.backward.Bytes(Traffic::kWeights);
    t.max_bytes = std::max(t.max_bytes, s.TotalBytes());
    t.max_token_bytes = std::max(t.max_token_bytes, s.Bytes(Traffic::kTokens));
    t.max_weight_bytes = std::max(t.max_weight_bytes, weights);
    t.per_rank.push_back({{"rank", r.coords.rank},
                          {"tokens", r.tokens},
                          {"step_ms", Median(r.step_seconds) * 1e3},
                          {"comm_ms", s.comm_seconds * 1e3},
                          {"token_comm_blocked_ms", s.CommSeconds(Traffic::kTokens) * 1e3},
                          {"token_comm_busy_ms", s.BusySeconds(Traffic::kTokens) * 1e3},
                          {"compute_ms", s.compute_seconds() * 1e3},
                          {"collectives", s.collectives},
                          {"bytes_tokens", s.Bytes(Traffic::kTokens)},
                          {"bytes_routing", s.Bytes(Traffic::kRouting)},
                          {"bytes_weights_fwd_bwd", weights},
                          {"bytes_grad_sync", r.sync.Bytes(Traffic::kWeights)},
                          {"bytes_tp", s.Bytes(Traffic::kTensor)}});
  }
  return t;
}

// The figures of the report, from the samples.
struct ParallelFigures {
  TimingStats st, plain_st;
  std::optional<double> tokens_per_s, hidden, saved, hidden_of_cost, removed_of_skew, speedup;
  double single_s = 0;
  double busy_ms = 0, blocked_ms = 0;
  double predicted_bytes = 0;
  int group = 1;
  RankTraffic traffic;
};

ParallelFigures FiguresOf(const ParallelSetup& s, const ParallelSamples& m) {
  ParallelFigures f;
  f.st = SummarizeTimes(m.steps);
  f.plain_st = SummarizeTimes(m.plain_steps);
  f.tokens_per_s = Quotient(static_cast<double>(s.t_global), f.st.median_s);
  f.single_s = m.single.empty() ? 0 : Median(m.single);
  f.hidden = MedianIfAny(m.hidden);
  f.saved = MedianIfAny(m.saved_of_plain);
  f.hidden_of_cost = MedianIfAny(m.hidden_of_cost);
  f.removed_of_skew = MedianIfAny(m.removed_of_skew);
  f.speedup = s.compare ? Quotient(f.plain_st.median_s, f.st.median_s) : std::nullopt;
  f.busy_ms = (m.busy.empty() ? 0 : Median(m.busy)) * 1e3;
  f.blocked_ms = (m.blocked.empty() ? 0 : Median(m.blocked)) * 1e3;
  f.predicted_bytes = m.last.predicted_volume * 4;  // float32
  f.group = s.mesh->expert_group_size();
  f.traffic = RankTrafficOf(m.last);
  return f;
}

nlohmann::json ScheduleJson(const BenchParallelOptions& o, const ParallelSetup& s,
                            const ParallelSamples& m, const ParallelFigures& f) {
  const parallel::LayerRunResult& last = m.last;
  nlohmann::json schedule = {{"overlap_degree", last.overlap_degree},
                             {"smart_group", last.smart_group},
                             {"shadow", o.layout.shadow},
                             {"shadowed", last.shadowed},
                             {"hot_expert_bias", o.hot_expert_bias},
                             {"token_comm_busy_ms", f.busy_ms},
                             {"token_comm_blocked_ms", f.blocked_ms},
                             {"hidden_fraction", JsonOf(f.hidden)},
                             {"cost_model",
                              {{"link_gbps", last.cost_model.link_gbps},
                               {"link_latency_us", last.cost_model.link_latency_us},
                               {"gemm_gflops", last.cost_model.gemm_gflops}}}};
  if (s.with_free) {
    schedule["free_links_step_median_ms"] = SummarizeTimes(m.free_steps).median_s * 1e3;
    schedule["hidden_of_comm_cost"] = JsonOf(f.hidden_of_cost);
  }
  if (s.with_balanced) {
    schedule["unskewed_plain_step_median_ms"] = SummarizeTimes(m.balanced_steps).median_s * 1e3;
    schedule["removed_of_skew_cost"] = JsonOf(f.removed_of_skew);
  }
  if (s.compare) {
    schedule["plain_step_median_ms"] = f.plain_st.median_s * 1e3;
    schedule["speedup_over_plain"] = JsonOf(f.speedup);
    schedule["plain_token_comm_blocked_ms"] = Median(m.plain_blocked) * 1e3;
    schedule["saved_of_plain_token_comm"] = JsonOf(f.saved);
  }
  return schedule;
}

// Whether the run's exchange sends a token once per destination rank: the rule of the exchange
// dispatcher (ExchangeDispatcher::UsesDedup, src/parallel/dispatcher_exchange.cc) for a layout
// without shadow experts.
bool PerRankDispatch(const ParallelSetup& s) {
  const parallel::ParallelOptions& p = s.run.parallel;
  return p.dispatch == parallel::DispatchKind::kAllToAllV && p.dispatch_dedup &&
         s.mesh->shards() == 1 && s.mesh->expert_group_size() > 1 && p.overlap_degree == 1 &&
         p.smart_group == parallel::kSmartOff && p.shadow.policy == parallel::ShadowPolicy::kNone;
}

// The routing's token all-to-all of one run (tp 1): the pairs that leave their rank, the distinct
// other ranks per token, and the busiest rank's token bytes measured against the formula of
// RouteVolume for the dispatch the run used (exact for alltoallv without drops), and both
// formulas.
nlohmann::json RouteVolumeJson(const ParallelSetup& s, const parallel::LayerRunResult& run) {
  const Tensor& topk = run.output.topk_idx;
  if (!topk.defined() || topk.dim() != 2 || s.mesh->tp() != 1) return nullptr;
  const RouteVolume v = RouteVolumeOf(
      std::span<const int32_t>(topk.data<int32_t>(), static_cast<size_t>(topk.numel())),
      topk.size(1), run, parallel::EvenSplit(s.t_global, s.mesh->data_shards()),
      parallel::LocalExperts(*s.mesh, s.config.num_experts), s.config.model_dim);
  double measured = 0, predicted = 0, predicted_dedup = 0, slowest = 0;
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    const parallel::RankReport& rep = run.ranks[r];
    measured = std::max(measured, rep.forward.Bytes(parallel::Traffic::kTokens) +
                                      rep.backward.Bytes(parallel::Traffic::kTokens));
    predicted = std::max(predicted, v.predicted_bytes[r]);
    predicted_dedup = std::max(predicted_dedup, v.predicted_dedup_bytes[r]);
    slowest = std::max(slowest, Median(rep.step_seconds));
  }
  return {{"pairs", v.pairs},
          {"pairs_off_rank", v.pairs_off},
          {"off_rank_share", v.off_share},
          {"distinct_other_ranks_per_token", v.distinct_off_ranks},
          {"max_rank_token_bytes", measured},
          {"per_rank_dispatch", PerRankDispatch(s)},
          {"max_rank_token_bytes_formula", PerRankDispatch(s) ? predicted_dedup : predicted},
          {"max_rank_token_bytes_formula_per_pair", predicted},
          {"max_rank_token_bytes_formula_per_rank", predicted_dedup},
          {"slowest_rank_step_ms", slowest * 1e3}};
}

nlohmann::json RoutingJson(const BenchParallelOptions& o, const ParallelSetup& s,
                           const ParallelSamples& m) {
  nlohmann::json j = {{"num_groups", s.config.num_groups},
                      {"group_topk", s.config.group_topk},
                      {"imbalance", o.layer.imbalance},
                      {"volume", RouteVolumeJson(s, m.last)}};
  if (s.imbalance) {
    j["step_median_ms"] = SummarizeTimes(m.steps).median_s * 1e3;
    j["uniform_step_median_ms"] = SummarizeTimes(m.uniform_steps).median_s * 1e3;
    j["uniform_volume"] = RouteVolumeJson(s, m.uniform_last);
  }
  return j;
}

void PrintRouting(const nlohmann::json& j) {
  auto line = [](const char* what, const nlohmann::json& v) {
    if (v.is_null()) return;
    fmt::print(
        "  {}: {} of {} (token, choice) pairs leave their rank ({:.1f}%), {:.2f} other ranks "
        "per token; busiest rank's token all-to-all {:.3f} MB (formula 2 (out + in) M 4 {:.3f} "
        "MB; one row per pair {:.3f} MB, per (token, rank) {:.3f} MB)\n",
        what, v["pairs_off_rank"].get<int64_t>(), v["pairs"].get<int64_t>(),
        100 * v["off_rank_share"].get<double>(), v["distinct_other_ranks_per_token"].get<double>(),
        v["max_rank_token_bytes"].get<double>() / 1e6,
        v["max_rank_token_bytes_formula"].get<double>() / 1e6,
        v["max_rank_token_bytes_formula_per_pair"].get<double>() / 1e6,
        v["max_rank_token_bytes_formula_per_rank"].get<double>() / 1e6);
  };
  line(j["imbalance"].get<double>() > 0
           ? fmt::format("routes Zipf({})", j["imbalance"].get<double>()).c_str()
           : "routing",
       j["volume"]);
  if (!j.contains("uniform_volume")) return;
  line("routes uniform", j["uniform_volume"]);
  fmt::print(
      "  imbalance: step {:.2f} ms (slowest rank, median) against {:.2f} ms with uniform "
      "routes ({:.2f}x)\n",
      j["step_median_ms"].get<double>(), j["uniform_step_median_ms"].get<double>(),
      j["step_median_ms"].get<double>() / j["uniform_step_median_ms"].get<double>());
}

void PrintParallelJson(const BenchParallelOptions& o, const ParallelSetup& s,
                       const ParallelSamples& m, const ParallelFigures& f) {
  const MoeLayerFlags& l = o.layer;
  nlohmann::json emulation = nullptr;
  if (o.links.ranks_per_node > 0) {
    emulation = {{"ranks_per_node", o.links.ranks_per_node},
                 {"intra_gbps", o.links.intra_gbps},
                 {"intra_latency_us", o.links.intra_latency_us},
                 {"inter_gbps", o.links.inter_gbps},
                 {"inter_latency_us", o.links.inter_latency_us}};
  }
  PrintJsonLine({{"op", "layer-parallel"},
                 {"ranks", o.ranks},
                 {"arrangement", o.layout.arrangement},
                 {"tp", o.layout.tp},
                 {"ep", s.mesh->ep()},
                 {"etp", o.layout.etp},
                 {"expert_group", f.group},
                 {"dispatch", o.layout.dispatch},
                 {"adaptive_r", m.last.adaptive_r},
                 {"2dh", o.layout.hierarchical},
                 {"scope", o.layout.scope},
                 {"transport", s.transport},
                 {"global_tokens", s.t_global},
                 {"model_dim", l.model_dim},
                 {"hidden_dim", l.hidden_dim},
                 {"experts", l.experts},
                 {"top_k", l.top_k},
                 {"capacity_factor", l.capacity_factor},
                 {"dropless", l.dropless},
                 {"capacity", m.last.output.capacity},
                 {"wire_capacity", m.last.buffer_capacity},
                 {"step_median_ms", f.st.median_s * 1e3},
                 {"step_min_ms", f.st.min_s * 1e3},
                 {"tokens_per_s", JsonOf(f.tokens_per_s)},
                 {"single_rank_ms", f.single_s * 1e3},
                 {"single_rank_threads", s.cores},
                 {"ratio_to_single_rank", JsonOf(Quotient(f.st.median_s, f.single_s))},
                 {"predicted_volume_bytes", f.predicted_bytes},
                 {"max_rank_bytes", f.traffic.max_bytes},
                 {"max_rank_token_bytes", f.traffic.max_token_bytes},
                 {"max_rank_weight_bytes", f.traffic.max_weight_bytes},
                 {"schedule", ScheduleJson(o, s, m, f)},
                 {"routing", RoutingJson(o, s, m)},
                 {"emulation", emulation},
                 {"per_rank", f.traffic.per_rank}});
}

// The layout, the batch, the step and the single-rank limit.
void PrintParallelHeader(const BenchParallelOptions& o, const ParallelSetup& s,
                         const ParallelSamples& m, const ParallelFigures& f) {
  const MoeLayerFlags& l = o.layer;
  const parallel::Mesh& mesh = *s.mesh;
  fmt::print(
      "layer-parallel: {} ranks ({}), {} tp {} ep {} etp {}: expert group {} ({} experts/rank{}), "
      "dispatch {}, r {}{}, scope {}\n",
      o.ranks, s.transport, o.layout.arrangement, o.layout.tp, mesh.ep(), o.layout.etp, f.group,
      parallel::LocalExperts(mesh, s.config.num_experts),
      mesh.shards() > 1 ? fmt::format(", H split {}", mesh.shards()) : std::string(),
      o.layout.dispatch, m.last.adaptive_r,
      o.layout.hierarchical ? fmt::format(", 2DH {} ranks/node", o.layout.hierarchical) : "",
      o.layout.scope);
  fmt::print("  batch {} tokens ({} data shards), M {}, H {}, E {}, k {}, {}\n", s.t_global,
             mesh.data_shards(), l.model_dim, l.hidden_dim, l.experts, l.top_k,
             l.dropless
                 ? std::string("dropless")
                 : fmt::format("cf {} -> capacity {}, {} rows/expert/source on the wire",
                               l.capacity_factor, m.last.output.capacity, m.last.buffer_capacity));
  fmt::print(
      "  step (fwd+bwd+grad sync): median {:.1f} ms, best {:.1f} ms over {} -> {} tokens/s\n",
      f.st.median_s * 1e3, f.st.min_s * 1e3, f.st.repeat,
      f.tokens_per_s ? fmt::format("{:.0f}", *f.tokens_per_s) : std::string("-"));
  if (f.single_s > 0) {
    fmt::print(
        "  limit: single-rank layer, same {} tokens, {} thread(s), interleaved: {:.1f} ms "
        "-> parallel/single = {:.2f}\n",
        s.t_global, s.cores, f.single_s * 1e3, f.st.median_s / f.single_s);
  }
  if (o.links.ranks_per_node > 0) {
    fmt::print(
        "  emulated links: nodes of {} rank(s); intra-node {} GB/s + {} us, inter-node {} GB/s + "
        "{} us per message\n",
        o.links.ranks_per_node, o.links.intra_gbps, o.links.intra_latency_us, o.links.inter_gbps,
        o.links.inter_latency_us);
  }
}

// The schedule, its token all-to-alls, and the plain path and limits it is compared with.
void PrintParallelSchedule(const BenchParallelOptions& o, const ParallelSetup& s,
                           const ParallelSamples& m, const ParallelFigures& f) {
  const parallel::CostModel& cm = m.last.cost_model;
  const std::string shadowed =
      m.last.shadowed.empty() ? "none" : fmt::format("{}", fmt::join(m.last.shadowed, ","));
  fmt::print(
      "  schedule: overlap degree {}, smart schedule {}, shadowed experts {}{}{}\n",
      m.last.overlap_degree,
      m.last.smart_group > 0 ? fmt::format("g = {}", m.last.smart_group) : std::string("off"),
      shadowed,
      o.hot_expert_bias > 0 ? fmt::format(" (skewed gate: expert 0 bias {})", o.hot_expert_bias)
                            : std::string(),
      cm.gemm_gflops > 0 ? fmt::format("; cost model {:.3g} GB/s + {:.3g} us, {:.3g} GFLOP/s",
                                       cm.link_gbps, cm.link_latency_us, cm.gemm_gflops)
                         : std::string());
  fmt::print(
      "  token all-to-alls (fwd+bwd, mean over ranks): ran {:.1f} ms, blocked {:.1f} ms -> {} "
      "hidden behind compute{}\n",
      f.busy_ms, f.blocked_ms, Percent(f.hidden), f.hidden ? "" : " (-: no token all-to-all ran)");
  const double plain = f.plain_st.median_s;
  if (s.compare) {
    fmt::print(
        "  plain path (D 1, no smart schedule, no shadows), interleaved: median {:.1f} ms, token "
        "all-to-alls blocked {:.1f} ms -> speedup {}x, step saved = {} of the plain "
        "path's token communication\n",
        plain * 1e3, Median(m.plain_blocked) * 1e3, Fixed2(f.speedup), Percent(f.saved));
  }
  if (s.with_free) {
    const double fs = SummarizeTimes(m.free_steps).median_s;
    fmt::print(
        "  limit: plain path over free links (no emulated cost), interleaved: median {:.1f} ms -> "
        "communication costs the plain path {:.1f} ms ({}x the free step); this schedule "
        "hides {} of it (median over rounds of (plain - this) / (plain - free))\n",
        fs * 1e3, (plain - fs) * 1e3, Fixed2(Quotient(plain - fs, fs)), Percent(f.hidden_of_cost));
  }
  if (s.with_balanced) {
    const double b = SummarizeTimes(m.balanced_steps).median_s;
    fmt::print(
        "  limit: plain path with the gate not skewed, interleaved: median {:.1f} ms -> the skew "
        "costs the plain path {:.1f} ms; shadowing removes {} of it (median over rounds of "
        "(plain - this) / (plain - unskewed))\n",
        b * 1e3, (plain - b) * 1e3, Percent(f.removed_of_skew));
  }
}

void PrintPerRank(const nlohmann::json& per_rank) {
  fmt::print(
      "  per rank (last step): tokens  step ms  comm ms  compute ms  a2a ran  a2a blocked  MB "
      "tokens  MB routing  MB weights  MB grad-sync  MB tp\n");
  for (const auto& r : per_rank) {
    fmt::print(
        "    {:4d} {:8d} {:8.1f} {:8.1f} {:11.1f} {:8.1f} {:12.1f} {:9.2f} {:11.3f} {:11.2f} "
        "{:13.2f} {:6.2f}\n",
        r["rank"].get<int>(), r["tokens"].get<int64_t>(), r["step_ms"].get<double>(),
        r["comm_ms"].get<double>(), r["compute_ms"].get<double>(),
        r["token_comm_busy_ms"].get<double>(), r["token_comm_blocked_ms"].get<double>(),
        r["bytes_tokens"].get<double>() / 1e6, r["bytes_routing"].get<double>() / 1e6,
        r["bytes_weights_fwd_bwd"].get<double>() / 1e6, r["bytes_grad_sync"].get<double>() / 1e6,
        r["bytes_tp"].get<double>() / 1e6);
  }
}

// The volume model's two terms: tokens 4 C_g r (all-to-alls there and back, forward and backward)
// and weights 2 P / (E r) (r = 0: 2 P). On the wire a rank sends (P - 1) / P of its token volume.
void PrintVolumeModel(const MoeLayerFlags& l, int r, const ParallelFigures& f) {
  const double p_elems = static_cast<double>(l.experts) *
                         (static_cast<double>(l.hidden_dim * l.model_dim) * (l.gated ? 3.0 : 2.0) +
                          static_cast<double>(l.hidden_dim + l.model_dim));
  const double weight_term =
      (r == 0 ? 2.0 * p_elems : 2.0 * p_elems / (static_cast<double>(l.experts) * r)) * 4;
  const double token_term = f.predicted_bytes - weight_term;
  fmt::print(
      "  volume model for r = {}: {:.2f} MB per rank per step = tokens 4 C_g r {:.2f} MB (x "
      "(P-1)/P "
      "= {:.2f} MB; measured {:.2f} MB) + weights {} {:.2f} MB (measured {:.2f} MB)\n",
      r, f.predicted_bytes / 1e6, token_term / 1e6,
      token_term * (f.group - 1) / std::max(1, f.group) / 1e6, f.traffic.max_token_bytes / 1e6,
      r == 0 ? "2P" : "2P/(E r)", weight_term / 1e6, f.traffic.max_weight_bytes / 1e6);
}

}  // namespace

int RunBenchParallel(const BenchParallelOptions& o) {
  ParallelSetup s = MakeParallelSetup(o);
  parallel::Tracer tracer;
  const ParallelSamples m = MeasureRounds(o, s, &tracer);
  if (!m.last.is_root) return 0;
  if (!o.layout.trace_path.empty()) tracer.WriteJson(o.layout.trace_path);
  const ParallelFigures f = FiguresOf(s, m);
  if (o.loop.json) {
    PrintParallelJson(o, s, m, f);
    return 0;
  }
  PrintParallelHeader(o, s, m, f);
  PrintParallelSchedule(o, s, m, f);
  PrintPerRank(f.traffic.per_rank);
  PrintVolumeModel(o.layer, m.last.adaptive_r, f);
  PrintRouting(RoutingJson(o, s, m));
  return 0;
}

void AddParallelBenchOptions(CLI::App& app, BenchParallelOptions* o) {
  AddIntOption(app, "--global-tokens", &o->global_tokens, int64_t{0}, int64_t{1} << 40,
               "tokens of the whole batch instead");
  AddIntOption(app, "--ranks", &o->ranks, 1, 4096, "W");
  AddMoeLayoutFlags(app, &o->layout,
                    "write the last round's timeline as a Chrome trace-event JSON file");
  AddIntOption(app, "--rounds", &o->rounds, 1, 1000,
               "interleaved rounds (parallel, plain path, single-rank)");
  app.add_flag("--no-reference", o->no_reference, "skip the single-rank limit");
  app.add_flag("--no-baseline", o->no_baseline,
               "with a schedule: skip the plain path (D 1, no smart schedule, no shadows)");
  app.add_option("--imbalance", o->layer.imbalance,
                 "SKEW: force Zipf routes (expert e chosen with weight (e + 1)^-SKEW) and compare "
                 "the step and the token all-to-all with uniform routes (0: the gate routes)")
      ->check(FiniteIn(0, 100));
  app.add_option("--hot-expert-bias", o->hot_expert_bias,
                 "skewed gate: add this to expert 0's choice score (e.g. 0.1; 0: off)")
      ->check(FiniteIn(0, 1e6));
  AddIntOption(app, "--emulate-ranks-per-node", &o->links.ranks_per_node, 0, 4096,
               "in-process: emulate nodes of this many ranks (alpha-beta link costs)");
  AddEmulationLinkOptions(app, &o->links.intra_latency_us, &o->links.intra_gbps,
                          &o->links.inter_latency_us, &o->links.inter_gbps);
}

namespace {

SY_REGISTER_COMMAND(Command{
    "bench", "layer-parallel",
    "One MoE layer on W ranks: step time, tokens/s, comm vs compute and bytes per rank, overlap "
    "schedules against the plain path",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchParallelOptions>();
      AddMoeLayerFlags(app, &o->layer, {.tokens_help = "tokens per data shard (default 4096)"});
      AddIntOption(app, "--threads", &o->threads, 0, 256,
                   "compute threads per rank (0: cores / ranks)");
      AddBenchLoopFlags(app, &o->loop, kParallelLoopFlags);
      AddParallelBenchOptions(app, o.get());
      return [o] { return RunBenchParallel(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
