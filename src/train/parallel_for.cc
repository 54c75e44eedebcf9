#include "train/parallel_for.h"

#include <algorithm>
#include <memory>

namespace switchyard::train {

WorkerPool::WorkerPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
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
  if (workers_.empty() || tasks == 1) {
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

void ParallelFor(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  int64_t chunks = std::min<int64_t>(std::max(1, threads), n);
  if (chunks <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  LocalPool(threads).Run(chunks, [&](int64_t i) { fn(n * i / chunks, n * (i + 1) / chunks); });
}

void ParallelGemm(kernels::Trans trans_a, kernels::Trans trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                  float* c, int64_t ldc, int threads) {
  // Below ~1 MFLOP per thread the split costs more than it saves.
  constexpr double kMinFlopsPerThread = 1 << 20;
  double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  int64_t parts = std::min<int64_t>(threads, static_cast<int64_t>(flops / kMinFlopsPerThread));
  parts = std::min<int64_t>(parts, m / 16);  // rows per part: at least 16
  if (parts <= 1) {
    kernels::Gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  LocalPool(threads).Run(parts, [&](int64_t i) {
    // Row boundaries on multiples of 16 (whole micro-kernel panels).
    int64_t r0 = (m * i / parts) / 16 * 16;
    int64_t r1 = i + 1 == parts ? m : (m * (i + 1) / parts) / 16 * 16;
    const float* ai = trans_a == kernels::Trans::kNo ? a + r0 * lda : a + r0;
    kernels::Gemm(trans_a, trans_b, r1 - r0, n, k, alpha, ai, lda, b, ldb, beta, c + r0 * ldc, ldc);
  });
}

}  // namespace switchyard::train
