#include "cli/peak_flops.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cli/timing.h"

namespace switchyard::cli {
namespace {

// 12 independent accumulator registers hide the FMA latency (4-5 cycles x 2 ports). Explicit
// intrinsics: with generic vector code the compiler notices the lanes are equal and shrinks the
// loop, and the "peak" becomes fiction.
#define SY_FMA_BODY(VEC, SET1, FMA, ADD)                                                      \
  VEC m = SET1(0.999999f), c = SET1(1e-7f * seed);                                            \
  VEC a0 = SET1(seed), a1 = SET1(seed + 1), a2 = SET1(seed + 2), a3 = SET1(seed + 3);         \
  VEC a4 = SET1(seed + 4), a5 = SET1(seed + 5), a6 = SET1(seed + 6), a7 = SET1(seed + 7);     \
  VEC a8 = SET1(seed + 8), a9 = SET1(seed + 9), a10 = SET1(seed + 10), a11 = SET1(seed + 11); \
  for (long i = 0; i < iters; ++i) {                                                          \
    a0 = FMA(a0, m, c);                                                                       \
    a1 = FMA(a1, m, c);                                                                       \
    a2 = FMA(a2, m, c);                                                                       \
    a3 = FMA(a3, m, c);                                                                       \
    a4 = FMA(a4, m, c);                                                                       \
    a5 = FMA(a5, m, c);                                                                       \
    a6 = FMA(a6, m, c);                                                                       \
    a7 = FMA(a7, m, c);                                                                       \
    a8 = FMA(a8, m, c);                                                                       \
    a9 = FMA(a9, m, c);                                                                       \
    a10 = FMA(a10, m, c);                                                                     \
    a11 = FMA(a11, m, c);                                                                     \
  }                                                                                           \
  VEC s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));                  \
  s = ADD(s, ADD(ADD(a8, a9), ADD(a10, a11)));                                                \
  float out[sizeof(VEC) / 4];                                                                 \
  std::memcpy(out, &s, sizeof(out));                                                          \
  return out[0];

__attribute__((target("avx512f"))) float Avx512(long iters, float seed) {
  SY_FMA_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps)
}
__attribute__((target("avx2,fma"))) float Avx2(long iters, float seed) {
  SY_FMA_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps)
}
inline __m128 MulAdd(__m128 a, __m128 b, __m128 c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
float Sse(long iters, float seed) { SY_FMA_BODY(__m128, _mm_set1_ps, MulAdd, _mm_add_ps) }

#undef SY_FMA_BODY

}  // namespace

namespace {

struct FmaLoop {
  float (*fn)(long, float) = Sse;
  int lanes = 4;
  const char* isa = "sse";
};

const FmaLoop& HostFmaLoop() {
  static const FmaLoop loop = [] {
    FmaLoop l;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
      l = {Avx512, 16, "avx512f"};
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      l = {Avx2, 8, "avx2+fma"};
    }
    return l;
  }();
  return loop;
}

// One round of `iters` iterations: GFLOP/s (one FMA, or mul + add, per lane = 2 flops).
double FmaRound(long iters, int seed) {
  const FmaLoop& l = HostFmaLoop();
  volatile float sink = 0;
  const double t0 = NowSeconds();
  sink = sink + l.fn(iters, static_cast<float>(seed));
  const double dt = NowSeconds() - t0;
  return 2.0 * 12 * l.lanes * static_cast<double>(iters) / dt / 1e9;
}

}  // namespace

PeakFlops MeasurePeakFlops(double seconds) {
  PeakFlops result;
  result.isa = HostFmaLoop().isa;
  double end = NowSeconds() + seconds;
  double best = 0;
  int rounds = 0;
  while (NowSeconds() < end || rounds < 3) {
    best = std::max(best, FmaRound(1'000'000, rounds));
    ++rounds;
  }
  result.gflops = best;
  return result;
}

double PeakProbeGflops() { return FmaRound(1'000'000, 7); }

}  // namespace switchyard::cli
