#include "switchyard/kernels/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::kernels {
namespace {

CBLAS_TRANSPOSE ToCblas(Trans t) { return t == Trans::kYes ? CblasTrans : CblasNoTrans; }

void CheckLeading(const char* what, Trans t, int64_t rows, int64_t cols, int64_t ld) {
  // Stored matrix is [rows, cols] for kNo and [cols, rows] for kYes.
  int64_t need = t == Trans::kNo ? cols : rows;
  SY_REQUIRE(ld >= std::max<int64_t>(1, need), InvalidArgument,
             "Gemm: leading dimension of {} is {}, expected >= {}", what, ld, need);
}

void ScaleC(int64_t m, int64_t n, float beta, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    if (beta == 0.0f) {
      std::fill_n(row, n, 0.0f);
    } else {
      for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

}  // namespace

void Gemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  SY_REQUIRE(m >= 0 && n >= 0 && k >= 0, InvalidArgument, "Gemm: negative size m={} n={} k={}", m,
             n, k);
  if (m == 0 || n == 0) return;
  SY_REQUIRE(ldc >= n, InvalidArgument, "Gemm: ldc {} < n {}", ldc, n);
  if (k == 0) {
    ScaleC(m, n, beta, c, ldc);
    return;
  }
  CheckLeading("A", trans_a, m, k, lda);
  CheckLeading("B", trans_b, k, n, ldb);
  cblas_sgemm(CblasRowMajor, ToCblas(trans_a), ToCblas(trans_b), static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void GroupedGemm(Trans trans_a, Trans trans_b, float alpha, float beta,
                 std::span<const GemmProblem> problems, int threads) {
  auto run = [&](const GemmProblem& p) {
    Gemm(trans_a, trans_b, p.m, p.n, p.k, alpha, p.a, p.lda, p.b, p.ldb, beta, p.c, p.ldc);
  };
  // Spreading problems over threads only pays (and only avoids oversubscription) when BLAS runs
  // single-threaded and there are at least as many problems as threads.
  int workers = std::min<int>(threads, static_cast<int>(problems.size()));
  if (workers <= 1 || BlasThreads() > 1) {
    for (const auto& p : problems) run(p);
    return;
  }
  // Largest problems first, handed out dynamically.
  std::vector<size_t> order(problems.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    const auto& p = problems[x];
    const auto& q = problems[y];
    return p.m * p.n * p.k > q.m * q.n * q.k;
  });
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto worker = [&] {
    try {
      for (size_t i; (i = next.fetch_add(1)) < order.size();) run(problems[order[i]]);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  };
  std::vector<std::jthread> pool;
  for (int t = 1; t < workers; ++t) pool.emplace_back(worker);
  worker();
  pool.clear();
  if (error) std::rethrow_exception(error);
}

void BatchedGemm(Trans trans_a, Trans trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                 float alpha, const float* a, int64_t lda, int64_t stride_a, const float* b,
                 int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                 int threads) {
  SY_REQUIRE(batch >= 0, InvalidArgument, "BatchedGemm: negative batch {}", batch);
  std::vector<GemmProblem> problems(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) {
    problems[static_cast<size_t>(i)] = {
        m, n, k, a + i * stride_a, lda, b + i * stride_b, ldb, c + i * stride_c, ldc};
  }
  GroupedGemm(trans_a, trans_b, alpha, beta, problems, threads);
}

void SetBlasThreads(int threads) { openblas_set_num_threads(std::max(1, threads)); }
int BlasThreads() { return openblas_get_num_threads(); }
const char* BlasConfig() { return openblas_get_config(); }

}  // namespace switchyard::kernels
