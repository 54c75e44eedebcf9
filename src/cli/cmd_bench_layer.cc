// `switchyard bench layer`: forward+backward time of one MoE layer against the limit it can
// approach, the expert GEMMs alone for the same token counts, measured interleaved in the same
// run. Also a per-step breakdown and, for many small experts, grouped GEMM against a plain loop.
// With --ranks W > 1 it is `bench layer-parallel` (bench_parallel.h): the same layer on W ranks,
// with the overlap schedules against the plain path.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/bench_common.h"
#include "cli/bench_parallel.h"
#include "cli/bench_setup.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/peak_flops.h"
#include "cli/timing.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/moe/dispatch.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/grouped_gemm.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/losses.h"
#include "switchyard/moe/plan.h"

namespace switchyard::cli {
namespace {

using kernels::GemmProblem;
using kernels::Trans;

struct BenchLayerOptions {
  MoeLayerFlags layer;
  int threads = 1;
  int blas_threads = 1;
  BenchLoopFlags loop{.iters = 10, .warmup = 2};
  bool breakdown = false;
  bool no_malloc_cache = false;
};

// The expert GEMMs of one forward+backward, as the layer issues them, on private buffers of the
// same sizes: per expert e with m_e rows, forward X W1^T (X W3^T), H W2^T; backward dY W2,
// dY^T H, dA1^T X, dA1 W1 (dA3^T X, dA3 W3).
class ExpertGemms {
 public:
  ExpertGemms(const std::vector<int64_t>& rows, int64_t m, int64_t h, bool gated)
      : rows_(rows), m_(m), h_(h), gated_(gated) {
    int64_t total = 0;
    for (int64_t r : rows) total += r;
    auto e = static_cast<int64_t>(rows.size());
    x_ = RandomTensor({total, m}, 1);
    y_ = RandomTensor({total, m}, 2);
    a_ = RandomTensor({total, h}, 3);
    b_ = RandomTensor({total, h}, 4);
    w1_ = RandomTensor({e, h, m}, 5);
    w2_ = RandomTensor({e, m, h}, 6);
    dw_ = RandomTensor({e, h, m}, 7);
  }

  // Every GEMM step as one grouped GEMM (what the layer does).
  void RunGrouped(int threads) const { RunGroupedSteps(threads, 0, kAllSteps); }
  // Only the forward's products (X W1^T (X W3^T), H W2^T), or only the backward's.
  void RunGroupedForward(int threads) const { RunGroupedSteps(threads, 0, ForwardSteps()); }
  void RunGroupedBackward(int threads) const {
    RunGroupedSteps(threads, ForwardSteps(), kAllSteps);
  }
  // The same products as a loop of plain GEMMs.
  void RunLoop() const {
    for (const Step& s : Steps()) {
      for (const GemmProblem& p : s.problems) {
        kernels::Gemm(s.ta, s.tb, p.m, p.n, p.k, 1.0f, p.a, p.lda, p.b, p.ldb, 0.0f, p.c, p.ldc);
      }
    }
  }

 private:
  static constexpr size_t kAllSteps = ~size_t{0};
  size_t ForwardSteps() const { return gated_ ? 3 : 2; }
  void RunGroupedSteps(int threads, size_t begin, size_t end) const {
    const std::vector<Step> steps = Steps();
    for (size_t i = begin; i < std::min(end, steps.size()); ++i) {
      moe::ExpertGroupedGemm(steps[i].ta, steps[i].tb, 1.0f, 0.0f, steps[i].problems, threads);
    }
  }
  struct Step {
    Trans ta, tb;
    std::vector<GemmProblem> problems;
  };
  std::vector<Step> Steps() const {
    std::vector<Step> steps;
    const float* x = x_.data<float>();
    float* y = y_.data<float>();
    float* a = a_.data<float>();
    float* b = b_.data<float>();
    const float* w1 = w1_.data<float>();
    const float* w2 = w2_.data<float>();
    float* dw = dw_.data<float>();
    auto add = [&](Trans ta, Trans tb, auto make) {
      Step s{ta, tb, {}};
      int64_t off = 0;
      for (size_t e = 0; e < rows_.size(); ++e) {
        int64_t r = rows_[e];
        if (r > 0) s.problems.push_back(make(static_cast<int64_t>(e), off, r));
        off += r;
      }
      steps.push_back(std::move(s));
    };
    const int64_t m = m_, h = h_, mh = m_ * h_;
    int copies = gated_ ? 2 : 1;
    for (int c = 0; c < copies; ++c) {  // X W1^T (and X W3^T)
      add(Trans::kNo, Trans::kYes, [&](int64_t e, int64_t off, int64_t r) {
        return GemmProblem{r, h, m, x + off * m, m, w1 + e * mh, m, a + off * h, h};
      });
    }
    add(Trans::kNo, Trans::kYes, [&](int64_t e, int64_t off, int64_t r) {  // H W2^T
      return GemmProblem{r, m, h, a + off * h, h, w2 + e * mh, h, y + off * m, m};
    });
    add(Trans::kYes, Trans::kNo, [&](int64_t e, int64_t off, int64_t r) {  // dW2 = dY^T H
      return GemmProblem{m, h, r, y + off * m, m, a + off * h, h, dw + e * mh, h};
    });
    add(Trans::kNo, Trans::kNo, [&](int64_t e, int64_t off, int64_t r) {  // dH = dY W2
      return GemmProblem{r, h, m, y + off * m, m, w2 + e * mh, h, b + off * h, h};
    });
    for (int c = 0; c < copies; ++c) {
      add(Trans::kYes, Trans::kNo, [&](int64_t e, int64_t off, int64_t r) {  // dW1 = dA^T X
        return GemmProblem{h, m, r, b + off * h, h, x + off * m, m, dw + e * mh, m};
      });
      add(Trans::kNo, Trans::kNo, [&](int64_t e, int64_t off, int64_t r) {  // dX = dA W1
        return GemmProblem{r, m, h, b + off * h, h, w1 + e * mh, m, y + off * m, m};
      });
    }
    return steps;
  }

  std::vector<int64_t> rows_;
  int64_t m_, h_;
  bool gated_;
  Tensor x_, y_, a_, b_, w1_, w2_, dw_;
};

struct Stage {
  std::string name;
  std::function<void()> run;
};

// Everything one step holds, and the private buffers of the expert GEMMs timed alone (the kept
// rows, at most T k, of M and H floats twice, and three [E, H, M] weights), refused up front:
// a capacity too large for memory or for an int32 row index ends here, before the gate runs.
void RequireLayerBenchMemory(const MoeLayerFlags& l, const moe::LayerConfig& c) {
  const double m = static_cast<double>(l.model_dim), h = static_cast<double>(l.hidden_dim);
  const double kept_max =
      std::min(MoeExpertRows(c, l.tokens),
               static_cast<double>(l.tokens) * static_cast<double>(moe::EffectiveTopK(c)));
  RequireMemory(
      EstimateMoeStepBytes(c, l.tokens, 1.0,
                           kept_max * 2 * (m + h) + 3 * static_cast<double>(l.experts) * m * h),
      fmt::format("bench layer: --tokens {} x --model-dim {} with --experts {} of --hidden-dim {} "
                  "({}), one forward and backward",
                  l.tokens, l.model_dim, l.experts, l.hidden_dim,
                  l.dropless ? std::string("dropless")
                             : fmt::format("capacity factor {:g}", l.capacity_factor)));
  if (!c.dropless && c.capacity_factor > 0) {
    // The layer's own check, before it computes the gate: E x capacity rows must index in int32
    // (the capacity is known before routing when capacity_factor > 0).
    moe::RequireExpertBufferMemory(c, c.num_experts, moe::ComputeCapacity(c, l.tokens, l.tokens));
  }
}

// The layer, its parameters and batch, and the expert GEMMs of the routing it produced.
struct LayerBench {
  moe::LayerConfig config;
  moe::MoeLayer layer;
  moe::LayerParams params;
  Tensor x, dy;
  moe::ForwardOptions fo;
  moe::LayerOutput probe;  // one forward: the routing the GEMMs alone reproduce
  int64_t kept = 0;
  double useful_flop = 0;  // of one forward + backward of the experts
  ExpertGemms gemms;

  LayerBench(const BenchLayerOptions& o, const moe::LayerConfig& c)
      : config(c),
        layer(c),  // checks the configuration
        // The memory, once the layer accepted the configuration and before anything is allocated.
        params((RequireLayerBenchMemory(o.layer, c), moe::InitParams(c, 1))),
        x(RandomTensor({o.layer.tokens, o.layer.model_dim}, 10)),
        dy(RandomTensor({o.layer.tokens, o.layer.model_dim}, 11)),
        fo(ForwardWith(o.threads)),
        probe(layer.Forward(params, x, fo)),
        kept(Sum(probe.expert_counts)),
        useful_flop(3.0 *
                    moe::ExpertFlops(kept, o.layer.model_dim, o.layer.hidden_dim, o.layer.gated)),
        gemms(probe.expert_counts, o.layer.model_dim, o.layer.hidden_dim, o.layer.gated) {}

  void Step(int threads) {
    moe::LayerOutput out = layer.Forward(params, x, fo);
    moe::LayerGradients g = layer.Backward(params, out, dy, threads);
  }

 private:
  static moe::ForwardOptions ForwardWith(int threads) {
    moe::ForwardOptions fo;
    fo.threads = threads;
    return fo;
  }
  static int64_t Sum(const std::vector<int64_t>& v) {
    int64_t s = 0;
    for (int64_t n : v) s += n;
    return s;
  }
};

// Breakdown: each piece of the layer on its own, through the public step functions, in
// dependency order; the median process CPU seconds of each.
std::vector<std::pair<std::string, double>> MeasureBreakdown(const BenchLayerOptions& o,
                                                             LayerBench& b) {
  const moe::LayerConfig& c = b.config;
  const int threads = o.threads;
  moe::GateResult gate;
  moe::DispatchPlan plan;
  Tensor expert_in, expert_out, y;
  moe::ExpertActivations acts;
  moe::CombineGradients cg;
  moe::ExpertGradients eg;
  moe::DispatchGradients dg;
  moe::ExpertOptions eo{c.activation, c.gated};
  const std::vector<Stage> stages = {
      {"gate forward",
       [&] { gate = moe::GateForward(c, b.x, b.params.gate_weight, Tensor(), {}); }},
      {"losses forward", [&] { (void)moe::ComputeGateLosses(c, gate); }},
      {"plan", [&] { plan = moe::MakeDispatchPlan(c, gate, {}); }},
      {"dispatch", [&] { expert_in = moe::Dispatch(plan, b.x, false, threads); }},
      {"expert GEMMs forward alone", [&] { b.gemms.RunGroupedForward(threads); }},
      {"experts forward",
       [&] {
         expert_out = moe::ExpertsForward(eo, b.params.experts, expert_in, moe::GroupsOf(plan),
                                          &acts, threads);
       }},
      {"combine", [&] { y = moe::Combine(plan, expert_out, false, threads); }},
      {"combine backward",
       [&] { cg = moe::CombineBackward(plan, b.dy, expert_out, false, threads); }},
      {"expert GEMMs backward alone", [&] { b.gemms.RunGroupedBackward(threads); }},
      {"experts backward",
       [&] { eg = moe::ExpertsBackward(eo, b.params.experts, acts, cg.expert_out, threads); }},
      {"dispatch backward",
       [&] { dg = moe::DispatchBackward(plan, eg.input, b.x, false, threads); }},
      {"gate backward",
       [&] {
         auto dgates = moe::CombineWeightsBackward(c, gate, plan, cg.weights);
         auto ds = moe::GateValuesBackward(c, gate, dgates);
         (void)moe::GateBackward(c, gate, b.x, b.params.gate_weight, ds, c.aux_loss_coef,
                                 c.z_loss_coef);
       }},
  };
  std::vector<std::function<void()>> runs;
  for (const Stage& st : stages) runs.push_back(st.run);
  // One warm-up round (in dependency order), then the timed rounds.
  const InterleavedTimes t = TimeInterleaved(runs, 1, o.loop.iters, /*cpu_too=*/true);
  std::vector<std::pair<std::string, double>> breakdown;
  for (size_t j = 0; j < stages.size(); ++j) {
    breakdown.emplace_back(stages[j].name, Median(t.cpu[j]));
  }
  return breakdown;
}

// What `bench layer` measured: the step, the grouped GEMMs alone, the GEMMs as a loop (wall and
// process CPU seconds), the breakdown, the FMA peak.
struct LayerFigures {
  TimingStats step, grouped, loop;
  double cpu_step = 0, cpu_grouped = 0, cpu_loop = 0;
  std::vector<std::pair<std::string, double>> breakdown;
  PeakFlops peak;
  double peak_total = 0;  // one thread's peak x --threads
};

void PrintLayerJson(const BenchLayerOptions& o, const LayerBench& b, const LayerFigures& f) {
  const MoeLayerFlags& l = o.layer;
  const double step = f.step.median_s, grouped = f.grouped.median_s;
  nlohmann::json j = {{"op", "layer"},
                      {"tokens", l.tokens},
                      {"model_dim", l.model_dim},
                      {"hidden_dim", l.hidden_dim},
                      {"experts", l.experts},
                      {"top_k", b.layer.top_k()},
                      {"capacity_factor", l.capacity_factor},
                      {"dropless", l.dropless},
                      {"activation", l.activation},
                      {"gated", l.gated},
                      {"threads", o.threads},
                      {"blas_threads", o.blas_threads},
                      {"gemm_backend", kernels::GemmBackendName()},
                      {"useful_gflops_per_cpu_s", b.useful_flop / f.cpu_step / 1e9},
                      {"small_gemm_isa", moe::SmallGemmIsaName()},
                      {"expert_gemm", moe::ExpertGemmKernelName()},
                      {"capacity", b.probe.capacity},
                      {"kept_pairs", b.kept},
                      {"dropped_pairs", b.probe.dropped},
                      {"step_ms", step * 1e3},
                      {"tokens_per_s", static_cast<double>(l.tokens) / step},
                      {"useful_gflops", b.useful_flop / step / 1e9},
                      {"expert_gemm_ms", grouped * 1e3},
                      {"expert_gemm_gflops", b.useful_flop / grouped / 1e9},
                      {"expert_gemm_loop_ms", f.loop.median_s * 1e3},
                      {"step_over_gemm", step / grouped},
                      {"step_cpu_ms", f.cpu_step * 1e3},
                      {"expert_gemm_cpu_ms", f.cpu_grouped * 1e3},
                      {"expert_gemm_loop_cpu_ms", f.cpu_loop * 1e3},
                      {"step_over_gemm_cpu", f.cpu_step / f.cpu_grouped},
                      {"malloc_cache", !o.no_malloc_cache},
                      {"peak_gflops", f.peak_total}};
  for (const auto& [name, t] : f.breakdown) j["breakdown_cpu_ms"][name] = t * 1e3;
  PrintJsonLine(j);
}

void PrintLayerText(const BenchLayerOptions& o, const LayerBench& b, const LayerFigures& f) {
  const MoeLayerFlags& l = o.layer;
  const double step = f.step.median_s, grouped = f.grouped.median_s;
  const double ratio = step / grouped, cpu_ratio = f.cpu_step / f.cpu_grouped;
  fmt::print(
      "MoE layer T={} M={} H={} E={} k={} cf={} {}{} act={}, {} thread(s) (BLAS {}), {} reps\n",
      l.tokens, l.model_dim, l.hidden_dim, l.experts, b.layer.top_k(), l.capacity_factor,
      l.dropless ? "dropless" : fmt::format("capacity {}", b.probe.capacity),
      l.gated ? " gated" : "", l.activation, o.threads, o.blas_threads, o.loop.iters);
  fmt::print("  kept (token, choice) pairs {} (dropped {})\n", b.kept, b.probe.dropped);
  fmt::print(
      "  forward+backward   {:8.2f} ms/step (median; best {:.2f})  {:9.0f} tokens/s  "
      "{:6.1f} useful GFLOP/s\n",
      step * 1e3, f.step.min_s * 1e3, static_cast<double>(l.tokens) / step,
      b.useful_flop / step / 1e9);
  fmt::print(
      "  expert GEMMs alone {:8.2f} ms (grouped)  {:6.1f} GFLOP/s   -> step / GEMMs = "
      "{:.3f} (overhead {:.1f}%)\n",
      grouped * 1e3, b.useful_flop / grouped / 1e9, ratio, 100.0 * (ratio - 1.0));
  fmt::print("  expert GEMMs loop  {:8.2f} ms (plain GEMM per expert)  grouped/loop = {:.3f}\n",
             f.loop.median_s * 1e3, grouped / f.loop.median_s);
  fmt::print(
      "  process CPU time: step {:.2f} ms, GEMMs {:.2f} ms (grouped), {:.2f} ms (loop) -> "
      "step / GEMMs = {:.3f}, grouped/loop = {:.3f}\n",
      f.cpu_step * 1e3, f.cpu_grouped * 1e3, f.cpu_loop * 1e3, cpu_ratio,
      f.cpu_grouped / f.cpu_loop);
  // On a loaded machine the wall time carries other processes' time; per CPU-second of the
  // process is what the layer does while it holds its cores.
  fmt::print("  useful GFLOP/s per CPU-second of the step: {:.1f} ({:.2f} of one core's peak)\n",
             b.useful_flop / f.cpu_step / 1e9, b.useful_flop / f.cpu_step / 1e9 / f.peak.gflops);
  fmt::print("  GEMMs: {}; expert products {}; small-expert kernels {}\n",
             kernels::GemmBackendName(), moe::ExpertGemmKernelName(), moe::SmallGemmIsaName());
  if (!kernels::GemmBackendWarning().empty()) {
    fmt::print("  {}\n", kernels::GemmBackendWarning());
  }
  fmt::print("  FMA peak ({}, measured now) {:.1f} GFLOP/s -> layer at {:.0f}% of peak\n",
             f.peak.isa, f.peak_total, 100.0 * b.useful_flop / step / 1e9 / f.peak_total);
  if (!f.breakdown.empty()) {
    fmt::print("  breakdown (each piece alone, median process CPU ms):\n");
    for (const auto& [name, t] : f.breakdown) fmt::print("    {:27s} {:8.3f}\n", name, t * 1e3);
  }
}

int RunBenchLayer(const BenchLayerOptions& o) {
  // The trainer's allocator policy (cli/launch.h): freed buffers stay in the process, as in a
  // training framework. With trimming still on (a 1 GiB threshold, before bb77b6a), config B's
  // step, which frees more than that at once, gave its heap back every step and faulted it in
  // again (step / GEMMs 1.13-1.22 against 1.06-1.07, docs/PERFORMANCE.md).
  if (!o.no_malloc_cache) KeepFreedMemoryForTraining();
  kernels::SetBlasThreads(o.blas_threads);
  const moe::LayerConfig c = o.layer.Config();
  LayerBench b(o, c);  // the layer checks its configuration first
  // Interleaved: step, grouped GEMMs, looped GEMMs, so drift hits all three alike.
  const InterleavedTimes t =
      TimeInterleaved({[&] { b.Step(o.threads); }, [&] { b.gemms.RunGrouped(o.threads); },
                       [&] { b.gemms.RunLoop(); }},
                      o.loop.warmup, o.loop.iters, /*cpu_too=*/true);
  LayerFigures f;
  f.step = SummarizeTimes(t.wall[0]);
  f.grouped = SummarizeTimes(t.wall[1]);
  f.loop = SummarizeTimes(t.wall[2]);
  f.cpu_step = Median(t.cpu[0]);
  f.cpu_grouped = Median(t.cpu[1]);
  f.cpu_loop = Median(t.cpu[2]);
  if (o.breakdown) f.breakdown = MeasureBreakdown(o, b);
  f.peak = MeasurePeakFlops();
  f.peak_total = f.peak.gflops * o.threads;
  if (o.loop.json) {
    PrintLayerJson(o, b, f);
  } else {
    PrintLayerText(o, b, f);
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "layer",
    "MoE layer forward+backward: ms/step, tokens/s, useful GFLOP/s vs the expert GEMMs alone",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchLayerOptions>();
      auto par = std::make_shared<BenchParallelOptions>();
      par->ranks = 1;
      AddMoeLayerFlags(app, &o->layer,
                       {.max_size = int64_t{1} << 24,
                        .max_experts = int64_t{1} << 16,
                        .tokens_help = "T, tokens on this rank"});
      CLI::Option* threads =
          AddIntOption(app, "--threads", &o->threads, 1, 256,
                       "compute threads of the rank (with --ranks: per rank, default cores / W)");
      AddIntOption(app, "--blas-threads", &o->blas_threads, 1, 256,
                   "GEMM threads per product (1: grouped GEMMs spread experts over --threads)");
      const BenchLoopOptions loop = AddBenchLoopFlags(app, &o->loop,
                                                      {.iters_name = "--repeat",
                                                       .max_iters = 100000,
                                                       .iters_help = "timed repetitions",
                                                       .warmup_help = "untimed repetitions first"});
      app.add_flag("--breakdown", o->breakdown, "also time each piece of the layer alone");
      app.add_flag("--no-malloc-cache", o->no_malloc_cache,
                   "leave glibc malloc's defaults (large buffers are mmapped and faulted in anew "
                   "every step)");
      auto preset = std::make_shared<std::string>();
      app.add_option("--preset", *preset,
                     "a layer of docs/PERFORMANCE.md (" + MoeLayerPresetNames() +
                         "); layer flags given as well override it");
      AddParallelBenchOptions(app, par.get());
      return [o, par, threads, loop, preset, &app] {
        if (!preset->empty()) ApplyMoeLayerPreset(app, *preset, &o->layer);
        SY_REQUIRE(par->ranks > 1 || par->layer.imbalance == 0, InvalidArgument,
                   "--imbalance compares the token all-to-all of W ranks: give --ranks W >= 2");
        if (par->ranks <= 1) return RunBenchLayer(*o);
        // The same layer on W ranks: `bench layer-parallel`, with its defaults for the threads
        // and the loop unless given.
        BenchParallelOptions p = *par;
        p.layer = o->layer;
        p.layer.imbalance = par->layer.imbalance;  // --imbalance is a layer-parallel flag
        p.loop.json = o->loop.json;
        if (threads->count() > 0) p.threads = o->threads;
        if (loop.iters->count() > 0) p.loop.iters = o->loop.iters;
        if (loop.warmup->count() > 0) p.loop.warmup = o->loop.warmup;
        return RunBenchParallel(p);
      };
    }});

}  // namespace
}  // namespace switchyard::cli
