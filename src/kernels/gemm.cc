#include "switchyard/kernels/gemm.h"

#include <cblas.h>
#include <dlfcn.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/core/thread_pool.h"
#include "switchyard/kernels/gemm_backend.h"

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

// The process's GEMM thread budget (SetBlasThreads); 0 = not set yet (OpenBLAS's default).
std::atomic<int> g_threads{0};

// One cblas_sgemm: single-threaded once SetBlasThreads has set OpenBLAS's own pool to 1 thread.
void OpenBlasGemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ToCblas(trans_a), ToCblas(trans_b), static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

// The OpenMP runtime's omp_set_num_threads, looked up in the process (Debian's libdnnl is built
// with OpenMP and loads libgomp); null for a oneDNN without OpenMP threads. Looked up at run time
// so that switchyard needs no OpenMP headers or flags of its own (its clang builds have none).
using SetNumThreadsFn = void (*)(int);
SetNumThreadsFn OmpSetNumThreads() {
  static const SetNumThreadsFn fn =
      reinterpret_cast<SetNumThreadsFn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  return fn;
}

// One single-threaded dnnl_sgemm. oneDNN's threads are OpenMP's: the calling thread's OpenMP
// thread count is set to 1 once (it is per thread in libgomp), so oneDNN never starts a team and
// each rank thread stays inside its own budget.
void OneDnnGemm1(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) {
  thread_local bool single = false;
  if (!single) {
    if (SetNumThreadsFn set = OmpSetNumThreads()) set(1);
    single = true;
  }
  dnnl_status_t st =
      dnnl_sgemm(trans_a == Trans::kYes ? 'T' : 'N', trans_b == Trans::kYes ? 'T' : 'N', m, n, k,
                 alpha, a, lda, b, ldb, beta, c, ldc);
  SY_CHECK(st == dnnl_success, "dnnl_sgemm({}x{}x{}) failed with status {}", m, n, k,
           static_cast<int>(st));
}

// Below this many multiply-adds a GEMM runs on one thread (splitting costs more than it gives).
constexpr double kSplitMinMacs = 1 << 20;

using GemmFn = void (*)(Trans, Trans, int64_t, int64_t, int64_t, float, const float*, int64_t,
                        const float*, int64_t, float, float*, int64_t);

// Both backends: C is split into `threads` blocks of rows (or of columns when C is wide and
// short), one single-threaded call of `gemm1` each on the calling thread's pool
// (core/thread_pool.h). So every rank computes inside its own budget whatever the backend, and
// concurrent ranks never queue on one BLAS thread pool.
void SplitGemm(GemmFn gemm1, int threads, Trans trans_a, Trans trans_b, int64_t m, int64_t n,
               int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
               float beta, float* c, int64_t ldc) {
  const double macs = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  if (threads <= 1 || macs < kSplitMinMacs) {
    gemm1(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const bool split_rows = m >= 8 * threads && m * 2 >= n / 4;
  const int64_t extent = split_rows ? m : n;
  const int64_t align = split_rows ? 8 : 16;  // block edges on kernel tile boundaries
  const int64_t units = (extent + align - 1) / align;
  const int parts = static_cast<int>(std::min<int64_t>(threads, units));
  // `threads` (not `parts`) names the pool, so the calling thread's pool keeps its size.
  ParallelFor(parts, threads, 1, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t begin = std::min(extent, units * p / parts * align);
      const int64_t end = std::min(extent, units * (p + 1) / parts * align);
      if (end <= begin) continue;
      if (split_rows) {
        const float* ap = trans_a == Trans::kNo ? a + begin * lda : a + begin;
        gemm1(trans_a, trans_b, end - begin, n, k, alpha, ap, lda, b, ldb, beta, c + begin * ldc,
              ldc);
      } else {
        const float* bp = trans_b == Trans::kNo ? b + begin : b + begin * ldb;
        gemm1(trans_a, trans_b, m, end - begin, k, alpha, a, lda, bp, ldb, beta, c + begin, ldc);
      }
    }
  });
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
  const int budget = g_threads.load(std::memory_order_relaxed);
  if (ActiveGemmBackend() == GemmBackend::kOneDnn) {
    // The budget GroupedGemm reads (OpenBLAS's default until SetBlasThreads is called).
    SplitGemm(OneDnnGemm1, std::max(1, BlasThreads()), trans_a, trans_b, m, n, k, alpha, a, lda, b,
              ldb, beta, c, ldc);
  } else if (budget == 0) {
    // No budget set (a program that never called SetBlasThreads): OpenBLAS's own threads.
    OpenBlasGemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    SplitGemm(OpenBlasGemm, budget, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

void GroupedGemm(Trans trans_a, Trans trans_b, float alpha, float beta,
                 std::span<const GemmProblem> problems, int threads) {
  auto run = [&](const GemmProblem& p) {
    Gemm(trans_a, trans_b, p.m, p.n, p.k, alpha, p.a, p.lda, p.b, p.ldb, beta, p.c, p.ldc);
  };
  // Spreading problems over threads only pays (and only avoids oversubscription) when the GEMM
  // budget is one thread (each Gemm would split itself otherwise) and there are at least as many
  // problems as threads.
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

void SetBlasThreads(int threads) {
  threads = std::max(1, threads);
  g_threads.store(threads);
  // switchyard splits every product over the budget itself (SplitGemm), with both backends.
  openblas_set_num_threads(1);
}

int BlasThreads() {
  const int t = g_threads.load(std::memory_order_relaxed);
  return t > 0 ? t : openblas_get_num_threads();
}
const char* BlasConfig() { return openblas_get_config(); }

}  // namespace switchyard::kernels
