// The byte copy of the comm layer: memcpy, except where glibc's memcpy is pathological.
//
// For copies of a few KiB to 1 MiB glibc uses `rep movsb`, which on this machine runs at under
// 1 GB/s (instead of 10-70) when the destination lies 1..127 bytes past the source modulo 4 KiB
// (4K aliasing) -- easily the case for two heap blocks allocated one after the other. There we
// copy with an explicit vector loop instead (docs/algorithms.md, "Copies").
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace switchyard::comm {

inline void CopyBytes(void* dst, const void* src, size_t n) {
#if defined(__SSE2__)
  const uintptr_t delta =
      (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095u;
  if (n >= 1024 && n < (size_t{1} << 20) && delta > 0 && delta < 128) {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    size_t i = 0;
#if defined(__AVX__)
    for (; i + 128 <= n; i += 128) {
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
      __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
    }
#else
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
#endif
    if (i < n) std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace switchyard::comm
