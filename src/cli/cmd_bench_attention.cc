// `switchyard bench attention`: the two single-rank causal attention cores, forward + backward,
// at several sequence lengths, timed interleaved in the same run:
//   softmax  CausalAttentionForward/Backward (train/layers.h): full [seq, seq] score GEMMs through
//            the GEMM backend, the softmax kept for backward;
//   flash    the flash core (train/attention_flash.h, `attention_core flash`): 64 x 64 tiles,
//            online softmax, causal tiles skipped, scores recomputed in backward.
// Useful work is the causal triangle's: 6 products of 2 x head_dim flops per (query, key <=
// query) pair (2 forward, 4 backward; the flash core's recomputed scores are not counted). Each
// repetition first runs the FMA-loop probe, and the ratio is the work's rate over the probe's
// rate x threads of the same window (median over repetitions). On a loaded machine the wall
// clock also counts time the scheduler gave to other processes, so `of_peak_cpu` divides by the
// process's CPU time instead (the work's rate per CPU-second over the probe's rate per
// CPU-second): the kernel's efficiency while it runs.
//
//   switchyard bench attention                      # seq 512,1024,2048,4096; 8 heads of 64
//   switchyard bench attention --seq 2048 --threads 2 --repeat 5 --json
#include <fmt/format.h>

#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/peak_flops.h"
#include "cli/timing.h"
#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/train/context_parallel.h"
#include "switchyard/train/layers.h"

namespace switchyard::cli {
namespace {

struct BenchAttentionOptions {
  std::vector<int> seq = {512, 1024, 2048, 4096};
  std::vector<std::string> cores = {"softmax", "flash"};
  int64_t heads = 8;
  int64_t head_dim = 64;
  int threads = 1;
  int repeat = 3;
  bool json = false;
};

double CpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

Tensor Filled(Shape shape, uint32_t seed) {
  Tensor t = Tensor::Empty(std::move(shape));
  float* p = t.data<float>();
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  }
  return t;
}

// One forward + backward of `core` on qkv [seq, 3 * heads * head_dim].
void RunCore(const std::string& core, const Tensor& qkv, const Tensor& datt, int64_t heads,
             int threads) {
  if (core == "softmax") {
    Tensor probs;
    (void)train::CausalAttentionForward(qkv, 1, heads, threads, &probs);
    (void)train::CausalAttentionBackward(qkv, probs, datt, 1, heads, threads);
    return;
  }
  const train::ContextParallelAttention flash(heads, qkv.size(0));
  train::ContextParallelCache cache;
  (void)flash.Forward(qkv, 1, &cache, threads);
  (void)flash.Backward(cache, datt, threads);
}

int RunBenchAttention(const BenchAttentionOptions& o) {
  for (int seq : o.seq) {
    SY_REQUIRE(
        seq % 2 == 0, InvalidArgument,
        "bench attention --seq: {} is odd; the flash core of `attention_core flash` splits a "
        "sequence into two halves (zigzag), so every length must be even",
        seq);
  }
  kernels::SetBlasThreads(o.threads);
  const std::string backend = kernels::GemmBackendName();
  const PeakFlops peak = MeasurePeakFlops();
  if (!o.json) {
    fmt::print(
        "# switchyard bench attention: causal, forward + backward, {} heads x {}, {} thread(s), "
        "median of {}; softmax core GEMMs: {}; flash core: 64 x 64 tiles ({})\n",
        o.heads, o.head_dim, o.threads, o.repeat, backend, peak.isa);
    fmt::print("{:>6} {:>8} {:>10} {:>9} {:>8} {:>11}\n", "seq", "core", "median_s", "GFLOP/s",
               "of_peak", "of_peak_cpu");
  }
  for (int seq : o.seq) {
    const int64_t d = o.heads * o.head_dim;
    const Tensor qkv = Filled({seq, 3 * d}, 1), datt = Filled({seq, d}, 2);
    const double flop =
        6.0 * static_cast<double>(o.head_dim) * seq * (seq + 1.0) * static_cast<double>(o.heads);
    const size_t n = o.cores.size();
    std::vector<std::vector<double>> times(n), ratios(n), cpu_ratios(n);
    for (int r = -1; r < o.repeat; ++r) {  // one warm-up round
      for (size_t c = 0; c < n; ++c) {
        const double p0 = NowSeconds(), pc0 = CpuSeconds();
        const double probe = PeakProbeGflops();
        // The probe's flops over its CPU time: one thread's rate per CPU-second.
        const double probe_cpu = probe * (NowSeconds() - p0) / (CpuSeconds() - pc0);
        const double t0 = NowSeconds(), c0 = CpuSeconds();
        RunCore(o.cores[c], qkv, datt, o.heads, o.threads);
        const double dt = NowSeconds() - t0, cpu = CpuSeconds() - c0;
        if (r < 0) continue;
        times[c].push_back(dt);
        ratios[c].push_back(flop / dt / 1e9 / (probe * o.threads));
        cpu_ratios[c].push_back(flop / cpu / 1e9 / probe_cpu);
      }
    }
    for (size_t c = 0; c < o.cores.size(); ++c) {
      const TimingStats t = SummarizeTimes(times[c]);
      const double ratio = SummarizeTimes(ratios[c]).median_s;
      const double cpu_ratio = SummarizeTimes(cpu_ratios[c]).median_s;
      if (o.json) {
        nlohmann::json j = {{"op", "attention"},
                            {"core", o.cores[c]},
                            {"seq", seq},
                            {"heads", o.heads},
                            {"head_dim", o.head_dim},
                            {"threads", o.threads},
                            {"median_s", t.median_s},
                            {"gflops", flop / t.median_s / 1e9},
                            {"fraction_of_peak", ratio},
                            {"backend", backend}};
        fmt::print("{}\n", j.dump());
      } else {
        fmt::print("{:>6} {:>8} {:>10.4f} {:>9.1f} {:>8.3f} {:>11.3f}\n", seq, o.cores[c],
                   t.median_s, flop / t.median_s / 1e9, ratio, cpu_ratio);
      }
    }
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "attention",
    "Causal attention cores (softmax, flash), forward + backward: seconds and share of the FMA "
    "peak per sequence length",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchAttentionOptions>();
      AddIntListOption(app, "--seq", &o->seq, 2, 1 << 20,
                       "sequence lengths, comma-separated (even: the flash core's split)");
      app.add_option("--cores", o->cores, "comma-separated: softmax, flash")
          ->delimiter(',')
          ->check(CLI::IsMember({"softmax", "flash"}));
      AddIntOption(app, "--heads", &o->heads, int64_t{1}, int64_t{1} << 20, "attention heads");
      AddIntOption(app, "--head-dim", &o->head_dim, int64_t{1}, int64_t{1} << 20,
                   "columns per head");
      AddIntOption(app, "--threads", &o->threads, 1, 1024, "compute threads");
      AddIntOption(app, "--repeat", &o->repeat, 1, 1000, "timed repetitions (median)");
      app.add_flag("--json", o->json, "one JSON line per sequence length and core");
      return [o] { return RunBenchAttention(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
