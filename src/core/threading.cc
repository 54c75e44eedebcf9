#include "switchyard/core/threading.h"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace switchyard {

int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

int ComputeThreadsPerRank(int ranks_in_process, int cores) {
  return std::max(1, cores / std::max(1, ranks_in_process));
}

}  // namespace switchyard
