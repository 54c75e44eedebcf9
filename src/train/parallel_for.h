// Compute threads of the train layer (private): a persistent pool per calling thread (so that
// ranks running as threads each have their own), a parallel loop, and GEMMs split by rows over
// the pool with single-threaded BLAS calls.
//
// Why not OpenBLAS's own threads: between calls its idle workers spin in sched_yield, which
// took ~35% of the CPU time of a training step (perf, 2 cores) and competes with the
// attention and element-wise work running on the same cores. The pool's workers block.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "switchyard/kernels/gemm.h"

namespace switchyard::train {

// Workers that run fn(i) for i in [0, tasks) together with the caller. Blocking (no spinning).
// Not reentrant: Run must not be called from inside a task.
class WorkerPool {
 public:
  explicit WorkerPool(int threads);  // threads - 1 workers plus the caller
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Tasks are handed out dynamically; the first exception is rethrown after all finished.
  void Run(int64_t tasks, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunTasks();

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t tasks_ = 0;
  int64_t next_ = 0;
  int64_t generation_ = 0;
  int busy_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The calling thread's pool with `threads` threads (created or resized on demand).
WorkerPool& LocalPool(int threads);

// Calls fn(begin, end) on `threads` contiguous chunks of [0, n) (fewer when n is small), on the
// calling thread's pool. The chunks depend only on n and threads, so results do not depend on
// which thread runs which chunk.
void ParallelFor(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn);

// kernels::Gemm with the m rows of op(A) and C split over `threads` threads (each BLAS call
// single-threaded); small products run on the caller.
void ParallelGemm(kernels::Trans trans_a, kernels::Trans trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                  float* c, int64_t ldc, int threads);

}  // namespace switchyard::train
