// FNV-1a, 64 bits: the one byte-hash loop of switchyard (checkpoint checksums, data identities,
// the ranks' configuration digests and fingerprints). Not cryptographic: it detects accidental
// differences (a corrupted file, a rank started with another input), not deliberate ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace switchyard {

// The standard FNV-1a 64 offset basis.
inline constexpr uint64_t kFnv1a64Basis = 14695981039346656037ull;

// The hash of `bytes`, continuing from `state` (the hash of the bytes that came before, or an
// offset basis to start): FnvHash(b, FnvHash(a)) hashes a then b without joining them.
inline uint64_t FnvHash(std::span<const std::byte> bytes, uint64_t state = kFnv1a64Basis) {
  for (std::byte b : bytes) {
    state ^= static_cast<uint64_t>(b);
    state *= 1099511628211ull;
  }
  return state;
}

}  // namespace switchyard
