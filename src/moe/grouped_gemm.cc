#include "switchyard/moe/grouped_gemm.h"

#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/kernels/packed_gemm.h"
#include "switchyard/kernels/small_gemm.h"

// Functions compiled for AVX2 + FMA whatever the build's -march; called only after the run-time
// check.
#define SY_AVX2 __attribute__((target("avx2,fma")))

namespace switchyard::moe {
namespace {

using kernels::GemmProblem;
using kernels::Trans;

// Lanes [0, n) set, n in [0, 8].
SY_AVX2 inline __m256i TailMask(int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lanes);
}

SY_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// ---- NT: C[i, j] = dot(A[i, 0:k], B[j, 0:k]) on an MR x NR tile (MR * NR + NR + 1 <= 16 ymm).
template <int MR, int NR>
SY_AVX2 void DotTile(int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                     int64_t ldc, float alpha, float beta) {
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 bv[NR];
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) bv[j] = _mm256_loadu_ps(b + j * ldb + kk);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      __m256 av = _mm256_loadu_ps(a + i * lda + kk);
#pragma GCC unroll 3
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  if (kk < k) {
    const __m256i mask = TailMask(k - kk);
    __m256 bv[NR];
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) bv[j] = _mm256_maskload_ps(b + j * ldb + kk, mask);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      __m256 av = _mm256_maskload_ps(a + i * lda + kk, mask);
#pragma GCC unroll 3
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) {
      float v = alpha * HorizontalSum(acc[i][j]);
      float* cp = c + i * ldc + j;
      *cp = beta == 0.0f ? v : v + beta * *cp;
    }
  }
}

constexpr int kDotMr = 4, kDotNr = 3;
using DotFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                       float, float);
constexpr DotFn kDotTiles[kDotMr][kDotNr] = {
    {DotTile<1, 1>, DotTile<1, 2>, DotTile<1, 3>},
    {DotTile<2, 1>, DotTile<2, 2>, DotTile<2, 3>},
    {DotTile<3, 1>, DotTile<3, 2>, DotTile<3, 3>},
    {DotTile<4, 1>, DotTile<4, 2>, DotTile<4, 3>},
};

SY_AVX2 void GemmNT(const GemmProblem& p, float alpha, float beta) {
  // B rows (3 at a time) stay in L1 while every A row block passes over them.
  for (int64_t j0 = 0; j0 < p.n; j0 += kDotNr) {
    int64_t nr = std::min<int64_t>(kDotNr, p.n - j0);
    for (int64_t i0 = 0; i0 < p.m; i0 += kDotMr) {
      int64_t mr = std::min<int64_t>(kDotMr, p.m - i0);
      kDotTiles[mr - 1][nr - 1](p.k, p.a + i0 * p.lda, p.lda, p.b + j0 * p.ldb, p.ldb,
                                p.c + i0 * p.ldc + j0, p.ldc, alpha, beta);
    }
  }
}

// ---- NN / TN: C[i, 0:16] += A(i, kk) * B[kk, 0:16] on an MR x 16 tile; A(i, kk) is at
// a[i * a_rs + kk * a_cs]. kFull: all 16 columns exist; otherwise the first `nr`.
template <int MR, bool kFull>
SY_AVX2 void BroadcastTile(int64_t k, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                           int64_t ldb, float* c, int64_t ldc, int64_t nr, float alpha,
                           float beta) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  if (!kFull) {
    m0 = TailMask(std::min<int64_t>(nr, 8));
    m1 = TailMask(std::max<int64_t>(nr - 8, 0));
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* br = b + kk * ldb;
    __m256 b0 = kFull ? _mm256_loadu_ps(br) : _mm256_maskload_ps(br, m0);
    __m256 b1 = kFull ? _mm256_loadu_ps(br + 8) : _mm256_maskload_ps(br + 8, m1);
    const float* ak = a + kk * a_cs;
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      __m256 av = _mm256_broadcast_ss(ak + i * a_rs);
      acc0[i] = _mm256_fmadd_ps(av, b0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(av, b1, acc1[i]);
    }
  }
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  // Every loop over the tile is unrolled so the accumulators stay in registers (a rolled loop
  // here makes GCC keep them in memory and store them on every k step).
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    float* cr = c + i * ldc;
    __m256 r0 = _mm256_mul_ps(va, acc0[i]), r1 = _mm256_mul_ps(va, acc1[i]);
    if (kFull) {
      if (beta != 0.0f) {
        r0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(cr), r0);
        r1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(cr + 8), r1);
      }
      _mm256_storeu_ps(cr, r0);
      _mm256_storeu_ps(cr + 8, r1);
    } else {
      if (beta != 0.0f) {
        r0 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(cr, m0), r0);
        r1 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(cr + 8, m1), r1);
      }
      _mm256_maskstore_ps(cr, m0, r0);
      _mm256_maskstore_ps(cr + 8, m1, r1);
    }
  }
}

constexpr int kBcastMr = 6, kBcastNr = 16;
using BcastFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                         int64_t, int64_t, float, float);
constexpr BcastFn kBcastTiles[2][kBcastMr] = {
    {BroadcastTile<1, false>, BroadcastTile<2, false>, BroadcastTile<3, false>,
     BroadcastTile<4, false>, BroadcastTile<5, false>, BroadcastTile<6, false>},
    {BroadcastTile<1, true>, BroadcastTile<2, true>, BroadcastTile<3, true>, BroadcastTile<4, true>,
     BroadcastTile<5, true>, BroadcastTile<6, true>},
};

// NN: reading a 16-column panel of B steps through memory by ldb per k, which defeats the
// hardware prefetchers. So B is first repacked in one sequential pass into panels [n / 16][k][16]
// (each panel contiguous), which the row blocks of A then read from cache.
SY_AVX2 void GemmNN(const GemmProblem& p, float alpha, float beta) {
  thread_local std::vector<float> packed;
  const int64_t panels = (p.n + kBcastNr - 1) / kBcastNr;
  const int64_t panel_size = p.k * kBcastNr;
  packed.resize(static_cast<size_t>(panels * panel_size));
  const int64_t full_panels = p.n / kBcastNr;
  const int64_t rest = p.n - full_panels * kBcastNr;
  const __m256i m0 = TailMask(std::min<int64_t>(rest, 8)),
                m1 = TailMask(std::max<int64_t>(rest - 8, 0));
  for (int64_t kk = 0; kk < p.k; ++kk) {
    const float* src = p.b + kk * p.ldb;
    float* dst = packed.data() + kk * kBcastNr;
    for (int64_t q = 0; q < full_panels; ++q) {
      _mm256_storeu_ps(dst + q * panel_size, _mm256_loadu_ps(src + q * kBcastNr));
      _mm256_storeu_ps(dst + q * panel_size + 8, _mm256_loadu_ps(src + q * kBcastNr + 8));
    }
    if (rest > 0) {
      const float* s = src + full_panels * kBcastNr;
      float* d = dst + full_panels * panel_size;
      _mm256_storeu_ps(d, _mm256_maskload_ps(s, m0));
      _mm256_storeu_ps(d + 8, _mm256_maskload_ps(s + 8, m1));
    }
  }
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t j0 = q * kBcastNr;
    const int64_t nr = std::min<int64_t>(kBcastNr, p.n - j0);
    const float* panel = packed.data() + q * panel_size;
    for (int64_t i0 = 0; i0 < p.m; i0 += kBcastMr) {
      int64_t mr = std::min<int64_t>(kBcastMr, p.m - i0);
      kBcastTiles[nr == kBcastNr][mr - 1](p.k, p.a + i0 * p.lda, p.lda, 1, panel, kBcastNr,
                                          p.c + i0 * p.ldc + j0, p.ldc, nr, alpha, beta);
    }
  }
}

// TN (weight gradients, k = the expert's rows is small): row blocks outside, so C [m, n] is
// written row after row and the small B (k x n) stays in cache.
SY_AVX2 void GemmTN(const GemmProblem& p, float alpha, float beta) {
  for (int64_t i0 = 0; i0 < p.m; i0 += kBcastMr) {
    int64_t mr = std::min<int64_t>(kBcastMr, p.m - i0);
    for (int64_t j0 = 0; j0 < p.n; j0 += kBcastNr) {
      int64_t nr = std::min<int64_t>(kBcastNr, p.n - j0);
      kBcastTiles[nr == kBcastNr][mr - 1](p.k, p.a + i0, 1, p.lda, p.b + j0, p.ldb,
                                          p.c + i0 * p.ldc + j0, p.ldc, nr, alpha, beta);
    }
  }
}

// Which kernel runs a problem: kernels::Gemm (nullopt) or SmallGemm with the given ISA. The
// limits are the measured crossovers against the active GEMM backend (grouped_gemm.h).
std::optional<SmallGemmIsa> SmallKernelFor(Trans trans_a, Trans trans_b, const GemmProblem& p) {
  if (!SmallGemmAvailable()) return std::nullopt;
  const bool nt = trans_a == Trans::kNo && trans_b == Trans::kYes;
  if (kernels::ActiveGemmBackend() == kernels::GemmBackend::kOneDnn) {
    // oneDNN is as fast or faster on NN and TN; on NT its small-m path is slow.
    if (!nt) return std::nullopt;
    if (p.m <= kSmallGemmAvx2MaxRowsOneDnn) return SmallGemmIsa::kAvx2;
    if (p.m <= kSmallGemmAvx512MaxRows && kernels::SmallGemmAvx512Available()) {
      return SmallGemmIsa::kAvx512;
    }
    return std::nullopt;
  }
  bool small = false;
  if (trans_b == Trans::kYes) {
    small = trans_a == Trans::kNo && p.m <= kSmallGemmMaxRows;
  } else {
    small = trans_a == Trans::kNo ? p.m <= kSmallGemmMaxRows : p.k <= kSmallGemmMaxInner;
  }
  if (!small) return std::nullopt;
  return SmallGemmIsa::kAvx2;
}

// Whether a problem runs on kernels::PackedGemm instead of the few-row kernels or the GEMM
// backend (grouped_gemm.h, ExpertGemmKernel).
bool UsePacked(const GemmProblem& p) {
  if (ActiveExpertGemmKernel() != ExpertGemmKernel::kPacked) return false;
  const int64_t lo = std::min({p.m, p.n, p.k}), hi = std::max({p.m, p.n, p.k});
  return lo >= kPackedGemmMinDim && hi <= kPackedGemmMaxDim;
}

std::atomic<int> forced_expert_kernel{-1};  // -1: not forced (SetExpertGemmKernel)

}  // namespace

ExpertGemmKernel DefaultExpertGemmKernel() {
  // The packed kernel was measured ahead of OpenBLAS's AVX2 kernels on layer F's expert products
  // (docs/PERFORMANCE.md, "Fine-grained experts"); on
  // AVX-512 CPUs the backend is oneDNN with AVX-512 kernels, which it does not try to beat. A
  // GEMM budget above one thread keeps the backend (it splits one product over the threads).
  if (!kernels::PackedGemmAvailable() || kernels::SmallGemmAvx512Available()) {
    return ExpertGemmKernel::kBackend;
  }
  if (kernels::ActiveGemmBackend() != kernels::GemmBackend::kOpenBlas) {
    return ExpertGemmKernel::kBackend;
  }
  return ExpertGemmKernel::kPacked;
}

ExpertGemmKernel ActiveExpertGemmKernel() {
  const int forced = forced_expert_kernel.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<ExpertGemmKernel>(forced);
  static const ExpertGemmKernel chosen = [] {
    const char* env = std::getenv("SY_EXPERT_GEMM");
    if (env != nullptr && *env != '\0') return ParseExpertGemmKernel("SY_EXPERT_GEMM", env);
    return DefaultExpertGemmKernel();
  }();
  if (chosen == ExpertGemmKernel::kPacked && kernels::BlasThreads() > 1) {
    return ExpertGemmKernel::kBackend;
  }
  return chosen;
}

void SetExpertGemmKernel(ExpertGemmKernel kernel) {
  SY_REQUIRE(kernel != ExpertGemmKernel::kPacked || kernels::PackedGemmAvailable(), InvalidArgument,
             "expert GEMM kernel packed: needs AVX2 and FMA, which this CPU lacks");
  forced_expert_kernel.store(static_cast<int>(kernel), std::memory_order_relaxed);
}

ExpertGemmKernel ParseExpertGemmKernel(std::string_view what, std::string_view name) {
  if (name == "packed") {
    SY_REQUIRE(kernels::PackedGemmAvailable(), InvalidArgument,
               "{}=packed: the packed kernel needs AVX2 and FMA, which this CPU lacks", what);
    return ExpertGemmKernel::kPacked;
  }
  if (name == "backend") return ExpertGemmKernel::kBackend;
  throw InvalidArgument(
      fmt::format("{}: expected packed or backend, got '{}'", what, std::string(name)));
}

const char* ExpertGemmKernelName() {
  return ActiveExpertGemmKernel() == ExpertGemmKernel::kPacked
             ? "packed avx2 6x16"
             : kernels::GemmBackendKey(kernels::ActiveGemmBackend());
}

bool SmallGemmAvailable() {
  static const bool available = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return available;
}

const char* SmallGemmIsaName() { return kernels::SmallGemmAvx512Available() ? "avx512" : "avx2"; }

void SmallGemm(Trans trans_a, Trans trans_b, const GemmProblem& p, float alpha, float beta,
               SmallGemmIsa isa) {
  SY_CHECK(SmallGemmAvailable(), "SmallGemm needs AVX2 and FMA");
  if (isa == SmallGemmIsa::kAvx512 ||
      (isa == SmallGemmIsa::kBest && kernels::SmallGemmAvx512Available())) {
    kernels::SmallGemmAvx512(trans_a, trans_b, p, alpha, beta);
    return;
  }
  SY_REQUIRE(p.m >= 0 && p.n >= 0 && p.k >= 0, InvalidArgument,
             "SmallGemm: negative size m={} n={} k={}", p.m, p.n, p.k);
  if (p.m == 0 || p.n == 0) return;
  if (p.k == 0) {
    // C = beta * C (as kernels::Gemm does).
    kernels::Gemm(trans_a, trans_b, p.m, p.n, 0, alpha, p.a, p.lda, p.b, p.ldb, beta, p.c, p.ldc);
    return;
  }
  if (trans_a == Trans::kNo && trans_b == Trans::kYes) {
    GemmNT(p, alpha, beta);
  } else if (trans_a == Trans::kNo && trans_b == Trans::kNo) {
    GemmNN(p, alpha, beta);
  } else if (trans_a == Trans::kYes && trans_b == Trans::kNo) {
    GemmTN(p, alpha, beta);
  } else {
    throw InvalidArgument("SmallGemm: A^T B^T is not supported");
  }
}

namespace {

// One product through the grouped GEMM's choice of kernel.
void RunExpertProduct(Trans trans_a, Trans trans_b, float alpha, float beta, const GemmProblem& p,
                      const kernels::TileEpilogue* epilogue = nullptr) {
  if (UsePacked(p)) {
    kernels::PackedGemm(trans_a, trans_b, p, alpha, beta, epilogue);
    return;
  }
  if (auto isa = SmallKernelFor(trans_a, trans_b, p)) {
    SmallGemm(trans_a, trans_b, p, alpha, beta, *isa);
  } else {
    kernels::Gemm(trans_a, trans_b, p.m, p.n, p.k, alpha, p.a, p.lda, p.b, p.ldb, beta, p.c, p.ldc);
  }
  if (epilogue != nullptr && p.m > 0 && p.n > 0) epilogue->fn(epilogue->ctx, 0, 0, p.m, p.n);
}

// Two products sharing an operand: one fused packed pass when both would run on the packed
// kernel, else each through the grouped GEMM's choice.
void RunExpertPair(Trans trans_a, Trans trans_b, float alpha, float beta, const GemmProblem& p1,
                   const GemmProblem& p2, SharedOperand shared,
                   const kernels::TileEpilogue* epilogue = nullptr) {
  SY_REQUIRE(epilogue == nullptr || (shared == SharedOperand::kA && p1.n == p2.n), InvalidArgument,
             "ExpertGemmPair: an epilogue needs a shared A and products of the same n, got "
             "n={}/{}",
             p1.n, p2.n);
  if (!UsePacked(p1) || !UsePacked(p2)) {
    RunExpertProduct(trans_a, trans_b, alpha, beta, p1);
    RunExpertProduct(trans_a, trans_b, alpha, beta, p2, epilogue);
  } else if (shared == SharedOperand::kA) {
    kernels::PackedGemmSharedA(trans_a, trans_b, p1, p2, alpha, beta, epilogue);
  } else {
    kernels::PackedGemmSharedB(trans_a, trans_b, p1, p2, alpha, beta);
  }
}

// run(i) for i in [0, count), largest cost first, spread over `threads` threads when the GEMM
// budget (kernels::BlasThreads) is one thread (as kernels::GroupedGemm does).
template <typename Cost, typename Run>
void ForEachProblem(size_t count, int threads, Cost&& cost, Run&& run) {
  int workers = std::min<int>(threads, static_cast<int>(count));
  if (workers <= 1 || kernels::BlasThreads() > 1) {
    for (size_t i = 0; i < count; ++i) run(i);
    return;
  }
  std::vector<size_t> order(count);
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost(x) > cost(y); });
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  auto worker = [&](int w) {
    try {
      for (size_t i; (i = next.fetch_add(1)) < order.size();) run(order[i]);
    } catch (...) {
      errors[static_cast<size_t>(w)] = std::current_exception();
    }
  };
  {
    std::vector<std::jthread> pool;
    for (int t = 1; t < workers; ++t) pool.emplace_back(worker, t);
    worker(0);
  }
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

int64_t Cost(const GemmProblem& p) { return p.m * p.n * p.k; }

}  // namespace

void ExpertGroupedGemm(Trans trans_a, Trans trans_b, float alpha, float beta,
                       std::span<const GemmProblem> problems, int threads) {
  ForEachProblem(
      problems.size(), threads, [&](size_t i) { return Cost(problems[i]); },
      [&](size_t i) { RunExpertProduct(trans_a, trans_b, alpha, beta, problems[i]); });
}

void ExpertGemmPair(Trans trans_a, Trans trans_b, float alpha, float beta, const GemmProblem& p1,
                    const GemmProblem& p2, SharedOperand shared,
                    const kernels::TileEpilogue* epilogue) {
  RunExpertPair(trans_a, trans_b, alpha, beta, p1, p2, shared, epilogue);
}

void ExpertGemm(Trans trans_a, Trans trans_b, float alpha, float beta, const GemmProblem& p,
                const kernels::TileEpilogue* epilogue) {
  RunExpertProduct(trans_a, trans_b, alpha, beta, p, epilogue);
}

void ExpertGroupedGemmPairs(Trans trans_a, Trans trans_b, float alpha, float beta,
                            std::span<const GemmProblem> first, std::span<const GemmProblem> second,
                            SharedOperand shared, int threads) {
  SY_REQUIRE(first.size() == second.size(), InvalidArgument,
             "ExpertGroupedGemmPairs: {} first products but {} second", first.size(),
             second.size());
  ForEachProblem(
      first.size(), threads, [&](size_t i) { return Cost(first[i]) + Cost(second[i]); },
      [&](size_t i) { RunExpertPair(trans_a, trans_b, alpha, beta, first[i], second[i], shared); });
}

}  // namespace switchyard::moe
