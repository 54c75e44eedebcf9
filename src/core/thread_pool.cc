#include "switchyard/core/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <memory>
#include <string>

namespace switchyard {

namespace {
// True while this thread runs tasks of some pool (as the caller or as a worker).
thread_local bool in_task = false;

struct InTaskScope {
  bool previous = in_task;
  InTaskScope() { in_task = true; }
  ~InTaskScope() { in_task = previous; }
};
}  // namespace

namespace {
void SetName(pthread_t thread, std::string_view name) {
  const std::string cut(name.substr(0, 15));
  pthread_setname_np(thread, cut.c_str());
}
}  // namespace

void SetThreadName(std::string_view name) { SetName(pthread_self(), name); }

void SetThreadName(std::thread& thread, std::string_view name) {
  SetName(thread.native_handle(), name);
}

WorkerPool::WorkerPool(int threads) {
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
    SetThreadName(workers_.back(), "sy-pool");
  }
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void WorkerPool::RunTasks() {
  InTaskScope scope;
  for (;;) {
    int64_t i;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= tasks_) return;
      i = next_++;
    }
    try {
      (*fn_)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void WorkerPool::WorkerLoop() {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++busy_;
    }
    RunTasks();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_cv_.notify_one();
    }
  }
}

void WorkerPool::Run(int64_t tasks, const std::function<void(int64_t)>& fn) {
  if (tasks <= 0) return;
  if (workers_.empty() || tasks == 1 || in_task) {
    InTaskScope scope;
    for (int64_t i = 0; i < tasks; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  work_cv_.notify_all();
  RunTasks();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Every task has been handed out; wait for the workers still running one. A worker that
    // wakes late finds no task left and only touches busy_.
    done_cv_.wait(lock, [&] { return busy_ == 0; });
    fn_ = nullptr;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

WorkerPool& LocalPool(int threads) {
  thread_local std::unique_ptr<WorkerPool> pool;
  threads = std::max(1, threads);
  if (!pool || pool->threads() != threads) pool = std::make_unique<WorkerPool>(threads);
  return *pool;
}

void ParallelFor(int64_t n, int threads, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn) {
  int64_t chunks = std::min<int64_t>(std::max(1, threads), n / std::max<int64_t>(1, grain));
  if (chunks <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  LocalPool(threads).Run(chunks, [&](int64_t i) { fn(n * i / chunks, n * (i + 1) / chunks); });
}

}  // namespace switchyard
