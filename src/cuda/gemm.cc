#include "cuda/gemm.h"

#include <algorithm>
#include <limits>

namespace switchyard::cuda::detail {
namespace {

int Int(int64_t v, const char* what) {
  SY_REQUIRE(v >= 0 && v <= std::numeric_limits<int>::max(), InvalidArgument,
             "GEMM {} = {} exceeds cuBLAS's int range", what, v);
  return static_cast<int>(v);
}

bool Empty(const GemmProblem& p) { return p.m == 0 || p.n == 0 || p.k == 0; }

}  // namespace

GroupedGemm::~GroupedGemm() {
  for (Lane& l : lanes_) {
    if (l.handle != nullptr) cublasDestroy(l.handle);
    if (l.done != nullptr) cudaEventDestroy(l.done);
    if (l.stream != nullptr) cudaStreamDestroy(l.stream);
  }
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  for (Slot& s : slots_) {
    if (s.copied != nullptr) cudaEventDestroy(s.copied);
    if (s.host != nullptr) cudaFreeHost(static_cast<void*>(s.host));
  }
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap places and
// keep their transposes (a row-major matrix read column-major is its transpose).
void Gemm(cublasHandle_t handle, bool trans_a, bool trans_b, const GemmProblem& p, GemmTypes types,
          float beta, cublasComputeType_t compute) {
  if (Empty(p)) return;
  const float alpha = 1.0f;
  CheckCublas(
      cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                   Int(p.n, "n"), Int(p.m, "m"), Int(p.k, "k"), &alpha, p.b, types.ab,
                   Int(p.ldb, "ldb"), p.a, types.ab, Int(p.lda, "lda"), &beta, p.c, types.c,
                   Int(p.ldc, "ldc"), compute, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

void GroupedGemm::Run(cublasHandle_t handle, bool trans_a, bool trans_b,
                      const std::vector<GemmProblem>& problems, GemmTypes types, float beta) {
  std::vector<const GemmProblem*> live;
  for (const GemmProblem& p : problems) {
    if (!Empty(p)) live.push_back(&p);
  }
  if (live.empty()) return;
  if (mode_ == GemmMode::kGrouped && live.size() > 1) {
    const size_t g = live.size();
    std::vector<cublasOperation_t> op_a(g, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
    std::vector<cublasOperation_t> op_b(g, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    std::vector<int> m(g), n(g), k(g), lda(g), ldb(g), ldc(g), size(g, 1);
    std::vector<float> alpha(g, 1.0f), betas(g, beta);
    Slot& slot = slots_[next_];
    next_ = (next_ + 1) % kSlots;
    if (slot.copied == nullptr) {
      CheckCuda(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming), "cudaEventCreate");
    }
    CheckCuda(cudaEventSynchronize(slot.copied), "cudaEventSynchronize");
    if (slot.capacity < 3 * g) {
      if (slot.host != nullptr) CheckCuda(cudaFreeHost(static_cast<void*>(slot.host)), "free");
      slot.host = nullptr;
      void* h = nullptr;
      CheckCuda(cudaMallocHost(&h, 3 * g * sizeof(void*)), "cudaMallocHost");
      slot.host = static_cast<const void**>(h);
      slot.capacity = 3 * g;
    }
    const void** host = slot.host;
    for (size_t i = 0; i < g; ++i) {
      const GemmProblem& p = *live[i];
      // Column-major view: (n, m, k) with B first.
      m[i] = Int(p.n, "n");
      n[i] = Int(p.m, "m");
      k[i] = Int(p.k, "k");
      lda[i] = Int(p.ldb, "ldb");
      ldb[i] = Int(p.lda, "lda");
      ldc[i] = Int(p.ldc, "ldc");
      host[i] = p.b;
      host[g + i] = p.a;
      host[2 * g + i] = p.c;
    }
    auto** dev = static_cast<void**>(slot.device.Ensure(3 * g * sizeof(void*)));
    cudaStream_t stream = nullptr;
    CheckCublas(cublasGetStream(handle, &stream), "cublasGetStream");
    CheckCuda(cudaMemcpyAsync(dev, host, 3 * g * sizeof(void*), cudaMemcpyHostToDevice, stream),
              "copy of the grouped GEMM's pointers");
    CheckCuda(cudaEventRecord(slot.copied, stream), "cudaEventRecord");
    cublasStatus_t st = cublasGemmGroupedBatchedEx(
        handle, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alpha.data(), dev, types.ab,
        lda.data(), dev + g, types.ab, ldb.data(), betas.data(), dev + 2 * g, types.c, ldc.data(),
        static_cast<int>(g), size.data(), CUBLAS_COMPUTE_32F);
    if (st == CUBLAS_STATUS_SUCCESS) return;
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) CheckCublas(st, "cublasGemmGroupedBatchedEx");
    fell_back_ = true;
  }
  RunLoop(handle, trans_a, trans_b, live, types, beta);
}

void GroupedGemm::RunLoop(cublasHandle_t handle, bool trans_a, bool trans_b,
                          const std::vector<const GemmProblem*>& live, GemmTypes types,
                          float beta) {
  if (live.size() == 1) {
    Gemm(handle, trans_a, trans_b, *live[0], types, beta);
    return;
  }
  cudaStream_t main = nullptr;
  CheckCublas(cublasGetStream(handle, &main), "cublasGetStream");
  if (fork_ == nullptr) {
    CheckCuda(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "cudaEventCreate");
    for (Lane& l : lanes_) {
      CheckCuda(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      CheckCuda(cudaEventCreateWithFlags(&l.done, cudaEventDisableTiming), "cudaEventCreate");
      CheckCublas(cublasCreate(&l.handle), "cublasCreate");
      CheckCublas(cublasSetStream(l.handle, l.stream), "cublasSetStream");
    }
  }
  const int lanes = static_cast<int>(std::min<size_t>(kLanes, live.size()));
  CheckCuda(cudaEventRecord(fork_, main), "cudaEventRecord");
  for (int i = 0; i < lanes; ++i) {
    CheckCuda(cudaStreamWaitEvent(lanes_[i].stream, fork_, 0), "cudaStreamWaitEvent");
  }
  for (size_t i = 0; i < live.size(); ++i) {
    Gemm(lanes_[i % static_cast<size_t>(lanes)].handle, trans_a, trans_b, *live[i], types, beta);
  }
  for (int i = 0; i < lanes; ++i) {
    CheckCuda(cudaEventRecord(lanes_[i].done, lanes_[i].stream), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(main, lanes_[i].done, 0), "cudaStreamWaitEvent");
  }
}

}  // namespace switchyard::cuda::detail
