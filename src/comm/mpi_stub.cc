// The MPI transport when switchyard is built with SY_WITH_MPI=OFF (e.g. the tsan preset).
#include <cstdlib>

#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {

bool MpiCompiledIn() { return false; }

std::unique_ptr<Communicator> CreateMpiWorld(const MpiOptions&) {
  throw InvalidArgument(
      "the MPI transport is not available: switchyard was built with SY_WITH_MPI=OFF "
      "(reconfigure with -DSY_WITH_MPI=ON and OpenMPI installed, or use the in-process transport)");
}

void FinalizeMpi() {}

bool InMultiProcessMpiJob() { return false; }
int MpiWorldRank() { return 0; }
int MpiWorldSize() { return 1; }
void AbortMpiJob(int exit_code) { std::_Exit(exit_code); }

}  // namespace switchyard::comm
