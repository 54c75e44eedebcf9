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

// Finalizes MPI if switchyard initialized it; call after every MPI communicator was destroyed.
// Also runs at exit. A no-op without MPI.
void FinalizeMpi();

}  // namespace switchyard::comm
