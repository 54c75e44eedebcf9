// Registry of `switchyard` subcommands. Each command lives in its own cmd_*.cc file and registers
// itself with SY_REGISTER_COMMAND; main.cc builds the CLI11 tree from the registry.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace switchyard::cli {

// The action a command runs after parsing; returns the process exit code.
using Action = std::function<int()>;

struct Command {
  // "" for `switchyard NAME`, "bench" for `switchyard bench NAME` (also "tokenizer")
  std::string parent;
  std::string name;
  std::string description;
  // Declares the command's options on `app` (binding them to state it owns) and returns its action.
  std::function<Action(CLI::App& app)> setup;
};

bool RegisterCommand(Command command);
// Wraps a command's setup with the flag conventions (flags.h, docs/cli.md): after the command
// declared its options, every long flag name must be spelled with dashes (InternalError
// otherwise) and an option whose value is still typed TEXT gets the type its name implies (PATH
// for files, NAME otherwise). SY_REGISTER_COMMAND applies it to every command.
Command WithFlagConventions(Command command);
const std::vector<Command>& RegisteredCommands();

}  // namespace switchyard::cli

#define SY_CLI_CONCAT_INNER(a, b) a##b
#define SY_CLI_CONCAT(a, b) SY_CLI_CONCAT_INNER(a, b)
#define SY_REGISTER_COMMAND(...)                                      \
  static const bool SY_CLI_CONCAT(sy_command_registered_, __LINE__) = \
      ::switchyard::cli::RegisterCommand(::switchyard::cli::WithFlagConventions(__VA_ARGS__))
