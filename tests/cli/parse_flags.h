// Parses a command line with a command's flag setup under the flag conventions (cli/command.h),
// for the tests of the flag helpers themselves (no executable run).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "switchyard/core/error.h"

namespace switchyard::cli {

// Parses `args` (after the program name) with `setup` under the flag conventions; returns the
// error message ("" when it parsed).
inline std::string Parse(const std::function<void(CLI::App&)>& setup,
                         std::vector<std::string> args) {
  Command command{"", "probe", "", [&](CLI::App& app) -> Action {
                    setup(app);
                    return [] { return 0; };
                  }};
  CLI::App app;
  WithFlagConventions(command).setup(app);
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

}  // namespace switchyard::cli
