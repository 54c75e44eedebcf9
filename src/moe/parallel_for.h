// The moe layer's parallel loop for its row kernels (private): the shared pool of
// core/thread_pool.h (a persistent pool per rank thread instead of threads started per call).
#pragma once

#include <cstdint>
#include <utility>

#include "switchyard/core/thread_pool.h"

namespace switchyard::moe {

// Calls fn(begin, end) on min(threads, n / grain) contiguous chunks of [0, n) (the caller's
// thread included); see switchyard::ParallelFor.
template <typename Fn>
void ParallelFor(int64_t n, int threads, int64_t grain, Fn&& fn) {
  ::switchyard::ParallelFor(n, threads, grain, std::forward<Fn>(fn));
}

}  // namespace switchyard::moe
