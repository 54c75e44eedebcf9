#include "cli/flags.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <set>

#include "cli/command.h"
#include "cli/parse_numbers.h"
#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/train/config.h"

namespace switchyard::cli {

std::string NormalizeFlagSpelling(std::string_view arg) {
  std::string out(arg);
  if (out.size() <= 2 || out.compare(0, 2, "--") != 0) return out;
  const size_t end = std::min(out.find('='), out.size());
  for (size_t i = 2; i < end; ++i) {
    if (out[i] == '_') out[i] = '-';
  }
  return out;
}

void NormalizeFlagSpellings(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) return;  // positional arguments follow
    const std::string fixed = NormalizeFlagSpelling(argv[i]);
    std::memcpy(argv[i], fixed.data(), fixed.size());  // same length: only '_' -> '-'
  }
}

namespace {

// Marks an option whose integer text is checked by switchyard's own parser (AddIntOptionWith), or
// handed on as text (the TrainConfig keys: train::ResolveTrainConfig parses them): a validator
// that does nothing, found by its name. Any other option CLI11 types as INT or UINT gets the
// strict 64-bit check from ApplyFlagConventions.
constexpr const char* kCheckedIntegerMarker = "switchyard-checked-integer";

void MarkIntegerChecked(CLI::Option* opt) {
  opt->check(CLI::Validator([](std::string&) { return std::string(); }, "", kCheckedIntegerMarker));
}

bool IsIntegerChecked(CLI::Option* opt) {
  try {
    opt->get_validator(kCheckedIntegerMarker);
    return true;
  } catch (const CLI::OptionNotFound&) {
    return false;
  }
}

}  // namespace

CLI::Option* AddIntOptionWith(CLI::App& app, const std::string& name,
                              std::function<void(int64_t)> store, int64_t lo, int64_t hi,
                              const std::string& help) {
  CLI::Option* opt = app.add_option_function<std::string>(
      name,
      [store = std::move(store), name, lo, hi](const std::string& text) {
        store(ParseInt64InRange(text, name, lo, hi));
      },
      help);
  opt->type_name(fmt::format("INT in [{}, {}]", lo, hi));
  MarkIntegerChecked(opt);
  return opt;
}

template <typename Int>
CLI::Option* AddIntListOption(CLI::App& app, const std::string& name, std::vector<Int>* target,
                              int64_t lo, int64_t hi, const std::string& help) {
  SY_CHECK(lo <= hi && static_cast<long double>(lo) >= std::numeric_limits<Int>::min() &&
               static_cast<long double>(hi) <= std::numeric_limits<Int>::max(),
           "{}: range [{}, {}] does not fit the flag's type", name, lo, hi);
  CLI::Option* opt = app.add_option_function<std::vector<std::string>>(
      name,
      [target, name, lo, hi](const std::vector<std::string>& args) {
        // Split here rather than by CLI11's delimiter, which drops empty items: "2,,4" is an
        // error, not 2,4.
        std::vector<Int> values;
        for (const std::string& arg : args) {
          size_t start = 0;
          while (true) {
            const size_t comma = std::min(arg.find(',', start), arg.size());
            SY_REQUIRE(values.size() < kMaxSizesInList, InvalidArgument, "{}: more than {} values",
                       name, kMaxSizesInList);
            values.push_back(static_cast<Int>(ParseInt64InRange(
                std::string_view(arg).substr(start, comma - start), name, lo, hi)));
            if (comma == arg.size()) break;
            start = comma + 1;
          }
        }
        *target = std::move(values);
      },
      help);
  opt->type_name(fmt::format("INT in [{}, {}],...", lo, hi));
  MarkIntegerChecked(opt);
  return opt;
}
template CLI::Option* AddIntListOption<int>(CLI::App&, const std::string&, std::vector<int>*,
                                            int64_t, int64_t, const std::string&);
template CLI::Option* AddIntListOption<int64_t>(CLI::App&, const std::string&,
                                                std::vector<int64_t>*, int64_t, int64_t,
                                                const std::string&);

CLI::Validator FiniteIn(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        try {
          ParseFiniteDouble(text, "value", lo, hi);
        } catch (const InvalidArgument&) {
          return fmt::format("'{}' is not a finite number in [{:g}, {:g}]", text, lo, hi);
        }
        return "";
      },
      fmt::format("FLOAT in [{:g}, {:g}]", lo, hi));
}

void AddEmulationLinkOptions(CLI::App& app, double* intra_latency_us, double* intra_gbps,
                             double* inter_latency_us, double* inter_gbps) {
  const double big = 1e12;  // the deadline bounds latencies (RequireEmulationFitsDeadline)
  app.add_option("--intra-latency-us", *intra_latency_us,
                 "emulated intra-node latency per message, microseconds (below the collective "
                 "deadline)")
      ->check(FiniteIn(0, big));
  app.add_option("--intra-gbps", *intra_gbps,
                 "emulated intra-node bandwidth, GB/s (0 = unlimited; else >= 1e-6)")
      ->check(FiniteIn(0, big));
  app.add_option("--inter-latency-us", *inter_latency_us,
                 "emulated inter-node latency per message, microseconds (below the collective "
                 "deadline)")
      ->check(FiniteIn(0, big));
  app.add_option("--inter-gbps", *inter_gbps,
                 "emulated inter-node bandwidth, GB/s (0 = unlimited; else >= 1e-6)")
      ->check(FiniteIn(0, big));
}

void RequireEmulationFitsDeadline(const comm::EmulationOptions& emulation,
                                  comm::Milliseconds deadline, std::string_view deadline_flag,
                                  uint64_t largest_message_bytes, const EmulationFlagNames& names) {
  const double deadline_us = static_cast<double>(deadline.count()) * 1e3;
  const std::string deadline_text =
      deadline_flag.empty()
          ? fmt::format("the collective deadline ({} ms, the default)", deadline.count())
          : fmt::format("the collective deadline ({} {} ms)", deadline_flag, deadline.count());
  struct Link {
    std::string_view latency_flag, gbps_flag;
    const comm::LinkModel& link;
  };
  for (const Link& l : {Link{names.intra_latency, names.intra_gbps, emulation.intra_node},
                        Link{names.inter_latency, names.inter_gbps, emulation.inter_node}}) {
    const comm::LinkModel& link = l.link;
    SY_REQUIRE(link.latency_us < deadline_us, InvalidArgument,
               "{}: {:g} us is not below {}: every message would wait past it; expected a "
               "latency below {:g} us",
               l.latency_flag, link.latency_us, deadline_text, deadline_us);
    SY_REQUIRE(link.bandwidth_gbps == 0 || link.bandwidth_gbps >= comm::kMinEmulatedGbps,
               InvalidArgument, "{}: {:g} is not 0 (unlimited) or a bandwidth >= {:g} GB/s",
               l.gbps_flag, link.bandwidth_gbps, comm::kMinEmulatedGbps);
    if (link.bandwidth_gbps > 0) {
      const double us = link.latency_us + static_cast<double>(largest_message_bytes) /
                                              (link.bandwidth_gbps * 1e9) * 1e6;
      SY_REQUIRE(us < deadline_us, InvalidArgument,
                 "{}: a message of {} at {:g} GB/s takes {:.3g} s, not below {}", l.gbps_flag,
                 FormatBytes(largest_message_bytes), link.bandwidth_gbps, us * 1e-6, deadline_text);
    }
  }
  comm::ValidateEmulationOptions(emulation, deadline);
}

void AddTrainConfigFlags(CLI::App& app,
                         std::function<void(const std::string& key, const std::string& text)> set) {
  auto setter = std::make_shared<decltype(set)>(std::move(set));
  for (const train::ConfigKey& key : train::TrainConfigKeys()) {
    std::string flag = "--" + key.name;
    for (size_t i = 2; i < flag.size(); ++i) {
      if (flag[i] == '_') flag[i] = '-';
    }
    CLI::Option* opt = nullptr;
    if (key.name == "data" || key.name == "val_data") {
      // A blend takes several values (--data 0.7 A 0.3 B); they reach the key one a line, so
      // that a path may hold spaces (train/data.h: ParseDataBlend).
      opt = app.add_option_function<std::vector<std::string>>(
          flag,
          [setter, name = key.name](const std::vector<std::string>& v) {
            std::string joined;
            for (const std::string& part : v) joined += (joined.empty() ? "" : "\n") + part;
            (*setter)(name, joined);
          },
          key.help);
      opt->expected(1, -1);
    } else {
      opt = app.add_option_function<std::string>(
          flag, [setter, name = key.name](const std::string& v) { (*setter)(name, v); }, key.help);
    }
    opt->type_name(key.type);
    MarkIntegerChecked(opt);  // the text goes to train::ResolveTrainConfig
    // A yes/no key given alone means true (--sequence-parallel); "--key false" still works.
    if (key.type == "BOOL") opt->expected(0, 1)->default_str("true");
  }
  app.footer(
      "Flags are spelled with dashes (--batch-size); the underscore spellings (--batch_size) are "
      "accepted too. The keys of a --config JSON file are the flag names with underscores "
      "(\"batch_size\").");
}

namespace {

// What an option's value is when CLI11 only knows it is a string.
std::string TypeOfTextOption(const std::string& name) {
  static const std::set<std::string> kPaths = {
      "config", "tensors", "out", "trace", "resume", "data", "moe-layer-config", "in"};
  if (kPaths.count(name)) return "PATH";
  if (name == "sizes") return "SIZES";
  return "NAME";
}

void ApplyFlagConventions(CLI::App& app, const std::string& command) {
  for (CLI::Option* opt : app.get_options()) {
    for (const std::string& name : opt->get_lnames()) {
      SY_CHECK(name.find('_') == std::string::npos,
               "{}: flag --{} is spelled with '_'; the CLI spells flags with dashes (flags.h)",
               command, name);
    }
    // An integer CLI11 would convert itself (strtoll with base 0: "010" is 8, "0x10" 16, a value
    // beyond 64 bits saturates, "-1" wraps to 2^64 - 1 in an unsigned): read the whole number
    // first instead, before any other check (transform runs first), so that a bad value is
    // refused naming the flag and quoting the text. The commands' own flags use AddIntOption.
    const std::string type = opt->get_type_name();
    if ((type.rfind("INT", 0) == 0 || type.rfind("UINT", 0) == 0) && !IsIntegerChecked(opt)) {
      const bool is_unsigned = type.rfind("UINT", 0) == 0;
      const std::string flag = "--" + opt->get_single_name();
      opt->transform(CLI::Validator(
          [flag, is_unsigned](std::string& text) -> std::string {
            ParseInt64InRange(text, flag, is_unsigned ? 0 : std::numeric_limits<int64_t>::min(),
                              std::numeric_limits<int64_t>::max());
            return "";
          },
          ""));
    }
    // The type alone ("TEXT"), without the validators' descriptions get_type_name() appends.
    if (opt->get_type_name().rfind("TEXT", 0) == 0 && opt->get_type_size() != 0) {
      opt->type_name(TypeOfTextOption(opt->get_single_name()));
    }
  }
}

}  // namespace

Command WithFlagConventions(Command command) {
  auto setup = command.setup;
  const std::string name =
      command.parent.empty() ? command.name : command.parent + " " + command.name;
  command.setup = [setup, name](CLI::App& app) -> Action {
    Action action = setup(app);
    ApplyFlagConventions(app, name);
    return action;
  };
  return command;
}

}  // namespace switchyard::cli
