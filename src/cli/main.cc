// `switchyard`: the command-line tool. Subcommands register themselves (see command.h).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <map>
#include <new>
#include <thread>

#include "cli/command.h"
#include "cli/flags.h"
#include "switchyard/comm/mpi.h"
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
  parents["bench"] =
      app.add_subcommand("bench", "Benchmarks: GEMM, collectives, MoE layer, tensor parallelism");
  parents["bench"]->require_subcommand(1);
  parents["tokenizer"] = app.add_subcommand(
      "tokenizer", "Tokenizers: train a SentencePiece model, encode and decode text");
  parents["tokenizer"]->require_subcommand(1);

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
    // Printed by main(), once per job under mpirun.
    throw InvalidArgument(fmt::format("{} (see --help)", e.what()));
  }
  for (auto& [sub, action] : actions) {
    if (!sub->parsed()) continue;
    try {
      return action();
    } catch (const std::bad_alloc&) {
      // The last line of defence (docs/errors.md, "Sizes that cannot fit"): every command checks
      // its memory need up front, so this is an allocation nobody foresaw or memory that another
      // process took meanwhile. One line naming the command, never a bare std::bad_alloc.
      const std::string parent =
          sub->get_parent() != &app ? sub->get_parent()->get_name() + " " : "";
      throw OutOfMemory(fmt::format(
          "{}{}: out of memory: an allocation failed (std::bad_alloc): the system or a limit "
          "(ulimit -v, the cgroup) gives this process no more; give smaller sizes or free memory",
          parent, sub->get_name()));
    }
  }
  std::fprintf(stderr, "switchyard: error: no command given (see --help)\n");
  return 2;
}

}  // namespace
}  // namespace switchyard::cli

namespace switchyard::cli {
namespace {

// Under an MPI launcher (docs/errors.md): a rank whose failure a peer reports waits this long for
// that peer to end the job before it reports (and ends it) itself...
constexpr auto kPeerReportGrace = std::chrono::seconds(3);
// ...and a rank other than 0 waits this long before reporting its own error: an error that every
// rank finds alike (a bad flag given to all of them) is then printed once, by rank 0.
constexpr auto kNonZeroRankDelay = std::chrono::seconds(1);
constexpr auto kForwardOutput = std::chrono::milliseconds(200);

// Prints the error once and returns the exit code. In a multi-process MPI job it ends every
// process of the job instead: a rank that merely returned would hang in MPI_Finalize while its
// peers wait for it until their deadlines. (A rank that fails before MPI is initialized just
// exits; mpirun then ends the job because its exit code is not 0.)
int Fail(int exit_code, const char* what) {
  const int launcher_rank = comm::LauncherRank();
  if (launcher_rank >= 0 && comm::LauncherSize() > 1) {
    if (comm::FailureReportedByPeer()) {
      std::this_thread::sleep_for(kPeerReportGrace);
    } else if (launcher_rank != 0) {
      std::this_thread::sleep_for(kNonZeroRankDelay);
    }
  }
  if (!comm::InMultiProcessMpiJob()) {
    if (what != nullptr) std::fprintf(stderr, "switchyard: error: %s\n", what);
    return exit_code;
  }
  if (what != nullptr) {
    std::fprintf(stderr, "switchyard: error: MPI rank %d of %d: %s\n", comm::MpiWorldRank(),
                 comm::MpiWorldSize(), what);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  // mpirun forwards a rank's output asynchronously: a moment for this line to come out ahead of
  // OpenMPI's own abort notice.
  std::this_thread::sleep_for(kForwardOutput);
  comm::AbortMpiJob(exit_code);
}

}  // namespace
}  // namespace switchyard::cli

int main(int argc, char** argv) {
  using switchyard::cli::Fail;
  std::signal(SIGXFSZ, SIG_IGN);  // a file size limit fails the write (an error), not the process
  try {
    const int rc = switchyard::cli::Main(argc, argv);
    return rc == 0 ? 0 : Fail(rc, nullptr);
  } catch (const switchyard::InvalidArgument& e) {
    return Fail(2, e.what());
  } catch (const std::bad_alloc&) {
    // Out of memory while parsing, or in a thread whose error was handed on as it was.
    return Fail(1,
                "out of memory: an allocation failed (std::bad_alloc); give smaller sizes or "
                "free memory");
  } catch (const std::exception& e) {
    return Fail(1, e.what());
  }
}
