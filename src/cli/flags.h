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
#include <string>
#include <string_view>

#include "switchyard/comm/inprocess.h"

namespace switchyard::cli {

// Rewrites every `--name_with_underscores[=value]` of argv[1..] in place to
// `--name-with-underscores[=value]` (the part before '=' only: values are never touched), up to a
// bare `--`. Called once by main() before parsing, so every subcommand accepts both spellings.
void NormalizeFlagSpellings(int argc, char** argv);
// The same for one argument (for tests and the fuzz target).
std::string NormalizeFlagSpelling(std::string_view arg);

// A CLI11 check: the value is a finite decimal number in [lo, hi] (no nan, inf, hex).
CLI::Validator FiniteIn(double lo, double hi);

// The four alpha-beta link flags of the in-process emulation (--intra-latency-us, --intra-gbps,
// --inter-latency-us, --inter-gbps), each a finite number >= 0.
void AddEmulationLinkOptions(CLI::App& app, double* intra_latency_us, double* intra_gbps,
                             double* inter_latency_us, double* inter_gbps);

// Throws InvalidArgument naming the flag when an emulated link cannot complete a message before
// the collective deadline `deadline` (set by `deadline_flag`, or the default when empty): a
// latency at or above the deadline, or `largest_message_bytes` at the link's bandwidth taking
// that long, or a bandwidth below the library's minimum. The values come from
// AddEmulationLinkOptions (finite and >= 0 by then); comm::ValidateEmulationOptions runs last.
void RequireEmulationFitsDeadline(const comm::EmulationOptions& emulation,
                                  comm::Milliseconds deadline, std::string_view deadline_flag,
                                  uint64_t largest_message_bytes);

// One flag per train::TrainConfigKeys() key, spelled with dashes (--batch-size for the key
// batch_size), its value type from the key's metadata; `set(key, text)` receives the key's
// underscore name. Also says in the help footer that underscores work and that --config JSON
// keys keep them.
void AddTrainConfigFlags(CLI::App& app,
                         std::function<void(const std::string& key, const std::string& text)> set);

}  // namespace switchyard::cli
