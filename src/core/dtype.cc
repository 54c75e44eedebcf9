#include "switchyard/core/dtype.h"

#include "switchyard/core/error.h"

namespace switchyard {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kInt16: return 2;
  }
  SY_CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kInt16: return "int16";
  }
  SY_CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
  return "";
}

DType DTypeFromName(std::string_view name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "int32") return DType::kInt32;
  if (name == "int64") return DType::kInt64;
  if (name == "int16") return DType::kInt16;
  throw InvalidArgument(fmt::format(
      "unknown dtype '{}': expected one of float32, bfloat16, int32, int64, int16", name));
}

}  // namespace switchyard
