// The command line's conventions, in one place (docs/cli.md):
//   - flag names are spelled with dashes (--batch-size); the old underscore spellings
//     (--batch_size) keep working because NormalizeFlagSpellings rewrites them before parsing;
//   - help shows what a value is (INT, FLOAT, SIZES, PATH, NAME), never TEXT;
//   - numbers are validated where they are parsed (parse_numbers.h): a bad value exits 2 with a
//     message naming the flag, the value and what was expected.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"

namespace switchyard::cli {

// Rewrites every `--name_with_underscores[=value]` of argv[1..] in place to
// `--name-with-underscores[=value]` (the part before '=' only: values are never touched), up to a
// bare `--`. Called once by main() before parsing, so every subcommand accepts both spellings.
void NormalizeFlagSpellings(int argc, char** argv);
// The same for one argument (for tests and the fuzz target).
std::string NormalizeFlagSpelling(std::string_view arg);

// An integer flag (docs/cli.md, "Integers"). The text is read as a whole decimal number in the
// full 64-bit range and checked against [lo, hi] before anything narrower sees it
// (ParseInt64InRange, core/limits.h), so a value that `*target`'s type cannot hold is an error
// naming the flag and quoting the value as typed, never a wrapped or saturated value; hex, octal,
// exponents and trailing text are refused too. The help shows "INT in [lo, hi]". Every integer flag
// of a subcommand is declared this way (or with AddIntListOption); [lo, hi] must fit the type.
// `store` receives the checked value.
CLI::Option* AddIntOptionWith(CLI::App& app, const std::string& name,
                              std::function<void(int64_t)> store, int64_t lo, int64_t hi,
                              const std::string& help);
template <typename Int>
CLI::Option* AddIntOption(CLI::App& app, const std::string& name, Int* target, int64_t lo,
                          int64_t hi, const std::string& help) {
  static_assert(std::is_integral_v<Int> && sizeof(Int) <= sizeof(int64_t));
  SY_CHECK(lo <= hi && static_cast<long double>(lo) >= std::numeric_limits<Int>::min() &&
               static_cast<long double>(hi) <= std::numeric_limits<Int>::max(),
           "{}: range [{}, {}] does not fit the flag's type", name, lo, hi);
  return AddIntOptionWith(
      app, name, [target](int64_t v) { *target = static_cast<Int>(v); }, lo, hi, help);
}
// A comma-separated list of such integers ("--cp 1,2,4"), each in [lo, hi]; at most 256 items.
template <typename Int>
CLI::Option* AddIntListOption(CLI::App& app, const std::string& name, std::vector<Int>* target,
                              int64_t lo, int64_t hi, const std::string& help);

// A CLI11 check: the value is a finite decimal number in [lo, hi] (no nan, inf, hex).
CLI::Validator FiniteIn(double lo, double hi);

// The four alpha-beta link flags of the in-process emulation (--intra-latency-us, --intra-gbps,
// --inter-latency-us, --inter-gbps), each a finite number >= 0.
void AddEmulationLinkOptions(CLI::App& app, double* intra_latency_us, double* intra_gbps,
                             double* inter_latency_us, double* inter_gbps);

// The flags a command set the emulated links with, for RequireEmulationFitsDeadline's messages.
struct EmulationFlagNames {
  std::string_view intra_latency = "--intra-latency-us", intra_gbps = "--intra-gbps";
  std::string_view inter_latency = "--inter-latency-us", inter_gbps = "--inter-gbps";
};
// `train`'s two flags, each setting both links.
inline constexpr EmulationFlagNames kTrainLinkFlags{"--link-latency-us", "--link-gbps",
                                                    "--link-latency-us", "--link-gbps"};

// Throws InvalidArgument naming the flag (as `names` spell it) when an emulated link cannot
// complete a message before the collective deadline `deadline` (set by `deadline_flag`, or the
// default when empty): a latency at or above the deadline, or `largest_message_bytes` at the
// link's bandwidth taking that long, or a bandwidth below the library's minimum. The values come
// from AddEmulationLinkOptions or FiniteIn checks (finite and >= 0 by then);
// comm::ValidateEmulationOptions runs last.
void RequireEmulationFitsDeadline(const comm::EmulationOptions& emulation,
                                  comm::Milliseconds deadline, std::string_view deadline_flag,
                                  uint64_t largest_message_bytes,
                                  const EmulationFlagNames& names = {});

// One flag per train::TrainConfigKeys() key, spelled with dashes (--batch-size for the key
// batch_size), its value type from the key's metadata; `set(key, text)` receives the key's
// underscore name. Also says in the help footer that underscores work and that --config JSON
// keys keep them.
void AddTrainConfigFlags(CLI::App& app,
                         std::function<void(const std::string& key, const std::string& text)> set);

}  // namespace switchyard::cli
