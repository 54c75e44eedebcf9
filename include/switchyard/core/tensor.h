// Tensor: a contiguous, row-major n-dimensional array.
//
// A Tensor is a handle to reference-counted storage (like torch.Tensor): copying the handle shares
// the data, and constness of the handle does not protect the elements. Slice() returns a view of
// rows [begin, end) along dim 0 that shares storage without copying; since tensors are contiguous
// and row-major, every slice along dim 0 is contiguous too. Storage that switchyard allocates
// (Empty, Zeros, Full, FromVector, Clone, To) is 64-byte aligned; FromBlob wraps memory the caller
// owns instead, without copying it (see there and docs/library.md).
//
// Thread-safety: distinct handles may be used from different threads; writing the same elements
// from two threads at once is a data race, as with raw arrays.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/dtype.h"
#include "switchyard/core/error.h"

namespace switchyard {

using Shape = std::vector<int64_t>;

// "[2, 3]"
std::string ShapeToString(std::span<const int64_t> shape);
// Product of the dimensions (1 for a scalar shape []). No overflow check: for a shape from
// input, use CheckedNumElements.
int64_t NumElements(std::span<const int64_t> shape);
// As NumElements, but throws InvalidArgument naming `what` and the shape if a dimension is
// negative or the product overflows int64.
int64_t CheckedNumElements(std::span<const int64_t> shape, std::string_view what);

class Tensor {
 public:
  // An undefined tensor: no storage, defined() is false.
  Tensor() = default;

  // Uninitialized contents.
  static Tensor Empty(Shape shape, DType dtype = DType::kFloat32);
  static Tensor Zeros(Shape shape, DType dtype = DType::kFloat32);
  // Every element = value (converted to dtype).
  static Tensor Full(Shape shape, double value, DType dtype = DType::kFloat32);
  // Copies values; values.size() must equal the shape's element count.
  template <typename T>
  static Tensor FromVector(const std::vector<T>& values, Shape shape);

  // A tensor over memory the caller owns, without copying it (like torch::from_blob).
  // `data` holds NumElements(shape) elements of `dtype`, contiguous and row-major, and is aligned
  // to DTypeSize(dtype) (no further alignment is needed). Writes through the tensor, its copies,
  // slices and reshapes land in the caller's buffer, and the caller's writes are seen by them.
  // Lifetime: switchyard never frees `data`; the caller keeps it alive, and does not reuse it,
  // for as long as any handle to it exists (including copies a layer keeps, e.g. in
  // LayerOutput::state; Clone() makes an owned copy). `data` may be null only when the shape has
  // no elements; an empty result has raw() == nullptr, like Empty({0}).
  // Throws InvalidArgument for a negative dimension, an element count or byte size that does not
  // fit in int64, null data with elements, misaligned data or an unknown dtype.
  static Tensor FromBlob(void* data, Shape shape, DType dtype = DType::kFloat32);
  // As above, but the tensor takes over the memory: `deleter(data)` runs exactly once, when the
  // last handle to it is destroyed (at once if the shape has no elements and data is not null).
  // If FromBlob throws InvalidArgument, the deleter is not called and the caller still owns `data`.
  static Tensor FromBlob(void* data, Shape shape, DType dtype, std::function<void(void*)> deleter);

  bool defined() const { return storage_ != nullptr || defined_empty_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  // Size of dimension d; negative d counts from the end.
  int64_t size(int64_t d) const;
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * DTypeSize(dtype_); }

  // Typed pointer to the first element; throws InvalidArgument if T does not match dtype().
  template <typename T>
  T* data() const {
    CheckDTypeIs(DTypeOf<T>::kValue);
    return reinterpret_cast<T*>(raw());
  }
  // Untyped pointer to the first element (nullptr for an empty tensor).
  void* raw() const { return storage_ ? storage_.get() + offset_ : nullptr; }

  // View of rows [begin, end) along dim 0; no copy. 0 <= begin <= end <= size(0).
  Tensor Slice(int64_t begin, int64_t end) const;
  // View with another shape of the same element count; no copy. One dimension may be -1.
  Tensor Reshape(Shape shape) const;
  // Deep copy.
  Tensor Clone() const;
  // Copy converted to dtype (float32 <-> bfloat16, int32 <-> int64, ints -> floats).
  Tensor To(DType dtype) const;
  // Copies src's elements into this tensor; shapes and dtypes must match.
  void CopyFrom(const Tensor& src) const;
  void Fill(double value) const;
  void SetZero() const;
  // True if both views point into the same allocation.
  bool SharesStorageWith(const Tensor& other) const {
    return storage_ && storage_ == other.storage_;
  }

  // Element read as double (any dtype), by flat index; for tests and tools, not for hot loops.
  double At(int64_t flat_index) const;

  std::string ToString() const;  // "float32[2, 3]"

 private:
  void CheckDTypeIs(DType expected) const;

  std::shared_ptr<std::byte[]> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kFloat32;
  bool defined_empty_ = false;  // defined tensor with zero elements (no storage)
};

// ---- Boundary checks. Each throws InvalidArgument naming the argument and both shapes. ----

// Wildcard for ExpectShape: any size is accepted in that dimension.
inline constexpr int64_t kAnySize = -1;

// Checks t.shape() == expected (kAnySize matches anything), e.g.
//   ExpectShape("x", x, {num_tokens, model_dim});
// -> "x: expected shape [4, 8], got [4, 9]".
void ExpectShape(std::string_view name, const Tensor& t, std::initializer_list<int64_t> expected);
void ExpectShape(std::string_view name, const Tensor& t, std::span<const int64_t> expected);
void ExpectDType(std::string_view name, const Tensor& t, DType expected);
// Checks t is defined, float32 or bfloat16.
void ExpectFloating(std::string_view name, const Tensor& t);

}  // namespace switchyard
