// Which collective algorithm the engine runs: the one selection function, public so that a cost
// model (plan/step_model.cc) prices the algorithm a collective will really use.
#pragma once

#include <cstddef>
#include <string_view>

#include "switchyard/comm/types.h"

namespace switchyard::comm {

// The one place where algorithms are chosen. Checks that `requested` is one the collective
// offers -- a row of the launch table (InvalidArgument listing them otherwise) -- and resolves
// kAuto from the message size in bytes (equal on every rank), the group size, the topology and
// the transport's kind() ("inprocess", "mpi", or a user transport's name). has_native: the
// transport has its own collectives (Transport::native()). Thread-safe (a pure function).
Algorithm SelectAlgorithm(CollectiveKind kind, Algorithm requested, size_t bytes, int group_size,
                          const Topology& topology, bool has_native,
                          std::string_view transport_kind);

}  // namespace switchyard::comm
