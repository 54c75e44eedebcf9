// Range checks for values that come from input: conversions of floating-point values to
// integers, and sizes that are about to be allocated.
//
// Every float that becomes an integer anywhere in switchyard goes through CheckedToInt64 (a
// float outside the integer's range, NaN or infinity would otherwise convert to an arbitrary
// value: undefined behaviour that in practice gives 0 or INT64_MIN). Every allocation whose size
// is derived from input goes through RequireMemory first, so that a size that cannot fit is
// refused up front with a message saying how much it needed, instead of being found by the
// kernel's OOM killer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace switchyard {

// `value` as an int64 if it is finite, integral after `round` was applied by the caller, and in
// [lo, hi]; otherwise throws InvalidArgument naming `what`, the value and the range.
// Example: CheckedToInt64(std::floor(cf * spe), "capacity", 0, kMaxCount).
int64_t CheckedToInt64(double value, std::string_view what, int64_t lo, int64_t hi);

// `text` as a whole decimal number in [lo, hi]: an optional sign and decimal digits, nothing else
// (no hex, no octal: "010" is ten; no exponent, fraction, spaces or trailing text). The number is
// read in full before it is compared, so a value beyond int64 or beyond the caller's narrower type
// is refused, never wrapped. Throws InvalidArgument naming `what` (a flag such as "--pp") and
// quoting `text` exactly as given, e.g. "--pp: '4294967297' is out of range; expected an integer
// in [1, 1024]".
int64_t ParseInt64InRange(std::string_view text, std::string_view what, int64_t lo, int64_t hi);

// a * b, or throws InvalidArgument naming `what` when the product overflows int64 or is
// negative.
int64_t CheckedMul(int64_t a, int64_t b, std::string_view what);

// Bytes this process could still allocate: the smaller of the kernel's MemAvailable, the cgroup
// memory limit minus usage, and RLIMIT_AS / RLIMIT_DATA headroom. A large value when unknown.
uint64_t AvailableMemoryBytes();

// Throws InvalidArgument("<what> needs N (GiB/MiB) but only M are available") when `bytes`
// exceeds AvailableMemoryBytes() (or is above 2^62, which no machine has). Cheap enough to call
// before every large input-sized allocation (reads /proc/meminfo at most once per 100 ms).
void RequireMemory(uint64_t bytes, std::string_view what);

// "1.5 GiB", "12.0 MiB", "512 B": for messages.
std::string FormatBytes(uint64_t bytes);

}  // namespace switchyard
