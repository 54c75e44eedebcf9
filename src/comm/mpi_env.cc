// Finding out whether this process was started by an MPI launcher, and the process-wide record of
// a failure relayed by a peer (built with or without MPI).
#include <atomic>
#include <climits>
#include <cstdlib>
#include <initializer_list>

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

int FirstIntFromEnv(std::initializer_list<const char*> names, int none) {
  for (const char* name : names) {
    const char* text = std::getenv(name);
    if (text == nullptr || *text == '\0') continue;
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (*end == '\0' && v >= 0 && v <= INT_MAX) return static_cast<int>(v);
  }
  return none;
}

}  // namespace

int LauncherRank() {
  return FirstIntFromEnv({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}, -1);
}

int LauncherSize() {
  return FirstIntFromEnv({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}, 0);
}

void NoteFailureReportedByPeer() { g_failure_reported_by_peer.store(true); }
bool FailureReportedByPeer() { return g_failure_reported_by_peer.load(); }

}  // namespace switchyard::comm
