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
#include "switchyard/parallel/schedule.h"
#include "switchyard/parallel/trace.h"

namespace switchyard::cli {
namespace {

double Median(std::vector<double> v) { return SummarizeTimes(std::move(v)).median_s; }

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

int RunBenchParallel(const BenchParallelOptions& o) {
  moe::LayerConfig config;
  config.model_dim = o.model_dim;
  config.hidden_dim = o.hidden_dim;
  config.num_experts = o.experts;
  config.top_k = o.top_k;
  config.capacity_factor = o.capacity_factor;
  config.dropless = o.dropless;
  config.activation = kernels::ActivationFromName(o.activation);
  config.gated = o.gated;
  config.expert_bias = o.hot_expert_bias > 0;
  moe::ValidateConfig(config);

  parallel::DriverOptions d;
  parallel::ParallelOptions& p = d.parallel;
  p.mesh.world_size = o.ranks;
  p.mesh.tp = o.tp;
  p.mesh.ep = o.ep;
  p.mesh.etp = o.etp;
  p.mesh.arrangement = parallel::ArrangementFromName(o.arrangement);
  p.dispatch = parallel::DispatchKindFromName(o.dispatch);
  p.adaptive_r = parallel::AdaptiveRFromString(o.adaptive_r);
  p.hierarchical_ranks_per_node = o.hierarchical;
  p.tp_dedup = !o.no_tp_dedup;
  p.batch_scope = parallel::BatchScopeFromName(o.scope);
  p.overlap_degree = o.overlap_degree;
  p.smart_group = parallel::SmartGroupFromString(o.smart);
  p.shadow = parallel::ShadowFromString(o.shadow);
  const std::string transport = ResolveTransport(o.transport);
  const bool mpi = transport == "mpi";
  d.threads = o.threads;
  d.repeat = o.repeat;
  d.warmup = o.warmup;
  comm::InProcessOptions inprocess;
  if (o.emulate_per_node > 0) {
    SY_REQUIRE(!mpi, InvalidArgument,
               "--emulate-ranks-per-node applies to the in-process transport");
    inprocess.ranks_per_node = o.emulate_per_node;
    inprocess.emulation = comm::EmulationOptions{{o.intra_latency_us, o.intra_gbps},
                                                 {o.inter_latency_us, o.inter_gbps}};
    RequireEmulationFitsDeadline(*inprocess.emulation, inprocess.timeout, "", 0);
    // The schedules' cost model assumes the emulated link unless given one.
    const std::optional<comm::LinkModel> link = comm::EmulatedLink(inprocess, o.ranks);
    if (link && p.cost_model.link_gbps <= 0) {
      p.cost_model.link_gbps = link->bandwidth_gbps;
      p.cost_model.link_latency_us = link->latency_us;
    }
  }
  std::unique_ptr<comm::Launcher> launcher =
      MakeLauncher(transport, o.ranks, inprocess, "bench layer-parallel");
  // With emulated links: the same ranks over free links too (see free_links below).
  std::unique_ptr<comm::Launcher> free_launcher =
      inprocess.emulation ? MakeLauncher(transport, o.ranks, {}, "bench layer-parallel") : nullptr;
  const int per_rank_threads =
      o.threads > 0 ? o.threads
                    : ComputeThreadsPerRank(launcher->ranks_in_process(), UsableCores());
  const parallel::Mesh mesh(p.mesh, config.num_experts, config.hidden_dim);
  const int64_t t_global = o.global_tokens > 0 ? o.global_tokens : o.tokens * mesh.data_shards();

  RequireMemory(EstimateMoeStepBytes(config, t_global, mpi ? 1.0 : static_cast<double>(o.ranks)),
                fmt::format("bench layer-parallel: {} tokens x model_dim {} on {} rank(s) ({} "
                            "experts of hidden_dim {}), estimated peak",
                            t_global, o.model_dim, o.ranks, o.experts, o.hidden_dim));
  moe::LayerParams params = moe::InitParams(config, 1);
  if (config.expert_bias) {
    // A skewed gate: expert 0's choice score is raised by the bias (gate values unchanged).
    params.expert_bias = Tensor::Zeros({config.num_experts});
    params.expert_bias.data<float>()[0] = static_cast<float>(o.hot_expert_bias);
  }
  const Tensor x = RandomTensor({t_global, o.model_dim}, 2);
  const Tensor dy = RandomTensor({t_global, o.model_dim}, 3);
  const bool reference = !o.no_reference && !mpi;
  const int cores = UsableCores();

  // The plain path the schedules are measured against.
  parallel::DriverOptions plain = d;
  plain.parallel.overlap_degree = 1;
  plain.parallel.smart_group = parallel::kSmartOff;
  plain.parallel.shadow = parallel::ShadowOptions{};
  const bool scheduled = p.overlap_degree > 1 || p.smart_group != parallel::kSmartOff ||
                         p.shadow.policy != parallel::ShadowPolicy::kNone;
  const bool compare = scheduled && !o.no_baseline;
  // With emulated links, the plain path over free links (no emulated cost) too: the step without
  // communication cost, so that (plain - free) is what communication costs the plain path.
  const parallel::DriverOptions& free_links = plain;
  const bool pipelined = p.overlap_degree > 1 || p.smart_group != parallel::kSmartOff;
  const bool with_free = compare && pipelined && free_launcher != nullptr;
  // With a skewed gate and shadows, the plain path with the gate not skewed too: the step without
  // the hot expert's imbalance, so that (plain - balanced) is what the skew costs the plain path.
  const bool with_balanced =
      compare && config.expert_bias && p.shadow.policy != parallel::ShadowPolicy::kNone;
  moe::LayerParams balanced_params = params;
  if (with_balanced) balanced_params.expert_bias = Tensor::Zeros({config.num_experts});
  parallel::Tracer tracer;

  // Interleaved rounds: the parallel run, the plain path, then the single-rank layer on the same
  // batch. Every MPI rank makes the same runs; rank 0 reports.
  std::vector<double> steps, plain_steps, free_steps, balanced_steps, single, hidden,
      saved_of_plain, hidden_of_cost, removed_of_skew;
  std::vector<double> blocked, busy, plain_blocked;
  parallel::LayerRunResult last;
  const int rounds = std::max(1, o.rounds);
  for (int round = 0; round < rounds; ++round) {
    d.tracer = !o.trace_path.empty() && round == rounds - 1 ? &tracer : nullptr;
    kernels::SetBlasThreads(per_rank_threads);
    last = parallel::RunLayerOnRanks(*launcher, config, params, x, dy, d);
    parallel::LayerRunResult base, free_run;
    if (compare) base = parallel::RunLayerOnRanks(*launcher, config, params, x, dy, plain);
    if (with_free) {
      free_run = parallel::RunLayerOnRanks(*free_launcher, config, params, x, dy, free_links);
    }
    parallel::LayerRunResult balanced;
    if (with_balanced) {
      balanced = parallel::RunLayerOnRanks(*launcher, config, balanced_params, x, dy, plain);
    }
    if (!last.is_root) continue;
    const size_t first = steps.size(), plain_first = plain_steps.size();
    AppendSteps(last, &steps);
    const TokenComm tc = TokenCommOf(last);
    blocked.push_back(tc.blocked);
    busy.push_back(tc.busy);
    if (tc.busy > 0) hidden.push_back(1.0 - tc.blocked / tc.busy);
    if (compare) {
      AppendSteps(base, &plain_steps);
      const TokenComm pc = TokenCommOf(base);
      plain_blocked.push_back(pc.blocked);
      const double dt = Median({plain_steps.begin() + static_cast<std::ptrdiff_t>(plain_first),
                                plain_steps.end()}) -
                        Median({steps.begin() + static_cast<std::ptrdiff_t>(first), steps.end()});
      if (pc.blocked > 0) saved_of_plain.push_back(dt / pc.blocked);
    }
    if (with_free) {
      const size_t free_first = free_steps.size();
      AppendSteps(free_run, &free_steps);
      const double p_ms = Median(
          {plain_steps.begin() + static_cast<std::ptrdiff_t>(plain_first), plain_steps.end()});
      const double f_ms =
          Median({free_steps.begin() + static_cast<std::ptrdiff_t>(free_first), free_steps.end()});
      const double v_ms = Median({steps.begin() + static_cast<std::ptrdiff_t>(first), steps.end()});
      if (p_ms > f_ms) hidden_of_cost.push_back((p_ms - v_ms) / (p_ms - f_ms));
    }
    if (with_balanced) {
      const size_t b_first = balanced_steps.size();
      AppendSteps(balanced, &balanced_steps);
      const double p_ms = Median(
          {plain_steps.begin() + static_cast<std::ptrdiff_t>(plain_first), plain_steps.end()});
      const double b_ms = Median(
          {balanced_steps.begin() + static_cast<std::ptrdiff_t>(b_first), balanced_steps.end()});
      const double v_ms = Median({steps.begin() + static_cast<std::ptrdiff_t>(first), steps.end()});
      if (p_ms > b_ms) removed_of_skew.push_back((p_ms - v_ms) / (p_ms - b_ms));
    }
    if (reference) {
      kernels::SetBlasThreads(cores);
      moe::MoeLayer layer(config);
      moe::ForwardOptions fo;
      fo.threads = cores;
      auto step = [&] {
        moe::LayerOutput out = layer.Forward(params, x, fo);
        layer.Backward(params, out, dy, cores);
      };
      for (int i = 0; i < o.warmup; ++i) step();
      for (int i = 0; i < o.repeat; ++i) {
        double t0 = NowSeconds();
        step();
        single.push_back(NowSeconds() - t0);
      }
    }
  }
  if (!last.is_root) return 0;
  if (!o.trace_path.empty()) tracer.WriteJson(o.trace_path);

  const TimingStats st = SummarizeTimes(steps);
  const std::optional<double> tokens_per_s = Quotient(static_cast<double>(t_global), st.median_s);
  const double single_s = single.empty() ? 0 : Median(single);
  const double bytes_per_float = 4;
  // Per rank: the last step's traffic (forward + backward + sync).
  nlohmann::json ranks = nlohmann::json::array();
  double max_bytes = 0, max_token_bytes = 0, max_weight_bytes = 0;
  for (const parallel::RankReport& r : last.ranks) {
    parallel::CommStats s = r.forward;
    s += r.backward;
    s += r.sync;
    max_bytes = std::max(max_bytes, s.TotalBytes());
    max_token_bytes = std::max(max_token_bytes, s.Bytes(parallel::Traffic::kTokens));
    max_weight_bytes =
        std::max(max_weight_bytes, r.forward.Bytes(parallel::Traffic::kWeights) +
                                       r.backward.Bytes(parallel::Traffic::kWeights));
    ranks.push_back({{"rank", r.coords.rank},
                     {"tokens", r.tokens},
                     {"step_ms", Median(r.step_seconds) * 1e3},
                     {"comm_ms", s.comm_seconds * 1e3},
                     {"token_comm_blocked_ms", s.CommSeconds(parallel::Traffic::kTokens) * 1e3},
                     {"token_comm_busy_ms", s.BusySeconds(parallel::Traffic::kTokens) * 1e3},
                     {"compute_ms", s.compute_seconds() * 1e3},
                     {"collectives", s.collectives},
                     {"bytes_tokens", s.Bytes(parallel::Traffic::kTokens)},
                     {"bytes_routing", s.Bytes(parallel::Traffic::kRouting)},
                     {"bytes_weights_fwd_bwd", r.forward.Bytes(parallel::Traffic::kWeights) +
                                                   r.backward.Bytes(parallel::Traffic::kWeights)},
                     {"bytes_grad_sync", r.sync.Bytes(parallel::Traffic::kWeights)},
                     {"bytes_tp", s.Bytes(parallel::Traffic::kTensor)}});
  }
  const double predicted_bytes = last.predicted_volume * bytes_per_float;
  const int group = mesh.expert_group_size();
  const TimingStats plain_st = SummarizeTimes(plain_steps);
  const std::optional<double> hidden_median = MedianIfAny(hidden);
  const std::optional<double> saved_median = MedianIfAny(saved_of_plain);
  const std::optional<double> hidden_of_cost_median = MedianIfAny(hidden_of_cost);
  const std::optional<double> removed_of_skew_median = MedianIfAny(removed_of_skew);
  const std::optional<double> speedup =
      compare ? Quotient(plain_st.median_s, st.median_s) : std::nullopt;
  const std::string shadowed =
      last.shadowed.empty() ? "none" : fmt::format("{}", fmt::join(last.shadowed, ","));
  nlohmann::json schedule = {
      {"overlap_degree", last.overlap_degree},
      {"smart_group", last.smart_group},
      {"shadow", o.shadow},
      {"shadowed", last.shadowed},
      {"hot_expert_bias", o.hot_expert_bias},
      {"token_comm_busy_ms", (busy.empty() ? 0 : Median(busy)) * 1e3},
      {"token_comm_blocked_ms", (blocked.empty() ? 0 : Median(blocked)) * 1e3},
      {"hidden_fraction", JsonOf(hidden_median)},
      {"cost_model",
       {{"link_gbps", last.cost_model.link_gbps},
        {"link_latency_us", last.cost_model.link_latency_us},
        {"gemm_gflops", last.cost_model.gemm_gflops}}}};
  if (with_free) {
    schedule["free_links_step_median_ms"] = SummarizeTimes(free_steps).median_s * 1e3;
    schedule["hidden_of_comm_cost"] = JsonOf(hidden_of_cost_median);
  }
  if (with_balanced) {
    schedule["unskewed_plain_step_median_ms"] = SummarizeTimes(balanced_steps).median_s * 1e3;
    schedule["removed_of_skew_cost"] = JsonOf(removed_of_skew_median);
  }
  if (compare) {
    schedule["plain_step_median_ms"] = plain_st.median_s * 1e3;
    schedule["speedup_over_plain"] = JsonOf(speedup);
    schedule["plain_token_comm_blocked_ms"] = Median(plain_blocked) * 1e3;
    schedule["saved_of_plain_token_comm"] = JsonOf(saved_median);
  }
  nlohmann::json emulation = nullptr;
  if (o.emulate_per_node > 0) {
    emulation = {{"ranks_per_node", o.emulate_per_node},
                 {"intra_gbps", o.intra_gbps},
                 {"intra_latency_us", o.intra_latency_us},
                 {"inter_gbps", o.inter_gbps},
                 {"inter_latency_us", o.inter_latency_us}};
  }
  if (o.json) {
    nlohmann::json j = {{"op", "layer-parallel"},
                        {"ranks", o.ranks},
                        {"arrangement", o.arrangement},
                        {"tp", o.tp},
                        {"ep", mesh.ep()},
                        {"etp", o.etp},
                        {"expert_group", group},
                        {"dispatch", o.dispatch},
                        {"adaptive_r", last.adaptive_r},
                        {"2dh", o.hierarchical},
                        {"scope", o.scope},
                        {"transport", transport},
                        {"global_tokens", t_global},
                        {"model_dim", o.model_dim},
                        {"hidden_dim", o.hidden_dim},
                        {"experts", o.experts},
                        {"top_k", o.top_k},
                        {"capacity_factor", o.capacity_factor},
                        {"dropless", o.dropless},
                        {"capacity", last.output.capacity},
                        {"wire_capacity", last.buffer_capacity},
                        {"step_median_ms", st.median_s * 1e3},
                        {"step_min_ms", st.min_s * 1e3},
                        {"tokens_per_s", JsonOf(tokens_per_s)},
                        {"single_rank_ms", single_s * 1e3},
                        {"single_rank_threads", cores},
                        {"ratio_to_single_rank", JsonOf(Quotient(st.median_s, single_s))},
                        {"predicted_volume_bytes", predicted_bytes},
                        {"max_rank_bytes", max_bytes},
                        {"max_rank_token_bytes", max_token_bytes},
                        {"max_rank_weight_bytes", max_weight_bytes},
                        {"schedule", schedule},
                        {"emulation", emulation},
                        {"per_rank", ranks}};
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "layer-parallel: {} ranks ({}), {} tp {} ep {} etp {}: expert group {} ({} experts/rank{}), "
      "dispatch {}, r {}{}, scope {}\n",
      o.ranks, transport, o.arrangement, o.tp, mesh.ep(), o.etp, group, mesh.local_experts(),
      mesh.shards() > 1 ? fmt::format(", H split {}", mesh.shards()) : std::string(), o.dispatch,
      last.adaptive_r, o.hierarchical ? fmt::format(", 2DH {} ranks/node", o.hierarchical) : "",
      o.scope);
  fmt::print("  batch {} tokens ({} data shards), M {}, H {}, E {}, k {}, {}\n", t_global,
             mesh.data_shards(), o.model_dim, o.hidden_dim, o.experts, o.top_k,
             o.dropless
                 ? std::string("dropless")
                 : fmt::format("cf {} -> capacity {}, {} rows/expert/source on the wire",
                               o.capacity_factor, last.output.capacity, last.buffer_capacity));
  fmt::print(
      "  step (fwd+bwd+grad sync): median {:.1f} ms, best {:.1f} ms over {} -> {} tokens/s\n",
      st.median_s * 1e3, st.min_s * 1e3, st.repeat,
      tokens_per_s ? fmt::format("{:.0f}", *tokens_per_s) : std::string("-"));
  if (single_s > 0) {
    fmt::print(
        "  limit: single-rank layer, same {} tokens, {} thread(s), interleaved: {:.1f} ms "
        "-> parallel/single = {:.2f}\n",
        t_global, cores, single_s * 1e3, st.median_s / single_s);
  }
  if (o.emulate_per_node > 0) {
    fmt::print(
        "  emulated links: nodes of {} rank(s); intra-node {} GB/s + {} us, inter-node {} GB/s + "
        "{} us per message\n",
        o.emulate_per_node, o.intra_gbps, o.intra_latency_us, o.inter_gbps, o.inter_latency_us);
  }
  const parallel::CostModel& cm = last.cost_model;
  fmt::print(
      "  schedule: overlap degree {}, smart schedule {}, shadowed experts {}{}{}\n",
      last.overlap_degree,
      last.smart_group > 0 ? fmt::format("g = {}", last.smart_group) : std::string("off"), shadowed,
      o.hot_expert_bias > 0 ? fmt::format(" (skewed gate: expert 0 bias {})", o.hot_expert_bias)
                            : std::string(),
      cm.gemm_gflops > 0 ? fmt::format("; cost model {:.3g} GB/s + {:.3g} us, {:.3g} GFLOP/s",
                                       cm.link_gbps, cm.link_latency_us, cm.gemm_gflops)
                         : std::string());
  fmt::print(
      "  token all-to-alls (fwd+bwd, mean over ranks): ran {:.1f} ms, blocked {:.1f} ms -> {} "
      "hidden behind compute{}\n",
      (busy.empty() ? 0 : Median(busy)) * 1e3, (blocked.empty() ? 0 : Median(blocked)) * 1e3,
      Percent(hidden_median), hidden_median ? "" : " (-: no token all-to-all ran)");
  if (compare) {
    fmt::print(
        "  plain path (D 1, no smart schedule, no shadows), interleaved: median {:.1f} ms, token "
        "all-to-alls blocked {:.1f} ms -> speedup {}x, step saved = {} of the plain "
        "path's token communication\n",
        plain_st.median_s * 1e3, Median(plain_blocked) * 1e3, Fixed2(speedup),
        Percent(saved_median));
  }
  if (with_free) {
    const double f = SummarizeTimes(free_steps).median_s;
    fmt::print(
        "  limit: plain path over free links (no emulated cost), interleaved: median {:.1f} ms -> "
        "communication costs the plain path {:.1f} ms ({}x the free step); this schedule "
        "hides {} of it (median over rounds of (plain - this) / (plain - free))\n",
        f * 1e3, (plain_st.median_s - f) * 1e3, Fixed2(Quotient(plain_st.median_s - f, f)),
        Percent(hidden_of_cost_median));
  }
  if (with_balanced) {
    const double b = SummarizeTimes(balanced_steps).median_s;
    fmt::print(
        "  limit: plain path with the gate not skewed, interleaved: median {:.1f} ms -> the skew "
        "costs the plain path {:.1f} ms; shadowing removes {} of it (median over rounds of "
        "(plain - this) / (plain - unskewed))\n",
        b * 1e3, (plain_st.median_s - b) * 1e3, Percent(removed_of_skew_median));
  }
  fmt::print(
      "  per rank (last step): tokens  step ms  comm ms  compute ms  a2a ran  a2a blocked  MB "
      "tokens  MB routing  MB weights  MB grad-sync  MB tp\n");
  for (const auto& r : ranks) {
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
  // The volume model's two terms: tokens 4 C_g r (all-to-alls there and back, forward and backward)
  // and weights 2 P / (E r) (r = 0: 2 P). On the wire a rank sends (P - 1) / P of its token volume.
  const double p_elems = static_cast<double>(o.experts) *
                         (static_cast<double>(o.hidden_dim * o.model_dim) * (o.gated ? 3.0 : 2.0) +
                          static_cast<double>(o.hidden_dim + o.model_dim));
  const int r = last.adaptive_r;
  const double weight_term =
      (r == 0 ? 2.0 * p_elems : 2.0 * p_elems / (static_cast<double>(o.experts) * r)) *
      bytes_per_float;
  const double token_term = predicted_bytes - weight_term;
  fmt::print(
      "  volume model for r = {}: {:.2f} MB per rank per step = tokens 4 C_g r {:.2f} MB (x "
      "(P-1)/P "
      "= {:.2f} MB; measured {:.2f} MB) + weights {} {:.2f} MB (measured {:.2f} MB)\n",
      r, predicted_bytes / 1e6, token_term / 1e6,
      token_term * (group - 1) / std::max(1, group) / 1e6, max_token_bytes / 1e6,
      r == 0 ? "2P" : "2P/(E r)", weight_term / 1e6, max_weight_bytes / 1e6);
  return 0;
}

void AddParallelBenchOptions(CLI::App& app, BenchParallelOptions* o) {
  AddIntOption(app, "--global-tokens", &o->global_tokens, int64_t{0}, int64_t{1} << 40,
               "tokens of the whole batch instead");
  AddIntOption(app, "--ranks", &o->ranks, 1, 4096, "W");
  AddIntOption(app, "--tp", &o->tp, 1, 4096, "dense tensor-parallel degree");
  AddIntOption(app, "--ep", &o->ep, 0, 4096, "EP size (0: as large as possible)");
  AddIntOption(app, "--etp", &o->etp, 1, 4096, "expert tensor parallel (Megatron)");
  app.add_option("--arrangement", o->arrangement, "deepspeed | megatron")
      ->check(CLI::IsMember({"deepspeed", "megatron"}));
  app.add_option("--dispatch", o->dispatch, "alltoall | alltoallv | allgather")
      ->check(CLI::IsMember({"alltoall", "alltoallv", "allgather"}));
  app.add_option("--adaptive-r", o->adaptive_r, "R (0 or a divisor of the H shards) or auto");
  AddIntOption(app, "--2dh", &o->hierarchical, 0, 4096,
               "hierarchical all-to-all with this many ranks/node");
  app.add_flag("--no-tp-dedup", o->no_tp_dedup, "DeepSpeed arrangement: no TP de-duplication");
  app.add_option("--scope", o->scope, "global | per_rank (capacity, slots and l_aux)")
      ->check(CLI::IsMember({"global", "per_rank"}));
  app.add_option("--transport", o->transport, "auto (mpi under mpirun) | inproc | mpi")
      ->check(CLI::IsMember({"auto", "inproc", "mpi"}));
  AddIntOption(app, "--rounds", &o->rounds, 1, 1000,
               "interleaved rounds (parallel, plain path, single-rank)");
  app.add_flag("--no-reference", o->no_reference, "skip the single-rank limit");
  AddIntOption(app, "--overlap-degree", &o->overlap_degree, 1, 1024,
               "Tutel's a2a-FFN overlap: pipeline the token all-to-alls in D chunks");
  app.add_option("--smart-schedule", o->smart,
                 "FasterMoE's pair-wise schedule: off | auto | group size g");
  app.add_option("--shadow", o->shadow, "FasterMoE's shadow experts: none | auto | E1,E2,...");
  app.add_flag("--no-baseline", o->no_baseline,
               "with a schedule: skip the plain path (D 1, no smart schedule, no shadows)");
  app.add_option("--hot-expert-bias", o->hot_expert_bias,
                 "skewed gate: add this to expert 0's choice score (e.g. 0.1; 0: off)")
      ->check(FiniteIn(0, 1e6));
  app.add_option("--trace", o->trace_path,
                 "write the last round's timeline as a Chrome trace-event JSON file");
  AddIntOption(app, "--emulate-ranks-per-node", &o->emulate_per_node, 0, 4096,
               "in-process: emulate nodes of this many ranks (alpha-beta link costs)");
  AddEmulationLinkOptions(app, &o->intra_latency_us, &o->intra_gbps, &o->inter_latency_us,
                          &o->inter_gbps);
}

namespace {

SY_REGISTER_COMMAND(Command{
    "bench", "layer-parallel",
    "One MoE layer on W ranks: step time, tokens/s, comm vs compute and bytes per rank, overlap "
    "schedules against the plain path",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchParallelOptions>();
      AddIntOption(app, "--tokens", &o->tokens, int64_t{1}, int64_t{1} << 40,
                   "tokens per data shard (default 4096)");
      AddIntOption(app, "--model-dim", &o->model_dim, int64_t{1}, int64_t{1} << 40, "M");
      AddIntOption(app, "--hidden-dim", &o->hidden_dim, int64_t{1}, int64_t{1} << 40, "H");
      AddIntOption(app, "--experts", &o->experts, int64_t{1}, int64_t{1} << 40, "E");
      AddIntOption(app, "--top-k", &o->top_k, int64_t{1}, int64_t{1} << 40, "k");
      app.add_option("--capacity-factor", o->capacity_factor, "cf (0: no drops)")
          ->check(FiniteIn(-1e6, 1e6));
      app.add_flag("--dropless", o->dropless, "dropless mode");
      app.add_option("--activation", o->activation, "relu, gelu or silu");
      app.add_flag("--gated", o->gated, "gated experts");
      AddIntOption(app, "--threads", &o->threads, 0, 256,
                   "compute threads per rank (0: cores / ranks)");
      AddIntOption(app, "--repeat", &o->repeat, 1, 10000, "timed steps per round");
      AddIntOption(app, "--warmup", &o->warmup, 0, 10000, "untimed steps per round");
      app.add_flag("--json", o->json, "one JSON line instead of text");
      AddParallelBenchOptions(app, o.get());
      return [o] { return RunBenchParallel(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
