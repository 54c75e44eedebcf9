// The GEMM backend candidates of docs/PERFORMANCE.md ("GEMM backends") side by side on the expert
// shapes, interleaved in one run: OpenBLAS (cblas_sgemm, whatever core it picked -- set
// OPENBLAS_CORETYPE to force one), oneDNN (dnnl_sgemm), BLIS (bli_sgemm), libxsmm (libxsmm_sgemm)
// and switchyard's small-GEMM kernels (AVX-512: kernels/small_gemm.h; AVX2: moe/grouped_gemm.h).
// For each layer config of docs/PERFORMANCE.md it times one expert's six forward/backward products
// (C rows, model_dim M, hidden_dim H) and prints each candidate's fraction of the FMA peak measured
// in the same run (best of the repetitions: on a shared machine the best is the least disturbed).
// Built only when BLIS and libxsmm are installed (libblis-dev, libxsmm-dev); not part of
// switchyard.
//   build/release/bench/gemm_candidates [repeats]
#include <blis.h>
#include <cblas.h>
#include <immintrin.h>
#include <libxsmm.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

// OpenBLAS's own functions (blis.h brings BLIS's cblas.h, whose include guard hides OpenBLAS's).
extern "C" void openblas_set_num_threads(int num_threads);
extern "C" char* openblas_get_corename(void);

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "switchyard/kernels/gemm_backend.h"
#include "switchyard/kernels/small_gemm.h"
#include "switchyard/moe/grouped_gemm.h"

namespace {

using switchyard::kernels::GemmProblem;
using switchyard::kernels::Trans;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

__attribute__((target("avx512f"))) float FmaLoop512(long iters, float seed) {
  __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f * seed), a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(a[j], m, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  float out[16];
  std::memcpy(out, &s, sizeof(out));
  return out[0];
}

__attribute__((target("avx2,fma"))) float FmaLoop256(long iters, float seed) {
  __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f * seed), a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(seed + static_cast<float>(i));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], m, c);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  float out[8];
  std::memcpy(out, &s, sizeof(out));
  return out[0];
}

// One core's float32 FMA peak (GFLOP/s), best of a few rounds.
double PeakGflops() {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const double lanes = avx512 ? 16 : 8;
  double best = 0;
  volatile float sink = 0;
  for (int r = 0; r < 8; ++r) {
    double t = Now();
    sink = sink + (avx512 ? FmaLoop512(1000000, static_cast<float>(r))
                          : FmaLoop256(1000000, static_cast<float>(r)));
    best = std::max(best, 2.0 * 12 * lanes * 1e6 / (Now() - t) / 1e9);
  }
  return best;
}

struct Product {
  Trans ta, tb;
  long m, n, k;
};

enum Candidate { kOpenBlas, kOneDnn, kBlis, kXsmm, kOwnAvx512, kOwnAvx2, kCandidates };
const char* kNames[kCandidates] = {"openblas", "onednn", "blis", "libxsmm", "sy-avx512", "sy-avx2"};

void Run(int cand, const Product& p, const float* a, const float* b, float* c) {
  const long lda = p.ta == Trans::kNo ? p.k : p.m, ldb = p.tb == Trans::kNo ? p.n : p.k;
  const bool ta = p.ta == Trans::kYes, tb = p.tb == Trans::kYes;
  switch (cand) {
    case kOpenBlas:
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                  static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1.0f, a,
                  static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f, c, static_cast<int>(p.n));
      break;
    case kOneDnn:
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', p.m, p.n, p.k, 1.0f, a, lda, b, ldb, 0.0f, c, p.n);
      break;
    case kBlis: {
      float one = 1.0f, zero = 0.0f;
      // Transposes as strides: op(A)(i, l) at a[i * rsa + l * csa].
      bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, p.m, p.n, p.k, &one, const_cast<float*>(a),
                ta ? 1 : lda, ta ? lda : 1, const_cast<float*>(b), tb ? 1 : ldb, tb ? ldb : 1,
                &zero, c, p.n, 1);
      break;
    }
    case kXsmm: {
      // Column-major: C^T = op(B)^T op(A)^T.
      const float one = 1.0f, zero = 0.0f;
      const libxsmm_blasint m = p.n, n = p.m, k = p.k, la = ldb, lb = lda, lc = p.n;
      const char tra = tb ? 'T' : 'N', trb = ta ? 'T' : 'N';
      libxsmm_sgemm(&tra, &trb, &m, &n, &k, &one, b, &la, a, &lb, &zero, c, &lc);
      break;
    }
    case kOwnAvx512: {
      GemmProblem q{p.m, p.n, p.k, a, lda, b, ldb, c, p.n};
      switchyard::kernels::SmallGemmAvx512(p.ta, p.tb, q, 1.0f, 0.0f);
      break;
    }
    case kOwnAvx2: {
      GemmProblem q{p.m, p.n, p.k, a, lda, b, ldb, c, p.n};
      switchyard::moe::SmallGemm(p.ta, p.tb, q, 1.0f, 0.0f, switchyard::moe::SmallGemmIsa::kAvx2);
      break;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  openblas_set_num_threads(1);
  omp_set_num_threads(1);
  bli_thread_set_num_threads(1);
  libxsmm_init();
  const bool own = switchyard::kernels::SmallGemmAvx512Available();
  const bool own2 = switchyard::moe::SmallGemmAvailable();
  std::printf(
      "one thread; OpenBLAS core %s, oneDNN %s, BLIS arch %s, libxsmm target %s\n",
      openblas_get_corename(),
      switchyard::kernels::GemmBackendName(switchyard::kernels::GemmBackend::kOneDnn).c_str(),
      bli_arch_string(bli_arch_query_id()), libxsmm_get_target_arch());
  struct Config {
    const char* name;
    long c, m, h;
  };
  const Config configs[] = {{"gemm 256x512x2048 (NN)", 0, 0, 0},
                            {"A: C 1280, M 512, H 2048", 1280, 512, 2048},
                            {"B: C 1024, M 1024, H 4096", 1024, 1024, 4096},
                            {"C: C 32, M 256, H 1024", 32, 256, 1024}};
  // 64-byte aligned operands, as switchyard's Tensors are: with power-of-two leading dimensions
  // the alignment decides whether rows alias in the caches (oneDNN's avx2 sgemm falls from ~0.8
  // to ~0.45 of the peak at 256 x 512 x 2048 when its operands are aligned, docs/PERFORMANCE.md).
  auto aligned = [](size_t n) {
    return std::unique_ptr<float[], void (*)(float*)>(
        static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))),
        [](float* p) { std::free(p); });
  };
  const size_t len = size_t{1} << 23;
  auto a_buf = aligned(len), b_buf = aligned(len), c_buf = aligned(len);
  float *a = a_buf.get(), *b = b_buf.get(), *c = c_buf.get();
  std::fill_n(c, len, 0.0f);
  for (size_t i = 0; i < len; ++i) {
    a[i] = static_cast<float>(i % 97) * 0.01f - 0.4f;
    b[i] = static_cast<float>(i % 89) * 0.01f - 0.4f;
  }
  for (const auto& cfg : configs) {
    std::vector<Product> ps;
    if (cfg.c == 0) {
      ps = {{Trans::kNo, Trans::kNo, 256, 2048, 512}};
    } else {
      ps = {{Trans::kNo, Trans::kYes, cfg.c, cfg.h, cfg.m},
            {Trans::kNo, Trans::kYes, cfg.c, cfg.m, cfg.h},
            {Trans::kYes, Trans::kNo, cfg.m, cfg.h, cfg.c},
            {Trans::kNo, Trans::kNo, cfg.c, cfg.h, cfg.m},
            {Trans::kYes, Trans::kNo, cfg.h, cfg.m, cfg.c},
            {Trans::kNo, Trans::kNo, cfg.c, cfg.m, cfg.h}};
    }
    double flop = 0;
    for (const auto& p : ps) flop += 2.0 * p.m * p.n * p.k;
    // Enough calls per timing that each lasts ~20 ms.
    const int inner = std::max(1, static_cast<int>(2e9 / flop / 50));
    std::vector<std::vector<double>> best(kCandidates, std::vector<double>(ps.size(), 1e30));
    for (int r = 0; r <= repeats; ++r) {
      for (int cand = 0; cand < kCandidates; ++cand) {
        if ((cand == kOwnAvx512 && !own) || (cand == kOwnAvx2 && !own2)) continue;
        for (size_t i = 0; i < ps.size(); ++i) {
          const double t = Now();
          for (int q = 0; q < inner; ++q) Run(cand, ps[i], a, b, c);
          if (r > 0) best[cand][i] = std::min(best[cand][i], (Now() - t) / inner);
        }
      }
    }
    const double peak = PeakGflops();
    std::printf("%s, FMA peak %.1f GFLOP/s (one core, measured now)\n", cfg.name, peak);
    for (int cand = 0; cand < kCandidates; ++cand) {
      if ((cand == kOwnAvx512 && !own) || (cand == kOwnAvx2 && !own2)) continue;
      double total = 0;
      for (double t : best[cand]) total += t;
      std::printf("  %-9s %6.1f GFLOP/s  %.2f of peak  per product:", kNames[cand],
                  flop / total / 1e9, flop / total / 1e9 / peak);
      for (size_t i = 0; i < ps.size(); ++i) {
        std::printf(" %c%c %.2f", ps[i].ta == Trans::kYes ? 'T' : 'N',
                    ps[i].tb == Trans::kYes ? 'T' : 'N',
                    2.0 * ps[i].m * ps[i].n * ps[i].k / best[cand][i] / 1e9 / peak);
      }
      std::printf("\n");
    }
    std::fflush(stdout);
  }
  return 0;
}
