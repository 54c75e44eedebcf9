// `switchyard bench gemm`: the GEMM rate of this machine, the limit later benchmarks report
// against, with the backend and kernel that ran (kernels/gemm_backend.h). With --expert C,M,H it
// times the six products of one expert's forward and backward (fc1, fc2, their input and weight
// gradients) instead of one product: the shapes the MoE layer runs.
#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/parse_numbers.h"
#include "cli/peak_flops.h"
#include "cli/timing.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/tensor.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/kernels/reference.h"

namespace switchyard::cli {
namespace {

using kernels::Trans;

struct BenchGemmOptions {
  int64_t m = 256, k = 512, n = 2048;
  std::string expert;   // "C,M,H": one expert's six products instead of (m, k, n)
  std::string backend;  // "" = the selector's choice
  int threads = 1;
  int repeat = 20;
  bool json = false;
};

struct Product {
  const char* name;
  Trans ta, tb;
  int64_t m, n, k;
};

// One expert of `c` token rows, model_dim m_dim, hidden_dim h_dim (experts.cc's six GEMMs).
std::vector<Product> ExpertProducts(int64_t c, int64_t m_dim, int64_t h_dim) {
  return {{"fc1 X W1^T", Trans::kNo, Trans::kYes, c, h_dim, m_dim},
          {"fc2 h W2^T", Trans::kNo, Trans::kYes, c, m_dim, h_dim},
          {"dW2 dY^T h", Trans::kYes, Trans::kNo, m_dim, h_dim, c},
          {"dh dY W2", Trans::kNo, Trans::kNo, c, h_dim, m_dim},
          {"dW1 dP^T X", Trans::kYes, Trans::kNo, h_dim, m_dim, c},
          {"dX dP W1", Trans::kNo, Trans::kNo, c, m_dim, h_dim}};
}

// Operands live in Tensors (64-byte aligned, as every operand of the layer and the trainer is):
// a std::vector's 16-byte alignment leaves C's rows straddling cache lines, which costs OpenBLAS's
// AVX2 kernel up to 15 % of its rate at the `bench gemm` shape.
struct Operands {
  Tensor a, b, c;
};

Operands MakeOperands(const Product& p) {
  Operands o{Tensor::Empty({p.m, p.k}), Tensor::Empty({p.k, p.n}), Tensor::Zeros({p.m, p.n})};
  CounterRng rng(1, kStreamData);
  float* a = o.a.data<float>();
  float* b = o.b.data<float>();
  const size_t na = static_cast<size_t>(p.m * p.k), nb = static_cast<size_t>(p.k * p.n);
  for (size_t i = 0; i < na; ++i) a[i] = rng.Uniform(i) - 0.5f;
  for (size_t i = 0; i < nb; ++i) b[i] = rng.Uniform(i + na) - 0.5f;
  return o;
}

void RunProduct(const Product& p, Operands& o) {
  const int64_t lda = p.ta == Trans::kNo ? p.k : p.m, ldb = p.tb == Trans::kNo ? p.n : p.k;
  kernels::Gemm(p.ta, p.tb, p.m, p.n, p.k, 1.0f, o.a.data<float>(), lda, o.b.data<float>(), ldb,
                0.0f, o.c.data<float>(), p.n);
}

// Max |C - reference| over the first two rows of C.
double CheckRows(const Product& p, const Operands& o) {
  const int64_t lda = p.ta == Trans::kNo ? p.k : p.m, ldb = p.tb == Trans::kNo ? p.n : p.k;
  const int64_t rows = std::min<int64_t>(p.m, 2);
  std::vector<float> ref(static_cast<size_t>(rows * p.n));
  // Rows of op(A): with A transposed, row i is column i of the stored [k, m] matrix.
  kernels::ref::Gemm(p.ta, p.tb, rows, p.n, p.k, 1.0f, o.a.data<float>(), lda, o.b.data<float>(),
                     ldb, 0.0f, ref.data(), p.n);
  double max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_err = std::max<double>(max_err, std::abs(ref[i] - o.c.data<float>()[i]));
  }
  return max_err;
}

int RunBenchGemm(const BenchGemmOptions& o) {
  if (!o.backend.empty())
    kernels::SetGemmBackend(kernels::ParseGemmBackend("--backend", o.backend));
  kernels::SetBlasThreads(o.threads);
  std::vector<Product> products;
  if (o.expert.empty()) {
    products.push_back({"gemm", Trans::kNo, Trans::kNo, o.m, o.n, o.k});
  } else {
    std::vector<int64_t> dims;
    std::stringstream ss(o.expert);
    for (std::string item; std::getline(ss, item, ',');) {
      // Whole numbers in [1, 2^20], as --m/--k/--n: no sign, nan, fractions or overflow.
      const double v = ParseFiniteDouble(item, "--expert", 1, double(int64_t{1} << 20));
      SY_REQUIRE(v == std::floor(v), InvalidArgument,
                 "--expert: '{}' is not a whole number; expected C,M,H as three whole sizes", item);
      dims.push_back(static_cast<int64_t>(v));
    }
    SY_REQUIRE(dims.size() == 3, InvalidArgument,
               "--expert: expected C,M,H (three positive sizes), got '{}'", o.expert);
    products = ExpertProducts(dims[0], dims[1], dims[2]);
  }
  // Refuse up front what cannot fit (the sizes may be up to 2^20 each).
  uint64_t bytes = 0;
  for (const auto& p : products) {
    bytes += sizeof(float) *
             static_cast<uint64_t>(CheckedMul(p.m, p.k, "A") + CheckedMul(p.k, p.n, "B") +
                                   CheckedMul(p.m, p.n, "C"));
  }
  RequireMemory(bytes, "bench gemm's operands");
  std::vector<Operands> operands;
  for (const auto& p : products) operands.push_back(MakeOperands(p));
  // The products are timed one after another in each repetition (so they share the time window).
  // Each repetition first runs a short FMA-loop probe (PeakProbeGflops), so every repetition's
  // rate can be compared with the peak of its own time window.
  std::vector<std::vector<double>> times(products.size());
  std::vector<double> rep_seconds, rep_probe;
  for (int r = -3; r < o.repeat; ++r) {
    const double probe = PeakProbeGflops();
    double rep = 0;
    for (size_t i = 0; i < products.size(); ++i) {
      double t0 = NowSeconds();
      RunProduct(products[i], operands[i]);
      const double dt = NowSeconds() - t0;
      rep += dt;
      if (r >= 0) times[i].push_back(dt);
    }
    if (r >= 0) {
      rep_seconds.push_back(rep);
      rep_probe.push_back(probe);
    }
  }
  double flop = 0, median_s = 0, min_s = 0, max_err = 0;
  std::vector<TimingStats> stats;
  for (size_t i = 0; i < products.size(); ++i) {
    const auto& p = products[i];
    flop += 2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
    stats.push_back(SummarizeTimes(times[i]));
    median_s += stats.back().median_s;
    min_s += stats.back().min_s;
    max_err = std::max(max_err, CheckRows(p, operands[i]));
  }
  const double gflops = flop / median_s / 1e9;
  // The limit, measured in the same run: one thread's FMA peak times the threads used.
  PeakFlops peak = MeasurePeakFlops();
  const double peak_total = peak.gflops * o.threads;
  // Median over repetitions of (the repetition's GEMM rate / the probe's rate just before it).
  std::vector<double> window_ratio;
  for (size_t r = 0; r < rep_seconds.size(); ++r) {
    window_ratio.push_back(flop / rep_seconds[r] / 1e9 / (rep_probe[r] * o.threads));
  }
  const double interleaved = SummarizeTimes(window_ratio).median_s;
  const std::string backend = kernels::GemmBackendName();
  const std::string warning = kernels::GemmBackendWarning();
  if (o.json) {
    nlohmann::json j = {{"op", o.expert.empty() ? "gemm" : "expert"},
                        {"m", o.m},
                        {"k", o.k},
                        {"n", o.n},
                        {"expert", o.expert},
                        {"threads", o.threads},
                        {"backend", backend},
                        {"backend_key", kernels::GemmBackendKey(kernels::ActiveGemmBackend())},
                        {"median_ms", median_s * 1e3},
                        {"min_ms", min_s * 1e3},
                        {"gflops", gflops},
                        {"gflops_best", flop / min_s / 1e9},
                        {"max_abs_err", max_err},
                        {"peak_gflops", peak_total},
                        {"peak_isa", peak.isa},
                        {"fraction_of_peak", gflops / peak_total},
                        {"fraction_of_peak_best", flop / min_s / 1e9 / peak_total},
                        {"fraction_of_peak_interleaved", interleaved},
                        {"warning", warning}};
    fmt::print("{}\n", j.dump());
    return 0;
  }
  if (o.expert.empty()) {
    fmt::print("gemm (M x K)(K x N) = ({} x {})({} x {}), {} thread(s), {} reps\n", o.m, o.k, o.k,
               o.n, o.threads, o.repeat);
  } else {
    fmt::print("expert GEMMs (C, M, H) = ({}), forward + backward, {} thread(s), {} reps\n",
               o.expert, o.threads, o.repeat);
    for (size_t i = 0; i < products.size(); ++i) {
      const auto& p = products[i];
      const double f =
          2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
      fmt::print("  {:<11} {}{} {:>5} x {:>5} x {:>5}  {:7.1f} GFLOP/s ({:.2f} of peak)\n", p.name,
                 p.ta == Trans::kYes ? 'T' : 'N', p.tb == Trans::kYes ? 'T' : 'N', p.m, p.n, p.k,
                 f / stats[i].median_s / 1e9, f / stats[i].median_s / 1e9 / peak_total);
    }
  }
  fmt::print("  median {:.3f} ms  best {:.3f} ms\n", median_s * 1e3, min_s * 1e3);
  fmt::print("  {:.1f} GFLOP/s (median), {:.1f} GFLOP/s (best)\n", gflops, flop / min_s / 1e9);
  fmt::print("  FMA peak ({}, measured now): {:.1f} GFLOP/s for {} thread(s) -> {:.0f}% of peak\n",
             peak.isa, peak_total, o.threads, 100.0 * gflops / peak_total);
  fmt::print(
      "  against the FMA loop run just before each repetition (same time window): {:.0f}% of "
      "peak (median of {} repetitions)\n",
      100.0 * interleaved, window_ratio.size());
  fmt::print("  max |err| vs reference on first rows: {:.2e}\n", max_err);
  fmt::print("  backend: {} [{}]\n", backend, kernels::GemmBackendReason());
  fmt::print("  cpu: {}\n", kernels::HostCpuFeatures().ToString());
  if (!warning.empty()) fmt::print("  {}\n", warning);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "gemm",
    "GFLOP/s of (M x K)(K x N) float32 GEMM (or one expert's GEMMs) on the chosen backend",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchGemmOptions>();
      AddIntOption(app, "--m", &o->m, int64_t{0}, int64_t{1} << 20, "rows of A and C");
      AddIntOption(app, "--k", &o->k, int64_t{0}, int64_t{1} << 20, "inner dimension");
      AddIntOption(app, "--n", &o->n, int64_t{0}, int64_t{1} << 20, "columns of B and C");
      app.add_option("--expert", o->expert,
                     "C,M,H: time one expert's six forward/backward GEMMs (C rows, model_dim M, "
                     "hidden_dim H) instead of one (M x K)(K x N) product");
      app.add_option("--backend", o->backend,
                     "onednn | openblas (default: chosen from the cpu's features; "
                     "SY_GEMM_BACKEND does the same for every command)");
      AddIntOption(app, "--threads", &o->threads, 1, 256, "GEMM threads");
      AddIntOption(app, "--repeat", &o->repeat, 1, 100000, "timed repetitions");
      app.add_flag("--json", o->json, "one JSON line instead of text");
      return [o] { return RunBenchGemm(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
