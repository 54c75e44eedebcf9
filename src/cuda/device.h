// Small helpers of the CUDA layer: error checks that throw, and a grow-only device buffer.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "switchyard/core/error.h"

namespace switchyard::cuda::detail {

inline void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(err));
  }
}
inline void CheckCublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw Error(std::string("cuBLAS: ") + what + ": " + cublasGetStatusString(st));
  }
}

// Device memory that only grows: a layer reuses its buffers from step to step (cudaMalloc and
// cudaFree synchronize the device).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  // At least `bytes` bytes; the old contents are lost when it grows.
  void* Ensure(size_t bytes) {
    if (bytes > bytes_) {
      if (ptr_ != nullptr) CheckCuda(cudaFree(ptr_), "cudaFree");
      ptr_ = nullptr;
      bytes_ = 0;
      CheckCuda(cudaMalloc(&ptr_, bytes > 0 ? bytes : 1),
                ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
      bytes_ = bytes;
    }
    return ptr_;
  }
  template <typename T>
  T* As(size_t count) {
    return static_cast<T*>(Ensure(count * sizeof(T)));
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace switchyard::cuda::detail
