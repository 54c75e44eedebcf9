// `switchyard bench layer`: forward+backward time of one MoE layer against the limit it can
// approach, the expert GEMMs alone for the same token counts, measured interleaved in the same
// run. Also a per-step breakdown and, for many small experts, grouped GEMM against a plain loop.
// With --ranks W > 1 it is `bench layer-parallel` (bench_parallel.h): the same layer on W ranks,
// with the overlap schedules against the plain path.
#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/bench_common.h"
#include "cli/bench_parallel.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/peak_flops.h"
#include "cli/timing.h"
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
  int64_t tokens = 4096;
  int64_t model_dim = 512;
  int64_t hidden_dim = 2048;
  int64_t experts = 8;
  int64_t top_k = 2;
  float capacity_factor = 1.25f;
  bool dropless = false;
  std::string activation = "gelu";
  bool gated = false;
  int threads = 1;
  int blas_threads = 1;
  int repeat = 10;
  int warmup = 2;
  bool breakdown = false;
  bool json = false;
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

// CPU time of the whole process (all threads): on a shared machine it counts the work done, not
// the time other processes held the cores.
double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Stage {
  std::string name;
  std::function<void()> run;
};

int RunBenchLayer(const BenchLayerOptions& o) {
  // The trainer's allocator policy (cli/launch.h): freed buffers stay in the process, as in a
  // training framework. With trimming still on (a 1 GiB threshold, before bb77b6a), config B's
  // step, which frees more than that at once, gave its heap back every step and faulted it in
  // again (step / GEMMs 1.13-1.22 against 1.06-1.07, docs/PERFORMANCE.md).
  if (!o.no_malloc_cache) KeepFreedMemoryForTraining();
  kernels::SetBlasThreads(o.blas_threads);
  moe::LayerConfig c;
  c.model_dim = o.model_dim;
  c.hidden_dim = o.hidden_dim;
  c.num_experts = o.experts;
  c.top_k = o.top_k;
  c.capacity_factor = o.capacity_factor;
  c.dropless = o.dropless;
  c.activation = kernels::ActivationFromName(o.activation);
  c.gated = o.gated;
  moe::MoeLayer layer(c);
  // Everything one step holds, and the private buffers of the expert GEMMs timed alone (the kept
  // rows, at most T k, of M and H floats twice, and three [E, H, M] weights), refused up front:
  // a capacity too large for memory or for an int32 row index ends here, before the gate runs.
  const double m = static_cast<double>(o.model_dim), h = static_cast<double>(o.hidden_dim);
  const double kept_max =
      std::min(MoeExpertRows(c, o.tokens),
               static_cast<double>(o.tokens) * static_cast<double>(moe::EffectiveTopK(c)));
  RequireMemory(
      EstimateMoeStepBytes(c, o.tokens, 1.0,
                           kept_max * 2 * (m + h) + 3 * static_cast<double>(o.experts) * m * h),
      fmt::format("bench layer: --tokens {} x --model-dim {} with --experts {} of --hidden-dim {} "
                  "({}), one forward and backward",
                  o.tokens, o.model_dim, o.experts, o.hidden_dim,
                  o.dropless ? std::string("dropless")
                             : fmt::format("capacity factor {:g}", o.capacity_factor)));
  if (!c.dropless && c.capacity_factor > 0) {
    // The layer's own check, before it computes the gate: E x capacity rows must index in int32
    // (the capacity is known before routing when capacity_factor > 0).
    moe::RequireExpertBufferMemory(c, c.num_experts, moe::ComputeCapacity(c, o.tokens, o.tokens));
  }
  moe::LayerParams params = moe::InitParams(c, 1);
  Tensor x = RandomTensor({o.tokens, o.model_dim}, 10);
  Tensor dy = RandomTensor({o.tokens, o.model_dim}, 11);
  moe::ForwardOptions fo;
  fo.threads = o.threads;

  moe::LayerOutput probe = layer.Forward(params, x, fo);
  int64_t kept = 0;
  for (int64_t n : probe.expert_counts) kept += n;
  const double useful_flop = 3.0 * moe::ExpertFlops(kept, o.model_dim, o.hidden_dim, o.gated);
  ExpertGemms gemms(probe.expert_counts, o.model_dim, o.hidden_dim, o.gated);

  auto step = [&] {
    moe::LayerOutput out = layer.Forward(params, x, fo);
    moe::LayerGradients g = layer.Backward(params, out, dy, o.threads);
  };
  // Interleaved: step, grouped GEMMs, looped GEMMs, so drift hits all three alike.
  for (int i = 0; i < o.warmup; ++i) {
    step();
    gemms.RunGrouped(o.threads);
    gemms.RunLoop();
  }
  std::vector<double> t_step, t_grouped, t_loop, c_step, c_grouped, c_loop;
  auto timed = [](const auto& fn, std::vector<double>& wall, std::vector<double>& cpu) {
    double w0 = NowSeconds(), c0 = ProcessCpuSeconds();
    fn();
    cpu.push_back(ProcessCpuSeconds() - c0);
    wall.push_back(NowSeconds() - w0);
  };
  for (int i = 0; i < o.repeat; ++i) {
    timed(step, t_step, c_step);
    timed([&] { gemms.RunGrouped(o.threads); }, t_grouped, c_grouped);
    timed([&] { gemms.RunLoop(); }, t_loop, c_loop);
  }
  TimingStats s_step = SummarizeTimes(t_step), s_grouped = SummarizeTimes(t_grouped),
              s_loop = SummarizeTimes(t_loop);
  double cpu_step = SummarizeTimes(c_step).median_s,
         cpu_grouped = SummarizeTimes(c_grouped).median_s,
         cpu_loop = SummarizeTimes(c_loop).median_s;

  // Breakdown: each piece of the layer on its own, through the public step functions.
  std::vector<std::pair<std::string, double>> breakdown;
  if (o.breakdown) {
    moe::GateResult gate;
    moe::DispatchPlan plan;
    Tensor expert_in, expert_out, y;
    moe::ExpertActivations acts;
    moe::CombineGradients cg;
    moe::ExpertGradients eg;
    moe::DispatchGradients dg;
    moe::ExpertOptions eo{c.activation, c.gated};
    std::vector<Stage> stages = {
        {"gate forward", [&] { gate = moe::GateForward(c, x, params.gate_weight, Tensor(), {}); }},
        {"losses forward", [&] { (void)moe::ComputeGateLosses(c, gate); }},
        {"plan", [&] { plan = moe::MakeDispatchPlan(c, gate, {}); }},
        {"dispatch", [&] { expert_in = moe::Dispatch(plan, x, false, o.threads); }},
        {"expert GEMMs forward alone", [&] { gemms.RunGroupedForward(o.threads); }},
        {"experts forward",
         [&] {
           expert_out = moe::ExpertsForward(eo, params.experts, expert_in, moe::GroupsOf(plan),
                                            &acts, o.threads);
         }},
        {"combine", [&] { y = moe::Combine(plan, expert_out, false, o.threads); }},
        {"combine backward",
         [&] { cg = moe::CombineBackward(plan, dy, expert_out, false, o.threads); }},
        {"expert GEMMs backward alone", [&] { gemms.RunGroupedBackward(o.threads); }},
        {"experts backward",
         [&] { eg = moe::ExpertsBackward(eo, params.experts, acts, cg.expert_out, o.threads); }},
        {"dispatch backward",
         [&] { dg = moe::DispatchBackward(plan, eg.input, x, false, o.threads); }},
        {"gate backward",
         [&] {
           auto dgates = moe::CombineWeightsBackward(c, gate, plan, cg.weights);
           auto ds = moe::GateValuesBackward(c, gate, dgates);
           (void)moe::GateBackward(c, gate, x, params.gate_weight, ds, c.aux_loss_coef,
                                   c.z_loss_coef);
         }},
    };
    for (const Stage& st : stages) st.run();  // warm-up, in dependency order
    std::vector<std::vector<double>> times(stages.size());
    for (int i = 0; i < o.repeat; ++i) {
      for (size_t j = 0; j < stages.size(); ++j) {
        double t0 = ProcessCpuSeconds();
        stages[j].run();
        times[j].push_back(ProcessCpuSeconds() - t0);
      }
    }
    for (size_t j = 0; j < stages.size(); ++j) {
      breakdown.emplace_back(stages[j].name, SummarizeTimes(times[j]).median_s);
    }
  }
  PeakFlops peak = MeasurePeakFlops();
  double peak_total = peak.gflops * o.threads;

  double ratio = s_step.median_s / s_grouped.median_s;
  double cpu_ratio = cpu_step / cpu_grouped;
  if (o.json) {
    nlohmann::json j = {{"op", "layer"},
                        {"tokens", o.tokens},
                        {"model_dim", o.model_dim},
                        {"hidden_dim", o.hidden_dim},
                        {"experts", o.experts},
                        {"top_k", layer.top_k()},
                        {"capacity_factor", o.capacity_factor},
                        {"dropless", o.dropless},
                        {"activation", o.activation},
                        {"gated", o.gated},
                        {"threads", o.threads},
                        {"blas_threads", o.blas_threads},
                        {"gemm_backend", kernels::GemmBackendName()},
                        {"useful_gflops_per_cpu_s", useful_flop / cpu_step / 1e9},
                        {"small_gemm_isa", moe::SmallGemmIsaName()},
                        {"capacity", probe.capacity},
                        {"kept_pairs", kept},
                        {"dropped_pairs", probe.dropped},
                        {"step_ms", s_step.median_s * 1e3},
                        {"tokens_per_s", static_cast<double>(o.tokens) / s_step.median_s},
                        {"useful_gflops", useful_flop / s_step.median_s / 1e9},
                        {"expert_gemm_ms", s_grouped.median_s * 1e3},
                        {"expert_gemm_gflops", useful_flop / s_grouped.median_s / 1e9},
                        {"expert_gemm_loop_ms", s_loop.median_s * 1e3},
                        {"step_over_gemm", ratio},
                        {"step_cpu_ms", cpu_step * 1e3},
                        {"expert_gemm_cpu_ms", cpu_grouped * 1e3},
                        {"expert_gemm_loop_cpu_ms", cpu_loop * 1e3},
                        {"step_over_gemm_cpu", cpu_ratio},
                        {"malloc_cache", !o.no_malloc_cache},
                        {"peak_gflops", peak_total}};
    for (auto& [name, t] : breakdown) j["breakdown_cpu_ms"][name] = t * 1e3;
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "MoE layer T={} M={} H={} E={} k={} cf={} {}{} act={}, {} thread(s) (BLAS {}), {} reps\n",
      o.tokens, o.model_dim, o.hidden_dim, o.experts, layer.top_k(), o.capacity_factor,
      o.dropless ? "dropless" : fmt::format("capacity {}", probe.capacity), o.gated ? " gated" : "",
      o.activation, o.threads, o.blas_threads, o.repeat);
  fmt::print("  kept (token, choice) pairs {} (dropped {})\n", kept, probe.dropped);
  fmt::print(
      "  forward+backward   {:8.2f} ms/step (median; best {:.2f})  {:9.0f} tokens/s  "
      "{:6.1f} useful GFLOP/s\n",
      s_step.median_s * 1e3, s_step.min_s * 1e3, static_cast<double>(o.tokens) / s_step.median_s,
      useful_flop / s_step.median_s / 1e9);
  fmt::print(
      "  expert GEMMs alone {:8.2f} ms (grouped)  {:6.1f} GFLOP/s   -> step / GEMMs = "
      "{:.3f} (overhead {:.1f}%)\n",
      s_grouped.median_s * 1e3, useful_flop / s_grouped.median_s / 1e9, ratio,
      100.0 * (ratio - 1.0));
  fmt::print("  expert GEMMs loop  {:8.2f} ms (plain GEMM per expert)  grouped/loop = {:.3f}\n",
             s_loop.median_s * 1e3, s_grouped.median_s / s_loop.median_s);
  fmt::print(
      "  process CPU time: step {:.2f} ms, GEMMs {:.2f} ms (grouped), {:.2f} ms (loop) -> "
      "step / GEMMs = {:.3f}, grouped/loop = {:.3f}\n",
      cpu_step * 1e3, cpu_grouped * 1e3, cpu_loop * 1e3, cpu_ratio, cpu_grouped / cpu_loop);
  // On a loaded machine the wall time carries other processes' time; per CPU-second of the
  // process is what the layer does while it holds its cores.
  fmt::print("  useful GFLOP/s per CPU-second of the step: {:.1f} ({:.2f} of one core's peak)\n",
             useful_flop / cpu_step / 1e9, useful_flop / cpu_step / 1e9 / peak.gflops);
  fmt::print("  GEMMs: {}; small-expert kernels {}\n", kernels::GemmBackendName(),
             moe::SmallGemmIsaName());
  if (!kernels::GemmBackendWarning().empty()) {
    fmt::print("  {}\n", kernels::GemmBackendWarning());
  }
  fmt::print("  FMA peak ({}, measured now) {:.1f} GFLOP/s -> layer at {:.0f}% of peak\n", peak.isa,
             peak_total, 100.0 * useful_flop / s_step.median_s / 1e9 / peak_total);
  if (!breakdown.empty()) {
    fmt::print("  breakdown (each piece alone, median process CPU ms):\n");
    for (auto& [name, t] : breakdown) fmt::print("    {:27s} {:8.3f}\n", name, t * 1e3);
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
      AddIntOption(app, "--tokens", &o->tokens, int64_t{1}, int64_t{1} << 24,
                   "T, tokens on this rank");
      AddIntOption(app, "--model-dim", &o->model_dim, int64_t{1}, int64_t{1} << 24, "M");
      AddIntOption(app, "--hidden-dim", &o->hidden_dim, int64_t{1}, int64_t{1} << 24,
                   "H, hidden size of one expert");
      AddIntOption(app, "--experts", &o->experts, int64_t{1}, int64_t{1} << 16, "E");
      AddIntOption(app, "--top-k", &o->top_k, int64_t{1}, int64_t{1} << 16, "k");
      app.add_option("--capacity-factor", o->capacity_factor, "cf (0: no drops)")
          ->check(FiniteIn(-1e6, 1e6));
      app.add_flag("--dropless", o->dropless, "dropless mode (grouped GEMM, no capacity)");
      app.add_option("--activation", o->activation, "relu, gelu or silu");
      app.add_flag("--gated", o->gated, "gated experts (SwiGLU form)");
      CLI::Option* threads =
          AddIntOption(app, "--threads", &o->threads, 1, 256,
                       "compute threads of the rank (with --ranks: per rank, default cores / W)");
      AddIntOption(app, "--blas-threads", &o->blas_threads, 1, 256,
                   "GEMM threads per product (1: grouped GEMMs spread experts over --threads)");
      AddIntOption(app, "--repeat", &o->repeat, 1, 100000, "timed repetitions");
      AddIntOption(app, "--warmup", &o->warmup, 0, 1000, "untimed repetitions first");
      app.add_flag("--breakdown", o->breakdown, "also time each piece of the layer alone");
      app.add_flag("--json", o->json, "one JSON line instead of text");
      app.add_flag("--no-malloc-cache", o->no_malloc_cache,
                   "leave glibc malloc's defaults (large buffers are mmapped and faulted in anew "
                   "every step)");
      AddParallelBenchOptions(app, par.get());
      CLI::Option* repeat = app.get_option("--repeat");
      CLI::Option* warmup = app.get_option("--warmup");
      return [o, par, threads, repeat, warmup] {
        if (par->ranks <= 1) return RunBenchLayer(*o);
        // The same layer on W ranks: `bench layer-parallel`.
        BenchParallelOptions p = *par;
        p.tokens = o->tokens;
        p.model_dim = o->model_dim;
        p.hidden_dim = o->hidden_dim;
        p.experts = o->experts;
        p.top_k = o->top_k;
        p.capacity_factor = o->capacity_factor;
        p.dropless = o->dropless;
        p.activation = o->activation;
        p.gated = o->gated;
        p.json = o->json;
        if (threads->count() > 0) p.threads = o->threads;
        if (repeat->count() > 0) p.repeat = o->repeat;
        if (warmup->count() > 0) p.warmup = o->warmup;
        return RunBenchParallel(p);
      };
    }});

}  // namespace
}  // namespace switchyard::cli
