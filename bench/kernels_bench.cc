// Micro-benchmarks of the gating kernels at MoE shapes: rows = tokens, cols = experts or model_dim.
//   build/release/bench/kernels_bench --benchmark_min_time=0.2
#include <benchmark/benchmark.h>

#include <tuple>
#include <vector>

#include "switchyard/core/rng.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/kernels/packed_gemm.h"

namespace switchyard::kernels {
namespace {

std::vector<float> Random(size_t n) {
  CounterRng rng(1, kStreamData);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = rng.Uniform(i) * 4 - 2;
  return v;
}

void BM_SoftmaxRows(benchmark::State& state) {
  int64_t rows = state.range(0), cols = state.range(1);
  auto x = Random(static_cast<size_t>(rows * cols));
  std::vector<float> y(x.size());
  for (auto _ : state) {
    SoftmaxRows(x.data(), y.data(), rows, cols);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(state.iterations() * rows * cols * 8);
}
BENCHMARK(BM_SoftmaxRows)->Args({4096, 8})->Args({2048, 64});

void BM_TopK(benchmark::State& state) {
  int64_t rows = state.range(0), cols = state.range(1), k = state.range(2);
  auto x = Random(static_cast<size_t>(rows * cols));
  std::vector<int32_t> idx(static_cast<size_t>(rows * k));
  std::vector<float> val(idx.size());
  for (auto _ : state) {
    TopK(x.data(), rows, cols, k, idx.data(), val.data());
    benchmark::DoNotOptimize(idx.data());
  }
  state.SetItemsProcessed(state.iterations() * rows);
}
BENCHMARK(BM_TopK)->Args({4096, 8, 2})->Args({2048, 64, 1})->Args({8192, 16, 2});

void BM_GatherRows(benchmark::State& state) {
  int64_t rows = state.range(0), cols = state.range(1);
  auto src = Random(static_cast<size_t>(rows * cols));
  std::vector<int32_t> idx(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    idx[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % rows);
  std::vector<float> dst(src.size());
  for (auto _ : state) {
    GatherRows(src.data(), rows, cols, idx.data(), nullptr, rows, dst.data());
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(state.iterations() * rows * cols * 8);
}
BENCHMARK(BM_GatherRows)->Args({4096, 512})->Args({8192, 1024});

void BM_ScatterAddRows(benchmark::State& state) {
  int64_t rows = state.range(0), cols = state.range(1);
  auto src = Random(static_cast<size_t>(rows * cols));
  std::vector<int32_t> idx(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    idx[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % rows);
  auto scale = Random(static_cast<size_t>(rows));
  std::vector<float> dst(src.size());
  for (auto _ : state) {
    ScatterAddRows(src.data(), rows, cols, idx.data(), scale.data(), dst.data(), rows);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(state.iterations() * rows * cols * 12);
}
BENCHMARK(BM_ScatterAddRows)->Args({4096, 512});

void BM_ActivationGelu(benchmark::State& state) {
  auto x = Random(static_cast<size_t>(state.range(0)));
  std::vector<float> y(x.size());
  for (auto _ : state) {
    ActivationForward(Activation::kGelu, x.data(), y.data(), state.range(0));
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_ActivationGelu)->Arg(1 << 20)->Arg(1 << 14);

void BM_ActivationGeluBackward(benchmark::State& state) {
  auto x = Random(static_cast<size_t>(state.range(0)));
  auto dy = Random(x.size());
  std::vector<float> dx(x.size());
  for (auto _ : state) {
    ActivationBackward(Activation::kGelu, x.data(), dy.data(), dx.data(), state.range(0));
    benchmark::DoNotOptimize(dx.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_ActivationGeluBackward)->Arg(1 << 20)->Arg(1 << 14);

void BM_GroupedGemmVsLoop(benchmark::State& state) {
  // 64 experts x 32 tokens, M = 256, H = 1024 (config C of docs/PERFORMANCE.md, "MoE layer on one
  // rank").
  const int64_t groups = 64, m = 32, k = 256, n = 1024;
  auto a = Random(static_cast<size_t>(groups * m * k));
  auto b = Random(static_cast<size_t>(groups * n * k));
  std::vector<float> c(static_cast<size_t>(groups * m * n));
  int threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    BatchedGemm(Trans::kNo, Trans::kYes, groups, m, n, k, 1.0f, a.data(), k, m * k, b.data(), k,
                n * k, 0.0f, c.data(), n, m * n, threads);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * groups * m * n * k * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_GroupedGemmVsLoop)->Arg(1)->Arg(2)->UseRealTime();

// One expert product of the expert FFN at its shapes: form 0 = NT (forward X W^T), 1 = NN (data
// gradient dY W), 2 = TN (weight gradient dY^T X); kernel 0 = kernels::Gemm (the GEMM backend),
// 1 = kernels::PackedGemm. Process CPU time (the machine is shared): compare the two kernels'
// GFLOP/s in the same run, e.g. --benchmark_filter=ExpertGemm --benchmark_min_time=0.3
void BM_ExpertGemm(benchmark::State& state) {
  const int64_t form = state.range(0), m = state.range(1), n = state.range(2), k = state.range(3);
  const bool packed = state.range(4) == 1;
  if (packed && !PackedGemmAvailable()) {
    state.SkipWithError("no AVX2/FMA");
    return;
  }
  const Trans ta = form == 2 ? Trans::kYes : Trans::kNo, tb = form == 0 ? Trans::kYes : Trans::kNo;
  auto a = Random(static_cast<size_t>(m * k));
  auto b = Random(static_cast<size_t>(n * k));
  std::vector<float> c(static_cast<size_t>(m * n));
  const GemmProblem p{
      m, n, k, a.data(), ta == Trans::kNo ? k : m, b.data(), tb == Trans::kNo ? n : k, c.data(), n};
  for (auto _ : state) {
    if (packed) {
      PackedGemm(ta, tb, p, 1.0f, 0.0f);
    } else {
      Gemm(ta, tb, m, n, k, 1.0f, p.a, p.lda, p.b, p.ldb, 0.0f, p.c, p.ldc);
    }
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(m * n * k) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}
// Layer F's products (model 512, expert hidden 256, ~512 rows per expert), layer A's (model 512,
// hidden 2048, 1024 rows) and layer C's (model 256, hidden 1024, 32 rows: the few-row bound of
// docs/PERFORMANCE.md), each on both kernels.
void ExpertShapes(benchmark::internal::Benchmark* b) {
  for (int64_t kernel : {0, 1}) {
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{512, 256, 512},
                           {512, 512, 256},
                           {64, 256, 512},
                           {1024, 2048, 512},
                           {32, 1024, 256},
                           {32, 256, 1024}}) {
      b->Args({0, m, n, k, kernel});
      b->Args({1, m, n, k, kernel});
      b->Args({2, n, k, m, kernel});  // weight gradient [n, k] over the expert's m rows
    }
  }
}
BENCHMARK(BM_ExpertGemm)->Apply(ExpertShapes)->MeasureProcessCPUTime();

}  // namespace
}  // namespace switchyard::kernels
