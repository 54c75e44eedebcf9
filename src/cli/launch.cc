#include "cli/launch.h"

#include <malloc.h>

#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"

namespace switchyard::cli {

std::string ResolveTransport(std::string_view transport) {
  if (transport == "auto") return comm::RunningUnderMpi() ? "mpi" : "inproc";
  SY_REQUIRE(transport == "inproc" || transport == "mpi", InvalidArgument,
             "--transport: expected auto, inproc or mpi, got '{}'", transport);
  return std::string(transport);
}

std::unique_ptr<comm::Launcher> MakeLauncher(const std::string& transport, int ranks,
                                             const comm::InProcessOptions& inprocess,
                                             std::string_view command) {
  if (transport != "mpi") return comm::CreateInProcessLauncher(ranks, inprocess);
  SY_REQUIRE(comm::MpiCompiledIn(), InvalidArgument,
             "--transport mpi: this switchyard was built without MPI");
  SY_REQUIRE(comm::RunningUnderMpi(), InvalidArgument,
             "--transport mpi: this process was not started by an MPI launcher, so it would run "
             "alone instead of on {} ranks; start every rank with one, e.g. scripts/mpirun.sh "
             "-np {} switchyard {} ...",
             ranks, ranks, command);
  return comm::CreateMpiLauncher();
}

bool KeepFreedMemoryForTraining() {
  bool ok = mallopt(M_MMAP_MAX, 0) == 1;          // large blocks from the heap, not mmap
  ok = mallopt(M_ARENA_MAX, 1) == 1 && ok;        // one heap for every thread
  ok = mallopt(M_TRIM_THRESHOLD, -1) == 1 && ok;  // never trim (as `bench layer`)
  return ok;
}

}  // namespace switchyard::cli
