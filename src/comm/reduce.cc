// Element-wise reductions. Written as plain loops over restrict-free pointers that GCC vectorizes
// at -O3 (dst may alias a or b element for element, which vectorization preserves).
#include "switchyard/comm/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

template <typename T, typename Op>
void Apply(T* dst, const T* a, const T* b, size_t n, Op op) {
  for (size_t i = 0; i < n; ++i) dst[i] = op(a[i], b[i]);
}

template <typename T>
void ReduceTyped(T* dst, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;  // wrap around instead of signed-overflow UB
        Apply(dst, a, b, n,
              [](T x, T y) { return static_cast<T>(static_cast<U>(x) + static_cast<U>(y)); });
      } else {
        Apply(dst, a, b, n, [](T x, T y) { return x + y; });
      }
      return;
    case ReduceOp::kMax: Apply(dst, a, b, n, [](T x, T y) { return x < y ? y : x; }); return;
    case ReduceOp::kMin: Apply(dst, a, b, n, [](T x, T y) { return y < x ? y : x; }); return;
  }
  SY_CHECK(false, "unknown reduce op {}", static_cast<int>(op));
}

// bfloat16 in blocks: widen to float32, reduce, round back.
void ReduceBFloat16(BFloat16* dst, const BFloat16* a, const BFloat16* b, size_t n, ReduceOp op) {
  constexpr size_t kBlock = 256;
  float fa[kBlock], fb[kBlock];
  for (size_t begin = 0; begin < n; begin += kBlock) {
    size_t m = std::min(kBlock, n - begin);
    for (size_t i = 0; i < m; ++i) {
      fa[i] = static_cast<float>(a[begin + i]);
      fb[i] = static_cast<float>(b[begin + i]);
    }
    ReduceTyped(fa, fa, fb, m, op);
    for (size_t i = 0; i < m; ++i) dst[begin + i] = BFloat16(fa[i]);
  }
}

}  // namespace

void ReduceInto(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      ReduceTyped(static_cast<float*>(dst), static_cast<const float*>(a),
                  static_cast<const float*>(b), count, op);
      return;
    case DType::kBFloat16:
      ReduceBFloat16(static_cast<BFloat16*>(dst), static_cast<const BFloat16*>(a),
                     static_cast<const BFloat16*>(b), count, op);
      return;
    case DType::kInt32:
      ReduceTyped(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a),
                  static_cast<const int32_t*>(b), count, op);
      return;
    case DType::kInt64:
      ReduceTyped(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a),
                  static_cast<const int64_t*>(b), count, op);
      return;
    case DType::kInt16:
      ReduceTyped(static_cast<int16_t*>(dst), static_cast<const int16_t*>(a),
                  static_cast<const int16_t*>(b), count, op);
      return;
  }
  SY_CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
}

}  // namespace switchyard::comm
