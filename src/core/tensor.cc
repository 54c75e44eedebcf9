#include "switchyard/core/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>

#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"
#include "switchyard/core/memory_account.h"

namespace switchyard {
namespace {

constexpr std::align_val_t kAlignment{64};

std::shared_ptr<std::byte[]> Allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  // The nothrow form: a refusal is a null pointer here, also under AddressSanitizer (whose
  // throwing operator new ends the process instead; with allocator_may_return_null it returns).
  auto* p = static_cast<std::byte*>(::operator new[](bytes, kAlignment, std::nothrow));
  if (p == nullptr) throw std::bad_alloc();
  std::shared_ptr<MemoryAccount> account = CurrentMemoryAccount();
  if (account == nullptr) {
    return std::shared_ptr<std::byte[]>(p,
                                        [](std::byte* q) { ::operator delete[](q, kAlignment); });
  }
  // Charged to this thread's account until freed (core/memory_account.h).
  const auto n = static_cast<int64_t>(bytes);
  account->Charge(n);
  return std::shared_ptr<std::byte[]>(p, [account = std::move(account), n](std::byte* q) {
    account->Release(n);
    ::operator delete[](q, kAlignment);
  });
}

// Element count of a shape from input, and its bytes fit in int64 (and so in size_t).
int64_t CheckShapeValid(std::span<const int64_t> shape, DType dtype) {
  int64_t n = CheckedNumElements(shape, "shape");
  CheckedMul(n, static_cast<int64_t>(DTypeSize(dtype)),
             fmt::format("shape {}: bytes of {} elements", ShapeToString(shape), DTypeName(dtype)));
  return n;
}

bool IsKnownDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt16: return true;
  }
  return false;
}

template <typename T>
void FillTyped(void* p, int64_t n, double value) {
  T v;
  if constexpr (std::is_same_v<T, BFloat16>) {
    v = BFloat16(static_cast<float>(value));
  } else if constexpr (std::is_integral_v<T>) {
    // Out of range (or NaN) would be undefined behaviour, in practice an arbitrary integer.
    v = static_cast<T>(CheckedToInt64(value, "Fill: the value", std::numeric_limits<T>::min(),
                                      std::numeric_limits<T>::max()));
  } else {
    v = static_cast<T>(value);
  }
  std::fill_n(static_cast<T*>(p), n, v);
}

// Element i of a conversion to an integer dtype: a value outside T's range or NaN is an error
// (the plain cast would be undefined behaviour).
template <typename T>
T ToInteger(double v, int64_t i) {
  constexpr auto kLo = static_cast<double>(std::numeric_limits<T>::min());
  constexpr double kEnd = static_cast<double>(std::numeric_limits<T>::max()) + 1.0;  // 2^31, 2^63
  if (v >= kLo && v < kEnd) return static_cast<T>(v);
  return static_cast<T>(
      CheckedToInt64(v, fmt::format("To({}): element {}", DTypeName(DTypeOf<T>::kValue), i),
                     std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
}

double ReadAsDouble(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kBFloat16: return static_cast<float>(static_cast<const BFloat16*>(p)[i]);
    case DType::kInt32: return static_cast<const int32_t*>(p)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::kInt16: return static_cast<const int16_t*>(p)[i];
  }
  return 0;
}

}  // namespace

std::string ShapeToString(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t NumElements(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t CheckedNumElements(std::span<const int64_t> shape, std::string_view what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    SY_REQUIRE(d >= 0, InvalidArgument, "{}: invalid shape {}: dimensions must be >= 0", what,
               ShapeToString(shape));
    SY_REQUIRE(!__builtin_mul_overflow(n, d, &n), InvalidArgument,
               "{}: shape {} has more elements than a 64-bit integer holds", what,
               ShapeToString(shape));
  }
  return n;
}

Tensor Tensor::Empty(Shape shape, DType dtype) {
  Tensor t;
  t.numel_ = CheckShapeValid(shape, dtype);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  try {
    t.storage_ = Allocate(t.nbytes());
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(fmt::format(
        "out of memory allocating a tensor of shape {} {} ({}): the system or a limit (ulimit -v, "
        "the cgroup) gives this process no more; give smaller sizes or free memory",
        ShapeToString(t.shape_), DTypeName(dtype), FormatBytes(t.nbytes())));
  }
  t.defined_empty_ = t.storage_ == nullptr;
  return t;
}

Tensor Tensor::Zeros(Shape shape, DType dtype) {
  Tensor t = Empty(std::move(shape), dtype);
  t.SetZero();
  return t;
}

Tensor Tensor::Full(Shape shape, double value, DType dtype) {
  Tensor t = Empty(std::move(shape), dtype);
  t.Fill(value);
  return t;
}

template <typename T>
Tensor Tensor::FromVector(const std::vector<T>& values, Shape shape) {
  CheckShapeValid(shape, DTypeOf<T>::kValue);
  SY_REQUIRE(static_cast<int64_t>(values.size()) == NumElements(shape), InvalidArgument,
             "FromVector: {} values do not fill shape {} ({} elements)", values.size(),
             ShapeToString(shape), NumElements(shape));
  Tensor t = Empty(std::move(shape), DTypeOf<T>::kValue);
  if (!values.empty()) std::memcpy(t.raw(), values.data(), t.nbytes());
  return t;
}
template Tensor Tensor::FromVector<float>(const std::vector<float>&, Shape);
template Tensor Tensor::FromVector<BFloat16>(const std::vector<BFloat16>&, Shape);
template Tensor Tensor::FromVector<int32_t>(const std::vector<int32_t>&, Shape);
template Tensor Tensor::FromVector<int64_t>(const std::vector<int64_t>&, Shape);
template Tensor Tensor::FromVector<int16_t>(const std::vector<int16_t>&, Shape);

Tensor Tensor::FromBlob(void* data, Shape shape, DType dtype) {
  return FromBlob(data, std::move(shape), dtype, nullptr);
}

Tensor Tensor::FromBlob(void* data, Shape shape, DType dtype, std::function<void(void*)> deleter) {
  SY_REQUIRE(IsKnownDType(dtype), InvalidArgument,
             "FromBlob: unknown dtype {} (expected float32, bfloat16, int32 or int64)",
             static_cast<int>(dtype));
  Tensor t;
  t.numel_ = CheckShapeValid(shape, dtype);
  SY_REQUIRE(data != nullptr || t.numel_ == 0, InvalidArgument,
             "FromBlob: data is null but shape {} has {} elements", ShapeToString(shape), t.numel_);
  SY_REQUIRE(reinterpret_cast<uintptr_t>(data) % DTypeSize(dtype) == 0, InvalidArgument,
             "FromBlob: data {} is not aligned to {} bytes, the size of a {} element", data,
             DTypeSize(dtype), DTypeName(dtype));
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  auto* bytes = static_cast<std::byte*>(data);
  if (t.numel_ == 0) {
    t.defined_empty_ = true;
    if (deleter && data) deleter(data);
  } else if (deleter) {
    t.storage_ = std::shared_ptr<std::byte[]>(
        bytes, [release = std::move(deleter)](std::byte* p) { release(p); });
  } else {
    // The aliasing constructor with an empty owner: points at data, owns nothing, counts nothing.
    t.storage_ = std::shared_ptr<std::byte[]>(std::shared_ptr<std::byte[]>(), bytes);
  }
  return t;
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  int64_t i = d < 0 ? d + n : d;
  SY_REQUIRE(i >= 0 && i < n, InvalidArgument, "size({}): tensor {} has {} dimensions", d,
             ToString(), n);
  return shape_[static_cast<size_t>(i)];
}

Tensor Tensor::Slice(int64_t begin, int64_t end) const {
  SY_REQUIRE(dim() >= 1, InvalidArgument, "Slice: tensor {} has no dimension 0", ToString());
  SY_REQUIRE(0 <= begin && begin <= end && end <= shape_[0], InvalidArgument,
             "Slice({}, {}): expected 0 <= begin <= end <= {} for tensor {}", begin, end, shape_[0],
             ToString());
  Tensor t = *this;
  int64_t row = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  t.shape_[0] = end - begin;
  t.numel_ = row * (end - begin);
  if (t.numel_ == 0) {
    t.storage_ = nullptr;
    t.offset_ = 0;
    t.defined_empty_ = true;
  } else {
    t.offset_ = offset_ + static_cast<size_t>(begin * row) * DTypeSize(dtype_);
  }
  return t;
}

Tensor Tensor::Reshape(Shape shape) const {
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      SY_REQUIRE(infer < 0, InvalidArgument, "Reshape {}: at most one dimension may be -1",
                 ShapeToString(shape));
      infer = static_cast<int>(i);
    } else {
      SY_REQUIRE(shape[i] >= 0, InvalidArgument, "Reshape: invalid shape {}", ShapeToString(shape));
      known = CheckedMul(known, shape[i], fmt::format("Reshape {}", ShapeToString(shape)));
    }
  }
  if (infer >= 0) {
    SY_REQUIRE(known > 0 && numel_ % known == 0, InvalidArgument,
               "Reshape: cannot infer -1 in {} for {} elements", ShapeToString(shape), numel_);
    shape[static_cast<size_t>(infer)] = numel_ / known;
    known = numel_;
  }
  SY_REQUIRE(known == numel_, InvalidArgument,
             "Reshape: shape {} has {} elements, tensor {} has {}", ShapeToString(shape), known,
             ToString(), numel_);
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::Clone() const {
  Tensor t = Empty(shape_, dtype_);
  if (numel_ > 0) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

void Tensor::CopyFrom(const Tensor& src) const {
  SY_REQUIRE(src.shape_ == shape_ && src.dtype_ == dtype_, InvalidArgument,
             "CopyFrom: source {} does not match destination {}", src.ToString(), ToString());
  if (numel_ > 0 && raw() != src.raw()) std::memmove(raw(), src.raw(), nbytes());
}

Tensor Tensor::To(DType dtype) const {
  if (dtype == dtype_) return Clone();
  Tensor t = Empty(shape_, dtype);
  const void* src = raw();
  for (int64_t i = 0; i < numel_; ++i) {
    double v = ReadAsDouble(src, dtype_, i);
    switch (dtype) {
      case DType::kFloat32: t.data<float>()[i] = static_cast<float>(v); break;
      case DType::kBFloat16: t.data<BFloat16>()[i] = BFloat16(static_cast<float>(v)); break;
      case DType::kInt32: t.data<int32_t>()[i] = ToInteger<int32_t>(v, i); break;
      case DType::kInt16: t.data<int16_t>()[i] = ToInteger<int16_t>(v, i); break;
      case DType::kInt64:
        t.data<int64_t>()[i] = dtype_ == DType::kInt64 ? static_cast<const int64_t*>(src)[i]
                                                       : ToInteger<int64_t>(v, i);
        break;
    }
  }
  return t;
}

void Tensor::Fill(double value) const {
  if (numel_ == 0) return;
  switch (dtype_) {
    case DType::kFloat32: FillTyped<float>(raw(), numel_, value); break;
    case DType::kBFloat16: FillTyped<BFloat16>(raw(), numel_, value); break;
    case DType::kInt32: FillTyped<int32_t>(raw(), numel_, value); break;
    case DType::kInt64: FillTyped<int64_t>(raw(), numel_, value); break;
    case DType::kInt16: FillTyped<int16_t>(raw(), numel_, value); break;
  }
}

void Tensor::SetZero() const {
  if (numel_ > 0) std::memset(raw(), 0, nbytes());
}

double Tensor::At(int64_t flat_index) const {
  SY_REQUIRE(flat_index >= 0 && flat_index < numel_, InvalidArgument,
             "At({}): index out of range for {}", flat_index, ToString());
  return ReadAsDouble(raw(), dtype_, flat_index);
}

std::string Tensor::ToString() const {
  if (!defined()) return "undefined";
  return fmt::format("{}{}", DTypeName(dtype_), ShapeToString(shape_));
}

void Tensor::CheckDTypeIs(DType expected) const {
  SY_REQUIRE(dtype_ == expected, InvalidArgument, "tensor {} accessed as {}", ToString(),
             DTypeName(expected));
}

void ExpectShape(std::string_view name, const Tensor& t, std::span<const int64_t> expected) {
  SY_REQUIRE(t.defined(), InvalidArgument, "{}: expected a tensor of shape {}, got none", name,
             ShapeToString(expected));
  bool ok = t.shape().size() == expected.size();
  for (size_t i = 0; ok && i < expected.size(); ++i) {
    ok = expected[i] == kAnySize || expected[i] == t.shape()[i];
  }
  if (!ok) {
    std::string want = "[";
    for (size_t i = 0; i < expected.size(); ++i) {
      if (i) want += ", ";
      want += expected[i] == kAnySize ? std::string("*") : std::to_string(expected[i]);
    }
    want += "]";
    throw InvalidArgument(
        fmt::format("{}: expected shape {}, got {}", name, want, ShapeToString(t.shape())));
  }
}

void ExpectShape(std::string_view name, const Tensor& t, std::initializer_list<int64_t> expected) {
  ExpectShape(name, t, std::span<const int64_t>(expected.begin(), expected.size()));
}

void ExpectDType(std::string_view name, const Tensor& t, DType expected) {
  SY_REQUIRE(t.defined(), InvalidArgument, "{}: expected a {} tensor, got none", name,
             DTypeName(expected));
  SY_REQUIRE(t.dtype() == expected, InvalidArgument, "{}: expected dtype {}, got {}", name,
             DTypeName(expected), DTypeName(t.dtype()));
}

void ExpectFloating(std::string_view name, const Tensor& t) {
  SY_REQUIRE(t.defined(), InvalidArgument, "{}: expected a float32 or bfloat16 tensor, got none",
             name);
  SY_REQUIRE(t.dtype() == DType::kFloat32 || t.dtype() == DType::kBFloat16, InvalidArgument,
             "{}: expected dtype float32 or bfloat16, got {}", name, DTypeName(t.dtype()));
}

}  // namespace switchyard
