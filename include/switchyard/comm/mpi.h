// The MPI transport: ranks are processes started by mpirun/srun (OpenMPI). The same binary finds
// out that it runs under MPI from the launcher's environment. Launch on this machine with
// scripts/mpirun.sh (root, oversubscription and shared-memory flags), e.g.
//   scripts/mpirun.sh -np 4 build/release/src/cli/switchyard bench comm --transport mpi --op
//   alltoall
//
// Point-to-point: MPI_Isend/MPI_Irecv on a communicator of its own, a small header message
// before each payload; waits poll MPI_Test with a deadline (yielding the core between polls).
// Algorithm::kNative delegates a collective to MPI's own non-blocking collective (MPI_I*).
// MPI is initialized with MPI_THREAD_MULTIPLE (communicators run on progress threads).
//
// Built only with SY_WITH_MPI=ON; otherwise CreateMpiWorld throws InvalidArgument saying so.
#pragma once

#include <memory>
#include <string>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/launcher.h"
#include "switchyard/comm/types.h"

namespace switchyard::comm {

// True if this build has the MPI transport.
bool MpiCompiledIn();
// True if the environment is that of a process started by an MPI launcher (OMPI_COMM_WORLD_SIZE,
// PMI_SIZE, PMIX_RANK, ...).
bool RunningUnderMpi();

struct MpiOptions {
  // Default deadline of every collective.
  Milliseconds timeout{60000};
  // Ranks per node for topology(); 0 = detected (MPI_Comm_split_type SHARED, if uniform).
  int ranks_per_node = 0;
  std::string name = "world";
};

// The communicator of all MPI processes. Initializes MPI on first use. Throws InvalidArgument if
// MPI is not compiled in, or MPI gives less than MPI_THREAD_MULTIPLE.
std::unique_ptr<Communicator> CreateMpiWorld(const MpiOptions& options = {});

// A launcher whose Run runs fn once, on this process's rank of the MPI world (created here, which
// initializes MPI, and kept for the launcher's life). Throws InvalidArgument if MPI is not compiled
// in or this process was not started by an MPI launcher.
std::unique_ptr<Launcher> CreateMpiLauncher(const MpiOptions& options = {});

// Finalizes MPI if switchyard initialized it; call after every MPI communicator was destroyed.
// Also runs at exit. A no-op without MPI.
void FinalizeMpi();

// ---- Ending a multi-process job after a failure (docs/errors.md) ----
//
// One failing process must end the whole job: after an error its peers may wait on it until
// their deadlines, and MPI_Finalize waits for every process, so a failed rank that merely
// returned would hang. The program's top level (the CLI, never library code) prints the error
// and calls AbortMpiJob. So that the user reads the root cause first and once, a rank whose
// failure was only relayed to it by a peer (the peer's failure notice, a timeout that a lower
// rank reports, a configuration disagreement that rank 0 reports) records that with
// NoteFailureReportedByPeer and waits a moment before printing: normally the reporting rank's
// AbortMpiJob ends it meanwhile.

// This process's rank and the job's size as the MPI launcher put them in the environment
// (OMPI_COMM_WORLD_RANK / _SIZE, PMIX_RANK, PMI_RANK / PMI_SIZE), known before MPI is
// initialized; -1 and 0 when not started by a launcher (or it does not say).
int LauncherRank();
int LauncherSize();
// True when this process is one rank of an MPI job of more than one process that is still
// running (MPI initialized and not finalized). False without MPI.
bool InMultiProcessMpiJob();
// This process's MPI world rank and size (0 and 1 outside a multi-process job).
int MpiWorldRank();
int MpiWorldSize();
// Ends every process of the MPI job with `exit_code` (MPI_Abort on MPI_COMM_WORLD; mpirun exits
// with that code). Never returns; without MPI it calls std::_Exit(exit_code).
[[noreturn]] void AbortMpiJob(int exit_code);
// Records that this process failed because of another rank, which reports the root cause itself
// (process-wide, never reset). Thread-safe.
void NoteFailureReportedByPeer();
bool FailureReportedByPeer();

}  // namespace switchyard::comm
