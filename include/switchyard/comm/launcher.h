// Starting ranks: the one way library code runs a function on every rank of a world, whatever
// the transport. The program (the CLI, a test, an embedding application) creates the launcher it
// wants -- ranks as threads of this process (comm/inprocess.h: CreateInProcessLauncher) or this
// process as one rank of an MPI job (comm/mpi.h: CreateMpiLauncher) -- and hands it to library
// code, which never names a concrete transport.
//
// Thread-safety: Run is called from one thread at a time.
#pragma once

#include <functional>
#include <string_view>

#include "switchyard/comm/communicator.h"

namespace switchyard::comm {

class Launcher {
 public:
  virtual ~Launcher() = default;

  // Ranks in the world.
  virtual int world_size() const = 0;
  // Ranks that Run runs in this process (world_size() for threads, 1 for MPI): they share its
  // cores and memory.
  virtual int ranks_in_process() const = 0;
  // "inprocess" or "mpi" (as Communicator::transport_kind).
  virtual std::string_view kind() const = 0;

  // Runs fn(world communicator of the rank) for every rank of this process and returns when all
  // returned. A rank whose fn throws tells its peers (their collectives on it fail at once or
  // at their deadline, naming it); Run rethrows the first error thrown by a rank of this
  // process after every rank of this process finished.
  virtual void Run(const std::function<void(Communicator& world)>& fn) = 0;
};

}  // namespace switchyard::comm
