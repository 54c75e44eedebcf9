// Element types of switchyard tensors.
// bfloat16 is a storage type: values are converted to float32 for every computation.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace switchyard {

// kInt16 is last so that the other values keep their numbers; it holds compact indices (router
// traces) and is read and written by the file formats, not computed with.
enum class DType : uint8_t { kFloat32, kBFloat16, kInt32, kInt64, kInt16 };

// Bytes per element.
size_t DTypeSize(DType dtype);
// "float32", "bfloat16", "int32", "int64", "int16".
std::string_view DTypeName(DType dtype);
// Inverse of DTypeName; throws InvalidArgument naming the accepted names.
DType DTypeFromName(std::string_view name);

// bfloat16: the upper 16 bits of an IEEE float32. Conversion rounds to nearest even; NaN stays NaN.
struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  explicit BFloat16(float value) : bits(FromFloat(value)) {}
  explicit operator float() const {
    return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  }

  static uint16_t FromFloat(float value) {
    uint32_t u = std::bit_cast<uint32_t>(value);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, keep sign
    }
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>((u + rounding) >> 16);
  }
};
static_assert(sizeof(BFloat16) == 2);

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType kValue = DType::kFloat32;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType kValue = DType::kBFloat16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType kValue = DType::kInt32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType kValue = DType::kInt64;
};
template <>
struct DTypeOf<int16_t> {
  static constexpr DType kValue = DType::kInt16;
};

}  // namespace switchyard
