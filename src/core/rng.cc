#include "switchyard/core/rng.h"

#include <cmath>
#include <numbers>

namespace switchyard {
namespace {

constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;

inline void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

}  // namespace

std::array<uint32_t, 4> Philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo(kMul0, ctr[0], &hi0, &lo0);
    MulHiLo(kMul1, ctr[2], &hi1, &lo1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

float BitsToOpenUnit(uint32_t bits) {
  // Top 23 bits, offset by half a step: (j + 0.5) / 2^23 is exact in float32 and lies in
  // [2^-24, 1 - 2^-24]. (With 24 bits the largest value would round up to 1.)
  return (static_cast<float>(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

std::array<uint32_t, 4> CounterRng::Bits(uint64_t index) const {
  return Philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                     static_cast<uint32_t>(stream_), static_cast<uint32_t>(stream_ >> 32)},
                    {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)});
}

float CounterRng::Uniform(uint64_t index, int lane) const {
  return BitsToOpenUnit(Bits(index)[static_cast<size_t>(lane & 3)]);
}

float CounterRng::Normal(uint64_t index) const {
  auto b = Bits(index);
  double u1 = BitsToOpenUnit(b[0]);
  double u2 = BitsToOpenUnit(b[1]);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
}

float CounterRng::Gumbel(uint64_t index) const {
  double u = BitsToOpenUnit(Bits(index)[0]);
  return static_cast<float>(-std::log(-std::log(u)));
}

}  // namespace switchyard
