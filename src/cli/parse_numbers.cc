#include "cli/parse_numbers.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"

namespace switchyard::cli {
namespace {

constexpr const char* kSizeGrammar =
    "a non-negative number of bytes with an optional K, M, G, T or P suffix (powers of 1024), "
    "e.g. 4096, 64K, 1.5M";

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Length of the longest prefix of `text` that is an unsigned decimal number: digits with an
// optional fraction and exponent ("12", "1.5", ".5", "2e3", "1E-3"); 0 if there is none.
size_t DecimalPrefix(std::string_view text) {
  size_t i = 0, digits = 0;
  while (i < text.size() && IsDigit(text[i])) ++i, ++digits;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && IsDigit(text[i])) ++i, ++digits;
  }
  if (digits == 0) return 0;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    size_t j = i + 1;
    if (j < text.size() && (text[j] == '+' || text[j] == '-')) ++j;
    size_t exp_digits = 0;
    while (j < text.size() && IsDigit(text[j])) ++j, ++exp_digits;
    if (exp_digits > 0) i = j;
  }
  return i;
}

// The value of a prefix DecimalPrefix accepted (strtod on a copy: the view need not end there).
double DecimalValue(std::string_view digits) {
  const std::string copy(digits);
  return std::strtod(copy.c_str(), nullptr);
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// 1024^n for a suffix ("", "k", "kb", "kib", ...), 0 if it is not one.
double SuffixScale(std::string_view suffix) {
  const std::string s = Lower(suffix);
  if (s.empty() || s == "b") return 1;
  static constexpr const char* kUnits = "kmgtp";
  double scale = 1;
  for (const char* u = kUnits; *u != '\0'; ++u) {
    scale *= 1024;
    if (s == std::string(1, *u) || s == std::string(1, *u) + "b" ||
        s == std::string(1, *u) + "ib") {
      return scale;
    }
  }
  return 0;
}

std::vector<std::string_view> Split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t at = text.find(sep, start);
    if (at == std::string_view::npos) {
      parts.push_back(text.substr(start));
      return parts;
    }
    parts.push_back(text.substr(start, at - start));
    start = at + 1;
  }
}

}  // namespace

uint64_t ParseByteSize(std::string_view text, std::string_view flag) {
  const size_t n = DecimalPrefix(text);
  SY_REQUIRE(n > 0, InvalidArgument, "{}: '{}' is not a size; expected {}", flag, text,
             kSizeGrammar);
  const double scale = SuffixScale(text.substr(n));
  SY_REQUIRE(scale > 0, InvalidArgument, "{}: '{}' has an unknown suffix '{}'; expected {}", flag,
             text, text.substr(n), kSizeGrammar);
  const double bytes = DecimalValue(text.substr(0, n)) * scale;
  SY_REQUIRE(bytes <= static_cast<double>(kMaxFlagBytes), InvalidArgument,
             "{}: '{}' is too large; expected at most {} ({} bytes)", flag, text,
             FormatBytes(kMaxFlagBytes), kMaxFlagBytes);
  SY_REQUIRE(bytes == std::floor(bytes), InvalidArgument,
             "{}: '{}' is {} bytes, not a whole number of bytes", flag, text, bytes);
  return static_cast<uint64_t>(bytes);
}

std::vector<uint64_t> ParseSizeList(std::string_view text, std::string_view flag) {
  std::vector<uint64_t> sizes;
  auto add = [&](uint64_t s) {
    SY_REQUIRE(sizes.size() < kMaxSizesInList, InvalidArgument, "{}: '{}' gives more than {} sizes",
               flag, text, kMaxSizesInList);
    sizes.push_back(s);
  };
  for (std::string_view item : Split(text, ',')) {
    SY_REQUIRE(!item.empty(), InvalidArgument,
               "{}: empty item in '{}'; expected sizes separated by commas (4K,64K) or a range "
               "FROM:TO[:FACTOR] (64K:16M)",
               flag, text);
    if (item.find(':') == std::string_view::npos) {
      add(ParseByteSize(item, flag));
      continue;
    }
    const std::vector<std::string_view> p = Split(item, ':');
    SY_REQUIRE(p.size() == 2 || p.size() == 3, InvalidArgument,
               "{}: '{}' is not a range; expected FROM:TO or FROM:TO:FACTOR", flag, item);
    const uint64_t from = ParseByteSize(p[0], flag), to = ParseByteSize(p[1], flag);
    uint64_t factor = 4;
    if (p.size() == 3) {
      const size_t n = DecimalPrefix(p[2]);
      const double f = n > 0 && n == p[2].size() ? DecimalValue(p[2]) : 0;
      SY_REQUIRE(f >= 2 && f <= 1024 && f == std::floor(f), InvalidArgument,
                 "{}: range '{}': FACTOR '{}' must be a whole number from 2 to 1024", flag, item,
                 p[2]);
      factor = static_cast<uint64_t>(f);
    }
    SY_REQUIRE(from >= 1 && from <= to, InvalidArgument,
               "{}: range '{}' needs 1 <= FROM <= TO, got FROM {} and TO {} bytes", flag, item,
               from, to);
    // s * factor cannot overflow: s <= to <= 2^50 and factor <= 1024.
    for (uint64_t s = from; s <= to; s *= factor) add(s);
  }
  return sizes;
}

uint64_t RoundUpToMultiple(uint64_t bytes, uint64_t unit, std::string_view flag) {
  SY_REQUIRE(unit >= 1, InvalidArgument, "{}: unit of {} bytes", flag, unit);
  const uint64_t rem = bytes % unit;
  if (rem == 0) return bytes;
  SY_REQUIRE(bytes <= kMaxFlagBytes && unit <= kMaxFlagBytes, InvalidArgument,
             "{}: {} bytes rounded up to a multiple of {} exceeds {}", flag, bytes, unit,
             FormatBytes(kMaxFlagBytes));
  const uint64_t up = bytes + (unit - rem);
  SY_REQUIRE(up <= kMaxFlagBytes, InvalidArgument,
             "{}: {} bytes rounded up to a multiple of {} is {}, above the limit of {}", flag,
             bytes, unit, up, FormatBytes(kMaxFlagBytes));
  return up;
}

double ParseFiniteDouble(std::string_view text, std::string_view flag, double lo, double hi) {
  size_t start = 0;
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) start = 1;
  const size_t n = DecimalPrefix(text.substr(start));
  SY_REQUIRE(n > 0 && start + n == text.size(), InvalidArgument,
             "{}: '{}' is not a number; expected a finite decimal number in [{}, {}]", flag, text,
             lo, hi);
  double v = DecimalValue(text.substr(start, n));
  if (start == 1 && text[0] == '-') v = -v;
  SY_REQUIRE(std::isfinite(v) && v >= lo && v <= hi, InvalidArgument,
             "{}: {} is out of range; expected a finite number in [{}, {}]", flag, text, lo, hi);
  return v;
}

}  // namespace switchyard::cli
