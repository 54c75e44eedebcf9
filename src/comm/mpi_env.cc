// Finding out whether this process was started by an MPI launcher, and the process-wide record of
// a failure relayed by a peer (built with or without MPI).
#include <atomic>
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

namespace {
std::atomic<bool> g_failure_reported_by_peer{false};
}  // namespace

void NoteFailureReportedByPeer() { g_failure_reported_by_peer.store(true); }
bool FailureReportedByPeer() { return g_failure_reported_by_peer.load(); }

}  // namespace switchyard::comm
