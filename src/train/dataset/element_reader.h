// Converting a dataset file's elements (Megatron's dtype table) to int32 token ids, shared by
// the Megatron and flat-file readers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

#include "switchyard/train/dataset/megatron.h"

namespace switchyard::train::dataset::detail {

template <typename T>
int64_t ConvertElements(const std::byte* src, std::span<int32_t> out) {
  int64_t bad = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    if constexpr (sizeof(T) >= 4) {
      if (v > static_cast<T>(std::numeric_limits<int32_t>::max()) ||
          v < static_cast<T>(std::numeric_limits<int32_t>::min())) {
        if (bad < 0) bad = static_cast<int64_t>(i);
        v = -1;  // reported below by the vocabulary check
      }
    }
    out[i] = static_cast<int32_t>(v);
  }
  return bad;
}

// Converts out.size() elements of type `dtype` at `src` into `out`. Returns the position of the
// first element that does not fit int32 (int64 data), or -1. Float dtypes are refused at open.
inline int64_t ConvertElements(MegatronDtype dtype, const std::byte* src, std::span<int32_t> out) {
  switch (dtype) {
    case MegatronDtype::kUint8: return ConvertElements<uint8_t>(src, out);
    case MegatronDtype::kInt8: return ConvertElements<int8_t>(src, out);
    case MegatronDtype::kInt16: return ConvertElements<int16_t>(src, out);
    case MegatronDtype::kUint16: return ConvertElements<uint16_t>(src, out);
    case MegatronDtype::kInt32: return ConvertElements<int32_t>(src, out);
    case MegatronDtype::kInt64: return ConvertElements<int64_t>(src, out);
    default: return 0;
  }
}

// The largest id the element type can hold (int32 max for the wide types).
inline int64_t MaxIdOf(MegatronDtype dtype) {
  switch (dtype) {
    case MegatronDtype::kUint8: return 255;
    case MegatronDtype::kInt8: return 127;
    case MegatronDtype::kInt16: return 32767;
    case MegatronDtype::kUint16: return 65535;
    default: return std::numeric_limits<int32_t>::max();
  }
}

}  // namespace switchyard::train::dataset::detail
