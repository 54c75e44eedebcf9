// `switchyard`: the command-line tool. Subcommands register themselves (see command.h).
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <map>

#include "cli/command.h"
#include "cli/flags.h"
#include "switchyard/core/error.h"
#include "switchyard/version.h"

namespace switchyard::cli {

std::vector<Command>& MutableCommands() {
  static std::vector<Command> commands;
  return commands;
}
bool RegisterCommand(Command command) {
  MutableCommands().push_back(std::move(command));
  return true;
}
const std::vector<Command>& RegisteredCommands() { return MutableCommands(); }

namespace {

int Main(int argc, char** argv) {
  NormalizeFlagSpellings(argc, argv);  // --batch_size -> --batch-size (flags.h)
  CLI::App app{"switchyard: distributed Mixture-of-Experts training", "switchyard"};
  app.set_version_flag("--version", std::string("switchyard ") + kVersion);
  app.require_subcommand(1);

  std::map<std::string, CLI::App*> parents;
  parents["bench"] = app.add_subcommand("bench", "Benchmarks: GEMM, collectives, MoE layer");
  parents["bench"]->require_subcommand(1);

  std::vector<Command> commands = RegisteredCommands();
  std::sort(commands.begin(), commands.end(),
            [](const Command& a, const Command& b) { return a.name < b.name; });
  std::vector<std::pair<CLI::App*, Action>> actions;
  for (const Command& c : commands) {
    CLI::App* parent = c.parent.empty() ? &app : parents.at(c.parent);
    CLI::App* sub = parent->add_subcommand(c.name, c.description);
    actions.emplace_back(sub, c.setup(*sub));
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "switchyard: error: %s (see --help)\n", e.what());
    return 2;
  }
  for (auto& [sub, action] : actions) {
    if (sub->parsed()) return action();
  }
  std::fprintf(stderr, "switchyard: error: no command given (see --help)\n");
  return 2;
}

}  // namespace
}  // namespace switchyard::cli

int main(int argc, char** argv) {
  std::signal(SIGXFSZ, SIG_IGN);  // a file size limit fails the write (an error), not the process
  try {
    return switchyard::cli::Main(argc, argv);
  } catch (const switchyard::InvalidArgument& e) {
    std::fprintf(stderr, "switchyard: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "switchyard: error: %s\n", e.what());
    return 1;
  }
}
