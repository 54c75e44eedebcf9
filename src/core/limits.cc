#include "switchyard/core/limits.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>

#include "switchyard/core/error.h"

namespace switchyard {
namespace {

constexpr uint64_t kUnknown = uint64_t{1} << 62;

uint64_t MemAvailableFromProc() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return kUnknown;
}

// cgroup v2: memory.max - memory.current of this process's cgroup (the root one here).
uint64_t CgroupHeadroom() {
  std::ifstream max_in("/sys/fs/cgroup/memory.max");
  std::string max_text;
  if (!(max_in >> max_text) || max_text == "max") return kUnknown;
  std::ifstream cur_in("/sys/fs/cgroup/memory.current");
  uint64_t current = 0;
  cur_in >> current;
  uint64_t limit = std::stoull(max_text);
  return limit > current ? limit - current : 0;
}

uint64_t RlimitHeadroom() {
  uint64_t best = kUnknown;
  for (int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    rlimit r{};
    if (getrlimit(resource, &r) == 0 && r.rlim_cur != RLIM_INFINITY) {
      // Usage is not known cheaply; the limit itself bounds any one allocation.
      best = std::min<uint64_t>(best, r.rlim_cur);
    }
  }
  return best;
}

}  // namespace

int64_t CheckedToInt64(double value, std::string_view what, int64_t lo, int64_t hi) {
  SY_REQUIRE(std::isfinite(value), InvalidArgument,
             "{} is {}, expected a finite number in [{}, {}]", what, value, lo, hi);
  // 2^63 is exactly representable; every double below it converts without overflow.
  SY_REQUIRE(value >= static_cast<double>(lo) && value <= static_cast<double>(hi) &&
                 value < 9223372036854775808.0,
             InvalidArgument, "{} is {:g}, expected an integer in [{}, {}]", what, value, lo, hi);
  auto result = static_cast<int64_t>(value);
  SY_REQUIRE(result >= lo && result <= hi, InvalidArgument,
             "{} is {:g}, expected an integer in [{}, {}]", what, value, lo, hi);
  return result;
}

int64_t ParseInt64InRange(std::string_view text, std::string_view what, int64_t lo, int64_t hi) {
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) i = 1;
  bool digits = i < text.size();
  // The magnitude as an unsigned 64-bit number; `overflow` once it passes 2^63 (no int64 holds
  // it, whatever its sign).
  uint64_t magnitude = 0;
  bool overflow = false;
  for (size_t j = i; j < text.size() && digits; ++j) {
    if (text[j] < '0' || text[j] > '9') {
      digits = false;
      break;
    }
    const auto digit = static_cast<uint64_t>(text[j] - '0');
    if (magnitude > (uint64_t{1} << 63) / 10 || magnitude * 10 > (uint64_t{1} << 63) - digit) {
      overflow = true;
    } else {
      magnitude = magnitude * 10 + digit;
    }
  }
  SY_REQUIRE(digits, InvalidArgument,
             "{}: '{}' is not an integer; expected a whole decimal number in [{}, {}]", what, text,
             lo, hi);
  const bool fits = !overflow && (negative || magnitude < (uint64_t{1} << 63));
  int64_t value = 0;
  if (fits) {
    // -2^63 is the one value whose magnitude does not fit int64 itself.
    value = negative ? static_cast<int64_t>(0 - magnitude) : static_cast<int64_t>(magnitude);
  }
  SY_REQUIRE(fits && value >= lo && value <= hi, InvalidArgument,
             "{}: '{}' is out of range; expected an integer in [{}, {}]", what, text, lo, hi);
  return value;
}

int64_t CheckedMul(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  SY_REQUIRE(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &out), InvalidArgument,
             "{}: {} x {} is negative or overflows a 64-bit integer", what, a, b);
  return out;
}

uint64_t AvailableMemoryBytes() {
  using Clock = std::chrono::steady_clock;
  static std::mutex mu;
  static Clock::time_point last{};
  static uint64_t cached = kUnknown;
  std::lock_guard<std::mutex> lock(mu);
  auto now = Clock::now();
  if (last == Clock::time_point{} || now - last > std::chrono::milliseconds(100)) {
    cached = std::min({MemAvailableFromProc(), CgroupHeadroom(), RlimitHeadroom()});
    last = now;
  }
  return cached;
}

std::string FormatBytes(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", v, kUnits[u]);
}

void RequireMemory(uint64_t bytes, std::string_view what) {
  SY_REQUIRE(bytes < kUnknown, InvalidArgument,
             "{} needs {} bytes, more than any machine can address", what, bytes);
  uint64_t available = AvailableMemoryBytes();
  SY_REQUIRE(bytes <= available, InvalidArgument, "{} needs {} of memory but only {} are available",
             what, FormatBytes(bytes), FormatBytes(available));
}

}  // namespace switchyard
