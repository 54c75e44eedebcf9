// A minimal parallel loop for the moe layer's row kernels (private).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace switchyard::moe {

// Calls fn(begin, end) on contiguous chunks of [0, n) from up to `threads` threads (the caller's
// thread included). Ranges shorter than `grain` per thread run on the caller alone. Exceptions
// are rethrown on the caller after every chunk has finished.
template <typename Fn>
void ParallelFor(int64_t n, int threads, int64_t grain, Fn&& fn) {
  int64_t workers = std::min<int64_t>(std::max(1, threads), n / std::max<int64_t>(1, grain));
  if (workers <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  auto run = [&](int64_t w) {
    try {
      fn(n * w / workers, n * (w + 1) / workers);
    } catch (...) {
      errors[static_cast<size_t>(w)] = std::current_exception();
    }
  };
  {
    std::vector<std::jthread> pool;
    pool.reserve(static_cast<size_t>(workers - 1));
    for (int64_t w = 1; w < workers; ++w) pool.emplace_back(run, w);
    run(0);
  }
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace switchyard::moe
