#include "switchyard/core/tensor.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>

#include "switchyard/core/error.h"

#if defined(__SANITIZE_ADDRESS__)
// Under AddressSanitizer an allocation the address-space limit refuses must come back as a null
// pointer from the nothrow operator new the tensors use, as without it, instead of ending the
// process: this binary's default; ASAN_OPTIONS given to the run still win.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
#endif

namespace switchyard {
namespace {

TEST(Tensor, EmptyHasShapeDtypeAndAlignment) {
  Tensor t = Tensor::Empty({3, 5}, DType::kFloat32);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.dim(), 2);
  EXPECT_EQ(t.size(0), 3);
  EXPECT_EQ(t.size(-1), 5);
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(t.nbytes(), 60u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
}

TEST(Tensor, UndefinedAndZeroSized) {
  Tensor u;
  EXPECT_FALSE(u.defined());
  Tensor z = Tensor::Zeros({0, 4});
  EXPECT_TRUE(z.defined());
  EXPECT_EQ(z.numel(), 0);
  EXPECT_EQ(z.raw(), nullptr);
  EXPECT_EQ(z.Slice(0, 0).numel(), 0);
}

// The bytes of address space this process maps now (VmSize; AddressSanitizer's shadow alone is
// terabytes), 0 when /proc cannot tell.
uint64_t MappedBytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  uint64_t kib = 0;
  while (status >> key) {
    if (key == "VmSize:" && status >> kib) return kib * 1024;
  }
  return 0;
}

// An allocation that fails (here under an address-space limit 1 GiB above what the process maps
// already, in a child process) is an OutOfMemory naming the tensor, never a bare std::bad_alloc.
TEST(Tensor, FailedAllocationNamesTheTensor) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const uint64_t cap = MappedBytes() + (uint64_t{1} << 30);
    rlimit limit{cap, cap};
    if (::setrlimit(RLIMIT_AS, &limit) != 0) ::_exit(3);
    try {
      Tensor t = Tensor::Empty({int64_t{1} << 29, 2});  // 4 GiB
      ::_exit(4);
    } catch (const OutOfMemory& e) {
      const std::string m = e.what();
      ::_exit(
          m.find("out of memory allocating a tensor of shape [536870912, 2] float32 (4.0 GiB)") == 0
              ? 0
              : 5);
    } catch (...) {
      ::_exit(6);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: setrlimit failed, 4: allocated, 5: other message, 6: "
                                       "another exception";
}

TEST(Tensor, NegativeDimensionRejected) { EXPECT_THROW(Tensor::Empty({2, -1}), InvalidArgument); }

TEST(Tensor, SliceIsAViewWithoutCopy) {
  Tensor t = Tensor::FromVector<float>({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2});
  Tensor s = t.Slice(1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 2}));
  EXPECT_TRUE(s.SharesStorageWith(t));
  EXPECT_EQ(s.data<float>()[0], 2.0f);
  s.data<float>()[0] = 42.0f;  // writes through to the parent
  EXPECT_EQ(t.data<float>()[2], 42.0f);
  Tensor ss = s.Slice(1, 2);
  EXPECT_EQ(ss.data<float>()[1], 5.0f);
  EXPECT_THROW(t.Slice(2, 5), InvalidArgument);
  EXPECT_THROW(t.Slice(3, 2), InvalidArgument);
}

TEST(Tensor, ReshapeSharesAndInfers) {
  Tensor t = Tensor::Zeros({2, 3, 4});
  Tensor r = t.Reshape({6, -1});
  EXPECT_EQ(r.shape(), (Shape{6, 4}));
  EXPECT_TRUE(r.SharesStorageWith(t));
  EXPECT_THROW(t.Reshape({5, 5}), InvalidArgument);
  EXPECT_THROW(t.Reshape({-1, -1}), InvalidArgument);
}

TEST(Tensor, CloneIsDeep) {
  Tensor t = Tensor::Full({3}, 2.5);
  Tensor c = t.Clone();
  c.data<float>()[0] = 0;
  EXPECT_EQ(t.data<float>()[0], 2.5f);
  EXPECT_FALSE(c.SharesStorageWith(t));
}

TEST(Tensor, WrongDtypeAccessIsAnError) {
  Tensor t = Tensor::Zeros({2}, DType::kInt32);
  EXPECT_NO_THROW(t.data<int32_t>());
  EXPECT_THROW(t.data<float>(), InvalidArgument);
}

TEST(Tensor, ConversionsRoundTrip) {
  Tensor f = Tensor::FromVector<float>({1.0f, -2.5f, 3.140625f, 1e-3f}, {4});
  Tensor b = f.To(DType::kBFloat16);
  EXPECT_EQ(b.nbytes(), 8u);
  Tensor back = b.To(DType::kFloat32);
  EXPECT_EQ(back.data<float>()[0], 1.0f);
  EXPECT_EQ(back.data<float>()[1], -2.5f);
  EXPECT_EQ(back.data<float>()[2], 3.140625f);  // exactly representable in bf16
  EXPECT_NEAR(back.data<float>()[3], 1e-3f, 1e-3f / 128);
  Tensor i64 = Tensor::FromVector<int32_t>({-7, 9}, {2}).To(DType::kInt64);
  EXPECT_EQ(i64.data<int64_t>()[0], -7);
  EXPECT_EQ(i64.data<int64_t>()[1], 9);
}

// Floats that do not fit the integer dtype (or NaN) are errors, not undefined conversions.
TEST(Tensor, ConversionsToIntegersAreRangeChecked) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {3e9f, -3e9f, 1e30f, inf, -inf, std::numeric_limits<float>::quiet_NaN()}) {
    Tensor f = Tensor::FromVector<float>({1.0f, v}, {2});
    EXPECT_THROW(f.To(DType::kInt32), InvalidArgument) << v;
    if (std::fabs(v) >= 1e19f || std::isnan(v)) {
      EXPECT_THROW(f.To(DType::kInt64), InvalidArgument);
    }
  }
  try {
    Tensor::FromVector<float>({1.0f, 1e30f}, {2}).To(DType::kInt32);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("To(int32): element 1"), std::string::npos) << e.what();
  }
  Tensor ok =
      Tensor::FromVector<float>({-2147483648.0f, 2147483520.0f, -1.5f}, {3}).To(DType::kInt32);
  EXPECT_EQ(ok.data<int32_t>()[0], std::numeric_limits<int32_t>::min());
  EXPECT_EQ(ok.data<int32_t>()[1], 2147483520);
  EXPECT_EQ(ok.data<int32_t>()[2], -1);
  EXPECT_EQ(Tensor::FromVector<float>({3e18f}, {1}).To(DType::kInt64).data<int64_t>()[0],
            static_cast<int64_t>(3e18f));
  EXPECT_THROW(Tensor::FromVector<int64_t>({int64_t{1} << 40}, {1}).To(DType::kInt32),
               InvalidArgument);
  EXPECT_THROW(Tensor::Full({2}, 1e30, DType::kInt64), InvalidArgument);
  EXPECT_THROW(Tensor::Full({2}, std::nan(""), DType::kInt32), InvalidArgument);
  EXPECT_THROW(Tensor::Full({2}, 3e9, DType::kInt32), InvalidArgument);
  EXPECT_EQ(Tensor::Full({}, 7.0, DType::kInt64).data<int64_t>()[0], 7);
}

TEST(BFloat16, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 1.0f / 256)), 1.0f);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(static_cast<float>(BFloat16(std::numeric_limits<float>::infinity()))));
}

TEST(ExpectShape, MessageNamesArgumentAndBothShapes) {
  Tensor x = Tensor::Zeros({4, 9});
  EXPECT_NO_THROW(ExpectShape("x", x, {4, 9}));
  EXPECT_NO_THROW(ExpectShape("x", x, {kAnySize, 9}));
  try {
    ExpectShape("x", x, {4, 8});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "x: expected shape [4, 8], got [4, 9]");
  }
  try {
    ExpectShape("gate.weight", x, {kAnySize, 8, 2});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "gate.weight: expected shape [*, 8, 2], got [4, 9]");
  }
  EXPECT_THROW(ExpectDType("idx", x, DType::kInt32), InvalidArgument);
  EXPECT_THROW(ExpectFloating("x", Tensor()), InvalidArgument);
}

TEST(DType, NamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kInt32, DType::kInt64}) {
    EXPECT_EQ(DTypeFromName(DTypeName(d)), d);
  }
  EXPECT_THROW(DTypeFromName("float16"), InvalidArgument);
}

}  // namespace
}  // namespace switchyard
