#include "switchyard/core/npy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/temp_dir.h"
#include "switchyard/core/file_util.h"

namespace switchyard {
namespace {

using ::switchyard::testing::TempDir;
using Bytes = std::vector<std::byte>;

void Append(Bytes& out, std::string_view s) {
  auto b = std::as_bytes(std::span<const char>(s.data(), s.size()));
  out.insert(out.end(), b.begin(), b.end());
}

template <typename T>
void AppendValues(Bytes& out, std::initializer_list<T> values) {
  for (T v : values) {
    std::byte b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.insert(out.end(), b, b + sizeof(T));
  }
}

// A v1.0 file as numpy.save writes it: the dict text padded with spaces and a final '\n' so that
// the data starts at a multiple of 64 bytes.
Bytes NumpyV1(std::string_view dict, size_t prefix_len) {
  std::string header(dict);
  header.resize(prefix_len - 10 - 1, ' ');
  header += '\n';
  Bytes out;
  Append(out, "\x93NUMPY\x01");
  AppendValues<uint8_t>(out, {0});
  AppendValues<uint16_t>(out, {static_cast<uint16_t>(header.size())});
  Append(out, header);
  return out;
}

// A file with an arbitrary version and header text (no padding added).
Bytes RawNpy(int major, int minor, std::string_view header) {
  Bytes out;
  Append(out, "\x93NUMPY");
  AppendValues<uint8_t>(out, {static_cast<uint8_t>(major), static_cast<uint8_t>(minor)});
  if (major == 1) {
    AppendValues<uint16_t>(out, {static_cast<uint16_t>(header.size())});
  } else {
    AppendValues<uint32_t>(out, {static_cast<uint32_t>(header.size())});
  }
  Append(out, header);
  return out;
}

bool SameTensor(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

void ExpectRejected(const Bytes& bytes, std::initializer_list<std::string_view> needles) {
  try {
    Tensor t = ParseNpy(bytes, "bad.npy");
    ADD_FAILURE() << "accepted a malformed file as " << t.ToString();
  } catch (const IoError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("bad.npy"), std::string::npos) << msg;
    for (std::string_view n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
  }
}

// Bytes captured from numpy 1.24 numpy.save (the 64-byte-aligned header with room for the first
// dimension to grow, introduced in numpy 1.23; earlier versions read it unchanged).
TEST(Npy, ByteExactWithNumpySave) {
  Bytes f32 = NumpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 128);
  AppendValues<float>(f32, {0, 1, 2, 3, 4, 5});
  EXPECT_EQ(SerializeNpy(Tensor::FromVector<float>({0, 1, 2, 3, 4, 5}, {2, 3})), f32);

  Bytes scalar = NumpyV1("{'descr': '<i8', 'fortran_order': False, 'shape': (), }", 128);
  AppendValues<int64_t>(scalar, {-7});
  EXPECT_EQ(SerializeNpy(Tensor::FromVector<int64_t>({-7}, {})), scalar);

  EXPECT_EQ(SerializeNpy(Tensor::Zeros({0}, DType::kInt32)),
            NumpyV1("{'descr': '<i4', 'fortran_order': False, 'shape': (0,), }", 128));
  EXPECT_EQ(SerializeNpy(Tensor::Zeros({3, 0, 2})),
            NumpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 0, 2), }", 128));
}

TEST(Npy, RoundTripEveryDTypeIncludingScalarsAndZeroSized) {
  TempDir dir;
  std::vector<Tensor> cases = {
      Tensor::FromVector<float>({1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f}, {3, 2}),
      Tensor::FromVector<int32_t>({7, -8, 2147483647}, {3}),
      Tensor::FromVector<int64_t>({int64_t{1} << 40, -1, 0, 42}, {2, 1, 2}),
      Tensor::FromVector<float>({3.0f}, {}),
      Tensor::FromVector<int32_t>({-1}, {}),
      Tensor::Zeros({0}, DType::kFloat32),
      Tensor::Zeros({4, 0}, DType::kInt64),
      Tensor::Zeros({0, 3, 0}, DType::kInt32),
      Tensor::Full({1000, 33}, 0.25),
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Tensor& t = cases[i];
    EXPECT_TRUE(SameTensor(ParseNpy(SerializeNpy(t), "memory"), t)) << t.ToString();
    std::string path = dir.File("t" + std::to_string(i) + ".npy");
    WriteNpy(path, t);
    EXPECT_TRUE(SameTensor(ReadNpy(path), t)) << t.ToString();
  }
}

TEST(Npy, BFloat16AndUndefinedAreRejectedOnWrite) {
  TempDir dir;
  try {
    WriteNpy(dir.File("b.npy"), Tensor::Zeros({2}, DType::kBFloat16));
    ADD_FAILURE() << "bf16 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16 has no .npy dtype"), std::string::npos);
  }
  EXPECT_THROW(SerializeNpy(Tensor()), InvalidArgument);
  EXPECT_TRUE(dir.List().empty());
}

TEST(Npy, ReadsOtherVersionsAndSpellings) {
  Bytes v2 = RawNpy(2, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }\n");
  AppendValues<int32_t>(v2, {5, 6});
  Tensor t = ParseNpy(v2, "v2");
  EXPECT_EQ(t.shape(), (Shape{2}));
  EXPECT_EQ(t.data<int32_t>()[1], 6);

  Bytes v3 = RawNpy(3, 0, "{\"shape\":(1,1),\"descr\":\"<f4\",\"fortran_order\":False}");
  AppendValues<float>(v3, {2.5f});
  EXPECT_EQ(ParseNpy(v3, "v3").data<float>()[0], 2.5f);

  Bytes py2 = RawNpy(1, 0, "{'descr': '<i8', 'fortran_order': False, 'shape': (2L, 1L), } \n");
  AppendValues<int64_t>(py2, {1, 2});
  EXPECT_EQ(ParseNpy(py2, "py2").shape(), (Shape{2, 1}));

  // fortran_order True is the same layout when at most one dimension exceeds 1.
  Bytes fortran_1d = RawNpy(1, 0, "{'descr': '<f4', 'fortran_order': True, 'shape': (1, 3, 1), }");
  AppendValues<float>(fortran_1d, {1, 2, 3});
  EXPECT_EQ(ParseNpy(fortran_1d, "f").data<float>()[2], 3.0f);

  TempDir dir;
  std::string path = dir.File("big_header.npy");
  std::string text = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }";
  text.append(500, ' ');  // ReadNpy reads the header in two steps when it is long
  Bytes long_header = RawNpy(1, 0, text);
  AppendValues<float>(long_header, {1, 2, 3});
  WriteFileAtomic(path, long_header);
  EXPECT_EQ(ReadNpy(path).data<float>()[2], 3.0f);
}

TEST(Npy, RejectsMalformedFiles) {
  auto with = [](std::string_view dict, size_t data_bytes = 0) {
    Bytes b = RawNpy(1, 0, dict);
    b.resize(b.size() + data_bytes);
    return b;
  };
  ExpectRejected({}, {"not a .npy file"});
  Bytes nine = RawNpy(1, 0, "");
  nine.resize(9);
  ExpectRejected(nine, {"ends inside the .npy header length (9 bytes)"});
  ExpectRejected(Bytes(nine.begin(), nine.begin() + 7), {"ends inside the .npy version"});
  Bytes bad_magic = RawNpy(1, 0, "{}");
  bad_magic[1] = std::byte{'X'};
  ExpectRejected(bad_magic, {"not a .npy file"});
  ExpectRejected(RawNpy(4, 0, "{}"), {"version 4.0 is not supported"});
  ExpectRejected(RawNpy(1, 1, "{}"), {"version 1.1"});
  Bytes short_len = RawNpy(2, 0, "");
  short_len.resize(11);
  ExpectRejected(short_len, {"ends inside the .npy header length"});
  Bytes beyond = RawNpy(1, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }");
  beyond.resize(beyond.size() - 5);
  ExpectRejected(beyond, {"extends beyond the end of the file"});
  Bytes huge = RawNpy(2, 0, "{}");
  huge[8] = huge[9] = huge[10] = huge[11] = std::byte{0xff};
  ExpectRejected(huge, {"exceeds the limit"});

  std::string f = "'fortran_order': False";
  ExpectRejected(with("{'descr': '<f8', " + f + ", 'shape': (1,), }", 8),
                 {"dtype '<f8' is not supported", "'<f4' (float32)"});
  ExpectRejected(with("{'descr': '>f4', " + f + ", 'shape': (1,), }", 4), {"dtype '>f4'"});
  ExpectRejected(with("{'descr': '<f2', " + f + ", 'shape': (1,), }", 2), {"dtype '<f2'"});
  ExpectRejected(with("{'descr': '|O', " + f + ", 'shape': (1,), }", 8), {"dtype '|O'"});
  ExpectRejected(with("{'descr': [('a', '<f4')], " + f + ", 'shape': (1,), }", 4),
                 {"structured dtypes"});
  ExpectRejected(with("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 24),
                 {"fortran_order True with shape [2, 3] is not supported"});
  ExpectRejected(with("{'descr': '<f4', 'fortran_order': 1, 'shape': (1,), }", 4),
                 {"fortran_order must be True or False"});
  ExpectRejected(with("{'descr': '<f4', 'shape': (1,), }", 4), {"no 'fortran_order'"});
  ExpectRejected(with("{'fortran_order': False, 'shape': (1,), }", 4), {"no 'descr'"});
  ExpectRejected(with("{'descr': '<f4', " + f + "}", 4), {"no 'shape'"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (1,), 'x': 1}", 4),
                 {"unexpected key 'x'"});
  ExpectRejected(with("{'descr': '<f4', 'descr': '<f4', " + f + ", 'shape': (1,)}", 4),
                 {"'descr' appears twice"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (-1,), }"), {"negative dimension"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (3), }", 12), {"is not a tuple"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': [3], }", 12), {"must be a tuple"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (1,,), }", 4),
                 {"expected a dimension"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (99999999999999999999,), }"),
                 {"too large for 64 bits"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (4294967296, 4294967296, 4), }"),
                 {"more elements than fit in 64 bits"});
  ExpectRejected(with("{'descr': '<i8', " + f + ", 'shape': (2305843009213693952,), }"),
                 {"more than 2^64"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (3,), }", 11),
                 {"needs 12 bytes of data but the file holds 11", "truncated"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (3,), }", 13), {"trailing bytes"});
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': (3,), } x", 12),
                 {"unexpected text after the header"});
  ExpectRejected(with("{'descr': '<f4\\n', " + f + ", 'shape': (3,), }", 12),
                 {"unsupported character"});
  ExpectRejected(with("{'descr': '<f4", 0), {"unterminated string"});
  ExpectRejected(with("{'descr' '<f4'}", 0), {"expected ':'"});
  ExpectRejected(with("", 0), {"expected '{'", "the end of the header"});
  std::string many = "(";
  for (int i = 0; i < 65; ++i) many += "1, ";
  ExpectRejected(with("{'descr': '<f4', " + f + ", 'shape': " + many + "), }", 4),
                 {"more than 64 dimensions"});
}

TEST(Npy, EveryTruncationAndByteFlipIsHandled) {
  Bytes good = SerializeNpy(Tensor::FromVector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3}));
  for (size_t n = 0; n < good.size(); ++n) {
    Bytes cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(ParseNpy(cut, "cut"), IoError) << "prefix of " << n << " bytes";
  }
  for (size_t i = 0; i < good.size(); ++i) {
    for (int flip : {0x01, 0x20, 0x80, 0xff}) {
      Bytes bad = good;
      bad[i] ^= static_cast<std::byte>(flip);
      try {
        ParseNpy(bad, "flipped");
      } catch (const IoError&) {
      }
    }
  }
}

TEST(Npy, FileErrorsNameThePath) {
  TempDir dir;
  std::string missing = dir.File("none.npy");
  try {
    ReadNpy(missing);
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  std::string path = dir.File("short.npy");
  WriteFileAtomic(path, Bytes(5, std::byte{0x93}));
  try {
    ReadNpy(path);
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": not a .npy file"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace switchyard
