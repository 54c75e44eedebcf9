// Fuzzes the command line's number grammar (src/cli/parse_numbers.h): sizes with suffixes, lists
// and ranges (--sizes), rounding to element multiples, finite floats (the emulation flags) and
// integers (every integer flag, core/limits.h).
// Every input must either give a value that keeps the grammar's promises or throw
// InvalidArgument (exit 2 for the user); any other exception, a crash, a sanitizer report (a
// float-to-integer overflow, say) or a hang (a range that never ends) is a bug.
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "cli/parse_numbers.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"

namespace {

using switchyard::InvalidArgument;
namespace cli = switchyard::cli;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void FuzzSize(std::string_view text) {
  uint64_t bytes = 0;
  try {
    bytes = cli::ParseByteSize(text, "--sizes");
  } catch (const InvalidArgument&) {
    return;
  }
  Check(bytes <= cli::kMaxFlagBytes);
  // A size read back from its decimal form is the same size.
  Check(cli::ParseByteSize(std::to_string(bytes), "--sizes") == bytes);
  for (uint64_t unit : {uint64_t{1}, uint64_t{2}, uint64_t{12}, uint64_t{4096} * 3}) {
    try {
      const uint64_t up = cli::RoundUpToMultiple(bytes, unit, "--sizes");
      Check(up >= bytes && up % unit == 0 && up - bytes < unit && up <= cli::kMaxFlagBytes);
    } catch (const InvalidArgument&) {
      Check(bytes + unit > cli::kMaxFlagBytes);  // refused only near the limit
    }
  }
}

void FuzzList(std::string_view text) {
  try {
    const std::vector<uint64_t> sizes = cli::ParseSizeList(text, "--sizes");
    Check(!sizes.empty() && sizes.size() <= cli::kMaxSizesInList);
    for (uint64_t s : sizes) Check(s <= cli::kMaxFlagBytes);
  } catch (const InvalidArgument&) {
  }
}

void FuzzDouble(std::string_view text, double lo, double hi) {
  try {
    const double v = cli::ParseFiniteDouble(text, "--intra-latency-us", lo, hi);
    Check(std::isfinite(v) && v >= lo && v <= hi);
  } catch (const InvalidArgument&) {
  }
}

// Integer flags (core/limits.h, ParseInt64InRange): the value is in range and reads back from
// its decimal form; a value refused in a narrow range is refused for being out of it or for not
// being an integer at all, never accepted wrapped.
void FuzzInteger(std::string_view text, int64_t lo, int64_t hi) {
  try {
    const int64_t v = switchyard::ParseInt64InRange(text, "--pp", lo, hi);
    Check(v >= lo && v <= hi);
    Check(switchyard::ParseInt64InRange(std::to_string(v), "--pp", lo, hi) == v);
    // The same text in the full range is the same value.
    Check(switchyard::ParseInt64InRange(text, "--pp", INT64_MIN, INT64_MAX) == v);
  } catch (const InvalidArgument&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  FuzzSize(text);
  FuzzList(text);
  FuzzDouble(text, 0, 1e12);
  FuzzDouble(text, -1e6, 1e6);
  FuzzInteger(text, 1, 1024);
  FuzzInteger(text, INT64_MIN, INT64_MAX);
  return 0;
}
