// Finding out whether this process was started by an MPI launcher (built with or without MPI).
#include <cstdlib>

#include "switchyard/comm/mpi.h"

namespace switchyard::comm {

bool RunningUnderMpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK",
                           "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

}  // namespace switchyard::comm
