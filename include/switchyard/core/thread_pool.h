// A rank's compute threads: a persistent, blocking worker pool per calling thread (so that ranks
// running as threads each have their own) and a parallel loop over it. Pool sizes follow the
// policy of core/threading.h: the caller passes its rank's compute-thread budget.
//
// Why a pool and not threads per call: the MoE layer and the trainer call parallel loops many
// times per step; starting threads each time costs tens of microseconds per call. Why blocking
// workers: OpenBLAS's own idle workers spin in sched_yield and compete with the rank's other work.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

namespace switchyard {

// Workers that run fn(i) for i in [0, tasks) together with the caller.
// A Run issued from inside a task (of any pool) runs its tasks inline on that thread, so nested
// parallel loops never deadlock and never exceed the budget.
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

// Names the calling thread for tools that list threads (/proc/PID/task/*/comm, top -H, gdb):
// "sy-pool" for pool workers, "sy-progress" for communicators' progress threads, "sy-rank3" for
// rank threads. Names longer than 15 characters are cut to 15 (the kernel's limit). The second
// form names `thread` from its creator, so the name is in place before the creator goes on.
void SetThreadName(std::string_view name);
void SetThreadName(std::thread& thread, std::string_view name);

// The calling thread's pool with `threads` threads (created or resized on demand).
WorkerPool& LocalPool(int threads);

// Calls fn(begin, end) on contiguous chunks of [0, n): min(threads, n / grain) chunks (at least
// one), chunk i = [n*i/chunks, n*(i+1)/chunks), on the calling thread's pool. The chunks depend
// only on n, threads and grain, so results do not depend on which thread runs which chunk.
// Exceptions are rethrown on the caller after every chunk has finished.
void ParallelFor(int64_t n, int threads, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn);

}  // namespace switchyard
