// The threading policy of switchyard.
//
// A process runs R ranks (R = 1 under MPI, R = W for the in-process transport). The machine's
// usable cores (the affinity mask) are shared between them: each rank gets
// max(1, cores / R) compute threads, which it uses for BLAS and for its own parallel loops.
// Ranks never start more compute threads than that, so ranks-as-threads never oversubscribe
// the cores. Communication progress threads are not compute threads: they block or yield.
#pragma once

#include <cstdint>

namespace switchyard {

// Cores this process may run on (sched_getaffinity), at least 1.
int UsableCores();

// Compute threads for one rank when `ranks_in_process` ranks share `cores` cores.
int ComputeThreadsPerRank(int ranks_in_process, int cores);

}  // namespace switchyard
