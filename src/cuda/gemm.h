// Row-major GEMMs through cuBLAS: one product (Gemm) or one product per expert (GroupedGemm,
// cublasGemmGroupedBatchedEx or a loop of cublasGemmEx). Products with an empty dimension are
// skipped (their outputs are left as they are: callers zero what must read as zero).
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <vector>

#include "cuda/device.h"
#include "switchyard/cuda/moe_layer.h"

namespace switchyard::cuda::detail {

// C[m, n] = op(A) · op(B) + beta · C, row-major; op(A) is [m, k], op(B) is [k, n].
struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
};

struct GemmTypes {
  cudaDataType_t ab;  // A and B
  cudaDataType_t c;
};

// `compute`: CUBLAS_COMPUTE_32F (the default: float32 arithmetic, no TF32) or
// CUBLAS_COMPUTE_32F_FAST_TF32 (float32 operands rounded to TF32 on the tensor cores).
void Gemm(cublasHandle_t handle, bool trans_a, bool trans_b, const GemmProblem& p, GemmTypes types,
          float beta, cublasComputeType_t compute = CUBLAS_COMPUTE_32F);

class GroupedGemm {
 public:
  explicit GroupedGemm(GemmMode mode) : mode_(mode) {}
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;
  // Runs every problem (the same transposes, types and beta for all) on the handle's stream.
  void Run(cublasHandle_t handle, bool trans_a, bool trans_b,
           const std::vector<GemmProblem>& problems, GemmTypes types, float beta);
  // True once a grouped call was refused by cuBLAS (NOT_SUPPORTED: e.g. bfloat16 operands with a
  // float32 output) and ran as the loop instead.
  bool fell_back() const { return fell_back_; }

 private:
  GemmMode mode_;
  bool fell_back_ = false;
  // The pointer arrays travel through a ring of pinned host slots (a copy from pageable memory
  // would wait for the stream); a slot is reused once the event of its last copy has passed.
  static constexpr int kSlots = 8;
  struct Slot {
    DeviceBuffer device;
    const void** host = nullptr;
    size_t capacity = 0;  // pointers
    cudaEvent_t copied = nullptr;
  };
  Slot slots_[kSlots];
  int next_ = 0;
  // The loop spreads the experts' products over kLanes streams (one cuBLAS handle each), forked
  // from and joined back into the caller's stream: one product's ramp-up and tail overlap
  // another's.
  static constexpr int kLanes = 4;
  struct Lane {
    cudaStream_t stream = nullptr;
    cublasHandle_t handle = nullptr;
    cudaEvent_t done = nullptr;
  };
  Lane lanes_[kLanes];
  cudaEvent_t fork_ = nullptr;
  void RunLoop(cublasHandle_t handle, bool trans_a, bool trans_b,
               const std::vector<const GemmProblem*>& live, GemmTypes types, float beta);
};

}  // namespace switchyard::cuda::detail
