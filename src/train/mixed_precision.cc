#include "switchyard/train/mixed_precision.h"

#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/core/thread_pool.h"
#include "switchyard/kernels/gemm_backend.h"
#include "train/parallel_for.h"

namespace switchyard::train {
namespace {

constexpr int64_t kConvertGrain = 1 << 14;

// The stored rows x cols of an operand with leading dimension ld, packed into float32 with
// leading dimension cols.
std::vector<float> Unpack(const BFloat16* p, int64_t rows, int64_t cols, int64_t ld, int threads) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  ::switchyard::ParallelFor(rows, threads,
                            std::max<int64_t>(1, kConvertGrain / std::max<int64_t>(cols, 1)),
                            [&](int64_t b, int64_t e) {
                              for (int64_t i = b; i < e; ++i) {
                                const BFloat16* src = p + i * ld;
                                float* dst = out.data() + i * cols;
                                for (int64_t j = 0; j < cols; ++j)
                                  dst[j] = static_cast<float>(src[j]);
                              }
                            });
  return out;
}

}  // namespace

Precision PrecisionFromName(std::string_view name) {
  if (name == "fp32") return Precision::kFloat32;
  if (name == "bf16") return Precision::kBFloat16;
  throw InvalidArgument(fmt::format("precision: expected 'fp32' or 'bf16', got '{}'", name));
}

std::string_view PrecisionName(Precision precision) {
  return precision == Precision::kFloat32 ? "fp32" : "bf16";
}

Tensor ToBFloat16(const Tensor& x, int threads) {
  if (x.dtype() == DType::kBFloat16) return x;
  ExpectDType("bfloat16 conversion input", x, DType::kFloat32);
  Tensor out = Tensor::Empty(x.shape(), DType::kBFloat16);
  const float* src = x.data<float>();
  BFloat16* dst = out.data<BFloat16>();
  ::switchyard::ParallelFor(x.numel(), threads, kConvertGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = BFloat16(src[i]);
  });
  return out;
}

Tensor ToFloat32(const Tensor& x, int threads) {
  if (x.dtype() == DType::kFloat32) return x;
  ExpectDType("float32 conversion input", x, DType::kBFloat16);
  Tensor out = Tensor::Empty(x.shape());
  const BFloat16* src = x.data<BFloat16>();
  float* dst = out.data<float>();
  ::switchyard::ParallelFor(x.numel(), threads, kConvertGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = static_cast<float>(src[i]);
  });
  return out;
}

void RoundToBFloat16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(BFloat16(x[i]));
}

Tensor BFloat16Values(const Tensor& x, int threads) {
  if (x.dtype() == DType::kBFloat16) return ToFloat32(x, threads);
  ExpectDType("bfloat16 rounding input", x, DType::kFloat32);
  Tensor out = Tensor::Empty(x.shape());
  const float* src = x.data<float>();
  float* dst = out.data<float>();
  ::switchyard::ParallelFor(x.numel(), threads, kConvertGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = static_cast<float>(BFloat16(src[i]));
  });
  return out;
}

void ParallelGemmBFloat16(kernels::Trans trans_a, kernels::Trans trans_b, int64_t m, int64_t n,
                          int64_t k, float alpha, const BFloat16* a, int64_t lda, const BFloat16* b,
                          int64_t ldb, float beta, float* c, int64_t ldc, int threads) {
  using kernels::Trans;
  const int64_t a_rows = trans_a == Trans::kNo ? m : k, a_cols = trans_a == Trans::kNo ? k : m;
  const int64_t b_rows = trans_b == Trans::kNo ? k : n, b_cols = trans_b == Trans::kNo ? n : k;
  SY_REQUIRE(lda >= a_cols && ldb >= b_cols, InvalidArgument,
             "bfloat16 GEMM: leading dimensions {} and {} are below the rows' lengths {} and {}",
             lda, ldb, a_cols, b_cols);
  // bf16 arithmetic where the CPU has it (kernels/gemm_backend.h): bf16 operands, fp32
  // accumulation; the same products as the widened ones up to the order of the float sums.
  static_assert(sizeof(BFloat16) == sizeof(uint16_t));
  if (kernels::ActiveBf16Gemm().onednn_bf16 &&
      kernels::OneDnnGemmBf16(trans_a == Trans::kYes, trans_b == Trans::kYes, m, n, k, alpha,
                              reinterpret_cast<const uint16_t*>(a), lda,
                              reinterpret_cast<const uint16_t*>(b), ldb, beta, c, ldc)) {
    return;
  }
  std::vector<float> af = Unpack(a, a_rows, a_cols, lda, threads);
  std::vector<float> bf = Unpack(b, b_rows, b_cols, ldb, threads);
  ParallelGemm(trans_a, trans_b, m, n, k, alpha, af.data(), a_cols, bf.data(), b_cols, beta, c, ldc,
               threads);
}

}  // namespace switchyard::train
