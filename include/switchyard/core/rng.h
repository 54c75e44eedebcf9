// Counter-based random numbers (Philox-4x32-10, Salmon et al., SC'11).
//
// Every draw is a pure function of (seed, stream, index): no state, no order dependence. This is
// what lets a distributed run equal a single-rank run: gate noise and random routing key their
// draws by the *global* token index, so token 17 gets the same noise on whichever rank it lives.
// Streams separate independent uses (see the kStream* constants) so they never share draws.
#pragma once

#include <array>
#include <cstdint>

namespace switchyard {

// Philox-4x32 with 10 rounds: 128-bit counter, 64-bit key -> 128 random bits.
std::array<uint32_t, 4> Philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// Streams used by the library; a new use of randomness takes a new stream.
enum RngStream : uint64_t {
  kStreamGateNoise = 1,      // Tutel normal noise on logits, per (token, expert)
  kStreamGateJitter = 2,     // DeepSpeed jitter, per (token, model_dim element)
  kStreamGumbel = 3,         // Gumbel noise for the second choice, per (token, expert)
  kStreamRandomRouting = 4,  // GShard random routing of the 2nd choice, per token
  kStreamDropPriority = 5,   // random drop policy, per token
  kStreamInit = 16,          // parameter initialization (stream + parameter id)
  kStreamData = 64,          // data sampling
};

class CounterRng {
 public:
  CounterRng(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}

  // 128 random bits for `index`.
  std::array<uint32_t, 4> Bits(uint64_t index) const;
  // Uniform in the open interval (0, 1), from lane `lane` (0..3) of Bits(index).
  float Uniform(uint64_t index, int lane = 0) const;
  // Standard normal (Box-Muller on lanes 0 and 1 of Bits(index)).
  float Normal(uint64_t index) const;
  // Standard Gumbel: -log(-log(U)).
  float Gumbel(uint64_t index) const;

  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }

 private:
  uint64_t seed_;
  uint64_t stream_;
};

// Maps 32 random bits to a float in the open interval (0, 1): ((bits >> 9) + 0.5) / 2^23,
// exact in float32, never 0 or 1.
float BitsToOpenUnit(uint32_t bits);

}  // namespace switchyard
