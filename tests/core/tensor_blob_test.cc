// Tensor::FromBlob: a tensor over caller memory, without a copy (docs/library.md).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "switchyard/core/tensor.h"

namespace switchyard {
namespace {

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument)";
}

TEST(TensorFromBlob, PointsAtTheCallersBufferWithItsShape) {
  std::vector<float> buffer(12);
  std::iota(buffer.begin(), buffer.end(), 0.0f);
  Tensor t = Tensor::FromBlob(buffer.data(), {3, 4});
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.raw(), buffer.data());
  EXPECT_EQ(t.shape(), (Shape{3, 4}));
  EXPECT_EQ(t.dtype(), DType::kFloat32);
  EXPECT_EQ(t.numel(), 12);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.At(7), 7.0);
}

TEST(TensorFromBlob, WritesGoBothWays) {
  std::vector<int64_t> buffer(6, 0);
  Tensor t = Tensor::FromBlob(buffer.data(), {2, 3}, DType::kInt64);
  t.data<int64_t>()[4] = 40;  // through the tensor ...
  EXPECT_EQ(buffer[4], 40);
  t.Fill(5);
  EXPECT_EQ(buffer, std::vector<int64_t>(6, 5));
  buffer[1] = -3;  // ... and through the caller's pointer
  EXPECT_EQ(t.At(1), -3.0);
  Tensor src = Tensor::FromVector<int64_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  t.CopyFrom(src);
  EXPECT_EQ(buffer, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
}

TEST(TensorFromBlob, SlicesAndReshapesKeepPointingAtTheBuffer) {
  std::vector<float> buffer(24, 0.0f);
  Tensor t = Tensor::FromBlob(buffer.data(), {4, 6});
  Tensor rows = t.Slice(1, 3);  // rows 1 and 2: elements [6, 18)
  EXPECT_EQ(rows.shape(), (Shape{2, 6}));
  EXPECT_EQ(rows.raw(), buffer.data() + 6);
  EXPECT_TRUE(rows.SharesStorageWith(t));
  Tensor flat = rows.Reshape({3, -1});
  EXPECT_EQ(flat.shape(), (Shape{3, 4}));
  EXPECT_EQ(flat.raw(), buffer.data() + 6);
  flat.data<float>()[11] = 9.0f;  // the last element of row 2
  EXPECT_EQ(buffer[17], 9.0f);
  rows.SetZero();
  rows.Slice(1, 2).Fill(2.0);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(buffer[i], i >= 12 && i < 18 ? 2.0f : 0.0f) << i;
  // A clone is owned: it no longer follows the buffer.
  Tensor copy = t.Clone();
  EXPECT_FALSE(copy.SharesStorageWith(t));
  buffer[0] = 1.0f;
  EXPECT_EQ(copy.At(0), 0.0);
}

TEST(TensorFromBlob, OtherDtypesAndScalarShape) {
  std::vector<BFloat16> half(4, BFloat16(1.5f));
  Tensor h = Tensor::FromBlob(half.data(), {2, 2}, DType::kBFloat16);
  EXPECT_EQ(h.nbytes(), 8u);
  EXPECT_EQ(h.To(DType::kFloat32).At(3), 1.5);
  int32_t scalar = 7;
  Tensor s = Tensor::FromBlob(&scalar, {}, DType::kInt32);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.data<int32_t>(), &scalar);
  EXPECT_THROW(s.data<float>(), InvalidArgument);
}

TEST(TensorFromBlob, EmptyShapesAcceptNullData) {
  Tensor a = Tensor::FromBlob(nullptr, {0, 5});
  EXPECT_TRUE(a.defined());
  EXPECT_EQ(a.numel(), 0);
  EXPECT_EQ(a.raw(), nullptr);
  float unused = 0;
  Tensor b = Tensor::FromBlob(&unused, {3, 0});
  EXPECT_EQ(b.raw(), nullptr);
  EXPECT_EQ(b.Slice(1, 2).shape(), (Shape{1, 0}));
}

TEST(TensorFromBlob, DeleterRunsOnceWhenTheLastViewGoes) {
  int calls = 0;
  auto* buffer = new float[8]();
  void* released = nullptr;
  {
    Tensor t = Tensor::FromBlob(buffer, {8}, DType::kFloat32, [&](void* p) {
      ++calls;
      released = p;
      delete[] static_cast<float*>(p);
    });
    Tensor view = t.Slice(2, 4);
    t = Tensor();
    EXPECT_EQ(calls, 0);  // the slice still holds the memory
    view.Fill(1.0);
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(released, buffer);

  // Empty shape: nothing to hold, the memory is released at once.
  int empty_calls = 0;
  float unused = 0;
  Tensor e = Tensor::FromBlob(&unused, {0}, DType::kFloat32, [&](void*) { ++empty_calls; });
  EXPECT_EQ(empty_calls, 1);
}

TEST(TensorFromBlob, BadInputIsAClearInvalidArgument) {
  float x[4] = {};
  EXPECT_EQ(ErrorOf([] {
              Tensor::FromBlob(nullptr, {2, 3});
            }),
            "FromBlob: data is null but shape [2, 3] has 6 elements");
  EXPECT_EQ(ErrorOf([&] {
              Tensor::FromBlob(x, {2, -2});
            }),
            "shape: invalid shape [2, -2]: dimensions must be >= 0");
  constexpr int64_t kBig = int64_t{1} << 32;
  EXPECT_EQ(ErrorOf([&] {
              Tensor::FromBlob(x, {kBig, kBig});
            }),
            "shape: shape [4294967296, 4294967296] has more elements than a 64-bit integer holds");
  // The element count fits, its bytes do not.
  constexpr int64_t kHalf = std::numeric_limits<int64_t>::max() / 2;
  EXPECT_NE(ErrorOf([&] { Tensor::FromBlob(x, {kHalf}); }).find("bytes of"), std::string::npos);
  auto* odd = reinterpret_cast<std::byte*>(x) + 2;
  EXPECT_NE(ErrorOf([&] { Tensor::FromBlob(odd, {1}); }).find("is not aligned to 4 bytes"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { Tensor::FromBlob(x, {1}, static_cast<DType>(9)); }).find("unknown dtype"),
            std::string::npos);
  // A deleter is not called when FromBlob refuses the input: the caller keeps the memory.
  int calls = 0;
  EXPECT_THROW(Tensor::FromBlob(nullptr, {1}, DType::kFloat32, [&](void*) { ++calls; }),
               InvalidArgument);
  EXPECT_EQ(calls, 0);
}

TEST(TensorFromBlob, OverflowingShapesAreRefusedEverywhere) {
  constexpr int64_t kBig = int64_t{1} << 40;
  EXPECT_THROW(Tensor::Empty({kBig, kBig}), InvalidArgument);  // 2^80 wraps to 0
  std::vector<float> buffer(4);
  Tensor t = Tensor::FromBlob(buffer.data(), {4});
  // (2^62 + 1) * 4 wraps to 4, the element count of t.
  constexpr int64_t kWraps = (int64_t{1} << 62) + 1;
  EXPECT_NE(ErrorOf([&] { t.Reshape({kWraps, 4}); }).find("overflows"), std::string::npos);
  EXPECT_THROW(t.Reshape({2, 3}), InvalidArgument);
}

}  // namespace
}  // namespace switchyard
