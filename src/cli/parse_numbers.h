// Numbers given on the command line: byte sizes ("64K", "1M"), lists and ranges of them
// ("4K,64K", "64K:16M:2") and plain floating-point values (latencies, bandwidths). One grammar
// for every subcommand, fully validated: a bad value throws InvalidArgument naming the flag, the
// text and what was expected (the CLI exits 2). docs/cli.md describes the grammar.
//
// No CLI11 here (the fuzz target fuzz/cli_numbers_fuzzer.cc compiles this file on its own).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace switchyard::cli {

// The largest byte size a flag accepts: 2^50 (1 PiB). Far above any machine's memory (the
// benchmarks refuse what does not fit with RequireMemory), far below where arithmetic on it
// (times ranks, rounding up) could overflow.
inline constexpr uint64_t kMaxFlagBytes = uint64_t{1} << 50;
// At most this many sizes in one --sizes value (a range like 1:1P:2 has 51).
inline constexpr size_t kMaxSizesInList = 256;

// One size in bytes: a non-negative decimal number ("4096", "1.5", "2e3") with an optional
// binary suffix K, M, G, T, P (powers of 1024; also KB/KiB, ...; case-insensitive). The result
// must be a whole number of bytes in [0, kMaxFlagBytes]: "1.5K" = 1536 is fine, "0.3K" is not.
// Rejects a sign, nan, inf, hex, spaces and anything after the suffix.
uint64_t ParseByteSize(std::string_view text, std::string_view flag);

// A list of sizes: comma-separated items, each a size or a range FROM:TO[:FACTOR] (FROM, FROM *
// FACTOR, FROM * FACTOR^2, ... up to TO; FACTOR an integer >= 2, default 4; 1 <= FROM <= TO).
// 0 is allowed as a single item (the fixed cost of a call), not as a range start. At most
// kMaxSizesInList sizes; order kept, duplicates kept.
std::vector<uint64_t> ParseSizeList(std::string_view text, std::string_view flag);

// `bytes` rounded up to a multiple of `unit` (>= 1), or InvalidArgument naming `flag` when that
// exceeds kMaxFlagBytes.
uint64_t RoundUpToMultiple(uint64_t bytes, uint64_t unit, std::string_view flag);

// A finite decimal number in [lo, hi] ("12.5", "1e-3"; no nan, inf, hex or trailing text).
double ParseFiniteDouble(std::string_view text, std::string_view flag, double lo, double hi);

}  // namespace switchyard::cli
