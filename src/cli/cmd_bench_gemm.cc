// `switchyard bench gemm`: the GEMM rate of this machine, the limit later benchmarks report
// against.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <vector>

#include "cli/command.h"
#include "cli/peak_flops.h"
#include "cli/timing.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/reference.h"

namespace switchyard::cli {
namespace {

struct BenchGemmOptions {
  int64_t m = 256, k = 512, n = 2048;
  int threads = 1;
  int repeat = 20;
  bool json = false;
};

int RunBenchGemm(const BenchGemmOptions& o) {
  using kernels::Trans;
  kernels::SetBlasThreads(o.threads);
  std::vector<float> a(static_cast<size_t>(o.m * o.k)), b(static_cast<size_t>(o.k * o.n));
  std::vector<float> c(static_cast<size_t>(o.m * o.n));
  CounterRng rng(1, kStreamData);
  for (size_t i = 0; i < a.size(); ++i) a[i] = rng.Uniform(i) - 0.5f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = rng.Uniform(i + a.size()) - 0.5f;

  auto run = [&] {
    kernels::Gemm(Trans::kNo, Trans::kNo, o.m, o.n, o.k, 1.0f, a.data(), o.k, b.data(), o.n, 0.0f,
                  c.data(), o.n);
  };
  TimingStats t = TimeRepeated(run, o.repeat, /*warmup=*/3);
  double flop =
      2.0 * static_cast<double>(o.m) * static_cast<double>(o.n) * static_cast<double>(o.k);

  // Correctness of what was timed: first rows against the reference.
  int64_t check_rows = std::min<int64_t>(o.m, 2);
  std::vector<float> ref(static_cast<size_t>(check_rows * o.n));
  kernels::ref::Gemm(Trans::kNo, Trans::kNo, check_rows, o.n, o.k, 1.0f, a.data(), o.k, b.data(),
                     o.n, 0.0f, ref.data(), o.n);
  double max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    max_err = std::max<double>(max_err, std::abs(ref[i] - c[i]));

  double gflops = flop / t.median_s / 1e9;
  // The limit, measured in the same run: one thread's FMA peak times the threads used.
  PeakFlops peak = MeasurePeakFlops();
  double peak_total = peak.gflops * o.threads;
  if (o.json) {
    nlohmann::json j = {{"op", "gemm"},
                        {"m", o.m},
                        {"k", o.k},
                        {"n", o.n},
                        {"threads", o.threads},
                        {"median_ms", t.median_s * 1e3},
                        {"min_ms", t.min_s * 1e3},
                        {"gflops", gflops},
                        {"gflops_best", flop / t.min_s / 1e9},
                        {"max_abs_err", max_err},
                        {"peak_gflops", peak_total},
                        {"peak_isa", peak.isa},
                        {"fraction_of_peak", gflops / peak_total}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("gemm (M x K)(K x N) = ({} x {})({} x {}), {} thread(s), {} reps\n", o.m, o.k, o.k,
               o.n, o.threads, o.repeat);
    fmt::print("  median {:.3f} ms  best {:.3f} ms\n", t.median_s * 1e3, t.min_s * 1e3);
    fmt::print("  {:.1f} GFLOP/s (median), {:.1f} GFLOP/s (best)\n", gflops, flop / t.min_s / 1e9);
    fmt::print(
        "  FMA peak ({}, measured now): {:.1f} GFLOP/s for {} thread(s) -> {:.0f}% of peak\n",
        peak.isa, peak_total, o.threads, 100.0 * gflops / peak_total);
    fmt::print("  max |err| vs reference on first rows: {:.2e}\n", max_err);
    fmt::print("  BLAS: {}\n", kernels::BlasConfig());
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "gemm", "GFLOP/s of (M x K)(K x N) float32 GEMM through OpenBLAS",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchGemmOptions>();
      app.add_option("--m", o->m, "rows of A and C")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
      app.add_option("--k", o->k, "inner dimension")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
      app.add_option("--n", o->n, "columns of B and C")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
      app.add_option("--threads", o->threads, "BLAS threads")->check(CLI::Range(1, 256));
      app.add_option("--repeat", o->repeat, "timed repetitions")->check(CLI::Range(1, 100000));
      app.add_flag("--json", o->json, "one JSON line instead of text");
      return [o] { return RunBenchGemm(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
