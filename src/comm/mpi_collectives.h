// MPI's own collectives (Algorithm::kNative) over one MPI communicator, and the MPI helpers they
// share with the MPI transport (mpi_transport.cc), which owns one per communicator. Private to
// src/comm; built only with SY_WITH_MPI=ON.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "switchyard/comm/transport.h"
#include "switchyard/core/error.h"

namespace switchyard::comm::mpi {

// MPI's text for an error code.
std::string ErrorString(int code);

// Runs an MPI call; throws PeerError naming the call and MPI's error unless it succeeded.
#define SY_MPI_CALL(call)                                                                        \
  do {                                                                                           \
    int sy_mpi_rc = (call);                                                                      \
    if (sy_mpi_rc != MPI_SUCCESS) {                                                              \
      throw ::switchyard::PeerError(                                                             \
          fmt::format("{} failed: {}", #call, ::switchyard::comm::mpi::ErrorString(sy_mpi_rc))); \
    }                                                                                            \
  } while (0)

// n as an MPI count; InvalidArgument naming `what` if it exceeds INT_MAX.
int ToInt(size_t n, const char* what);

// The reduction operators for bfloat16, which MPI lacks: created once after MPI is initialized,
// freed before it is finalized (both by the MPI runtime of mpi_transport.cc, under its lock).
void CreateBFloat16Ops();
void FreeBFloat16Ops();

// Waits for a non-blocking MPI collective until `deadline`. The transport provides it: while
// polling it watches its peers' failure notices, and at the deadline it throws TimeoutError
// naming the ranks that never arrived. `what` names the MPI call ("MPI_Iallreduce").
using PollFn = std::function<void(MPI_Request& request, Deadline deadline, const char* what)>;

// MPI's non-blocking collectives (MPI_Ibarrier, MPI_Iallreduce, ...) on `comm`, each awaited with
// `poll`. `comm` must outlive the result. Thread-safety as the transport's.
std::unique_ptr<NativeCollectives> CreateMpiCollectives(MPI_Comm comm, PollFn poll);

}  // namespace switchyard::comm::mpi
