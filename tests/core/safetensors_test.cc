#include "switchyard/core/safetensors.h"

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

Bytes ToBytes(std::initializer_list<int> values) {
  Bytes out;
  for (int v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

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

// A file: 8-byte length of `header` (or `length` if given), `header`, then `data`.
Bytes MakeFile(std::string_view header, const Bytes& data = {}, int64_t length = -1) {
  Bytes out;
  AppendValues<uint64_t>(out, {length < 0 ? header.size() : static_cast<uint64_t>(length)});
  Append(out, header);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes ZeroBytes(size_t n) { return Bytes(n, std::byte{0}); }

bool SameTensor(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

void ExpectSameMaps(const TensorMap& got, const TensorMap& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << "missing " << name;
    EXPECT_TRUE(SameTensor(it->second, t))
        << name << ": " << it->second.ToString() << " vs " << t.ToString();
  }
}

// Parses `bytes` expecting an IoError whose message contains every one of `needles`.
void ExpectRejected(const Bytes& bytes, std::initializer_list<std::string_view> needles) {
  try {
    ParseSafetensors(bytes, "bad.safetensors");
    ADD_FAILURE() << "accepted a malformed file; expected an error with '" << *needles.begin()
                  << "'";
  } catch (const IoError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
    for (std::string_view n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
  }
}

TensorMap EveryDType() {
  TensorMap m;
  m["f32"] = Tensor::FromVector<float>({1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f}, {2, 3});
  m["bf16"] = Tensor::FromVector<BFloat16>(
      {BFloat16(1.0f), BFloat16(-3.5f), BFloat16(1e10f), BFloat16(0.1f)}, {4});
  m["i32"] = Tensor::FromVector<int32_t>({7, -8, 2147483647}, {3, 1});
  m["i64"] = Tensor::FromVector<int64_t>({int64_t{1} << 40, -1, 0, 42}, {2, 2});
  m["i16"] = Tensor::FromVector<int16_t>({-32768, 7, 32767, 0}, {2, 2});
  m["scalar.f32"] = Tensor::FromVector<float>({3.0f}, {});
  m["scalar.i64"] = Tensor::FromVector<int64_t>({-9}, {});
  m["empty.f32"] = Tensor::Zeros({0, 5}, DType::kFloat32);
  m["empty.bf16"] = Tensor::Zeros({0}, DType::kBFloat16);
  m["empty.i32"] = Tensor::Zeros({3, 0}, DType::kInt32);
  m["empty.i64"] = Tensor::Zeros({0, 0, 2}, DType::kInt64);
  m["empty.i16"] = Tensor::Zeros({0}, DType::kInt16);
  m["weird name/with \"quotes\" \\ and \xc3\xa9\n"] = Tensor::FromVector<float>({1, 2}, {1, 2});
  return m;
}

TEST(Safetensors, RoundTripEveryDTypeInMemoryAndOnDisk) {
  TensorMap m = EveryDType();
  ExpectSameMaps(ParseSafetensors(SerializeSafetensors(m), "memory"), m);

  TempDir dir;
  std::string path = dir.File("t.safetensors");
  WriteSafetensors(path, m);
  ExpectSameMaps(ReadSafetensors(path), m);
  EXPECT_EQ(ReadFileBytes(path), SerializeSafetensors(m));
  EXPECT_TRUE(ReadSafetensorsMetadata(path).empty());
}

TEST(Safetensors, RoundTripOfViewsAndLargeTensors) {
  Tensor big = Tensor::Empty({1000, 257});
  for (int64_t i = 0; i < big.numel(); ++i) big.data<float>()[i] = static_cast<float>(i) * 0.5f;
  TensorMap m{{"big", big}, {"rows", big.Slice(10, 13)}};
  TempDir dir;
  WriteSafetensors(dir.File("v.safetensors"), m);
  TensorMap back = ReadSafetensors(dir.File("v.safetensors"));
  EXPECT_TRUE(SameTensor(back["big"], big));
  EXPECT_EQ(back["rows"].shape(), (Shape{3, 257}));
  EXPECT_EQ(back["rows"].data<float>()[0], 10 * 257 * 0.5f);
}

TEST(Safetensors, MetadataAndHeader) {
  TensorMap m{{"b", Tensor::Zeros({2}, DType::kBFloat16)},
              {"a", Tensor::Zeros({3})},
              {"c", Tensor::Zeros({1}, DType::kInt64)}};
  std::map<std::string, std::string> meta{{"format", "pt"}, {"step", "12"}, {"note", "é \"q\""}};
  TempDir dir;
  std::string path = dir.File("m.safetensors");
  WriteSafetensors(path, m, meta);
  EXPECT_EQ(ReadSafetensorsMetadata(path), meta);
  SafetensorsHeader h = ReadSafetensorsHeader(path);
  ASSERT_EQ(h.tensors.size(), 3u);
  // Data order: I64 first, then F32, then BF16 (descending dtype order, as the Python writer).
  EXPECT_EQ(h.tensors[0].name, "c");
  EXPECT_EQ(h.tensors[0].data_begin, 0u);
  EXPECT_EQ(h.tensors[0].data_end, 8u);
  EXPECT_EQ(h.tensors[1].name, "a");
  EXPECT_EQ(h.tensors[1].dtype, DType::kFloat32);
  EXPECT_EQ(h.tensors[1].shape, (Shape{3}));
  EXPECT_EQ(h.tensors[2].name, "b");
  EXPECT_EQ(h.tensors[2].data_end, 24u);
  EXPECT_EQ(h.data_start % 8, 0u);
  EXPECT_EQ(h.data_start + 24, ReadFileBytes(path).size());
}

// Byte vectors from the reference (Rust) implementation's own serialization tests.
// F16 is refused everywhere except a header read that asks for it (the Hugging Face weights
// reader, which converts the values itself): then the entry says float16, with the element size
// of bfloat16, and the layout checks hold as for any entry.
TEST(Safetensors, HeaderReadAcceptsFloat16OnlyWhenAsked) {
  TempDir dir;
  const std::string path = dir.File("h.safetensors");
  WriteFileAtomic(path, MakeFile(R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},)"
                                 R"("f":{"dtype":"F32","shape":[1],"data_offsets":[6,10]}})",
                                 ZeroBytes(10)));
  EXPECT_THROW(ReadSafetensorsHeader(path), IoError);
  EXPECT_THROW(ReadSafetensors(path), IoError);
  SafetensorsHeader h = ReadSafetensorsHeader(path, /*accept_float16=*/true);
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "h");
  EXPECT_TRUE(h.tensors[0].float16);
  EXPECT_EQ(h.tensors[0].data_end, 6u);
  EXPECT_FALSE(h.tensors[1].float16);
  // 3 halves need 6 bytes, not 8: still checked.
  WriteFileAtomic(
      path, MakeFile(R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,8]}})", ZeroBytes(8)));
  EXPECT_THROW(ReadSafetensorsHeader(path, true), IoError);
}

TEST(Safetensors, ByteExactWithTheReferenceImplementation) {
  TensorMap one{{"attn.0", Tensor::FromVector<float>({0, 1, 2, 3, 4, 5}, {1, 2, 3})}};
  EXPECT_EQ(SerializeSafetensors(one),
            ToBytes({64, 0,  0,   0,   0,   0,   0,   0,   123, 34,  97,  116, 116, 110, 46,  48,
                     34, 58, 123, 34,  100, 116, 121, 112, 101, 34,  58,  34,  70,  51,  50,  34,
                     44, 34, 115, 104, 97,  112, 101, 34,  58,  91,  49,  44,  50,  44,  51,  93,
                     44, 34, 100, 97,  116, 97,  95,  111, 102, 102, 115, 101, 116, 115, 34,  58,
                     91, 48, 44,  50,  52,  93,  125, 125, 0,   0,   0,   0,   0,   0,   128, 63,
                     0,  0,  0,   64,  0,   0,   64,  64,  0,   0,   128, 64,  0,   0,   160, 64}));
  // Forced alignment: the header is padded with spaces to a multiple of 8.
  TensorMap padded{{"attn0", Tensor::FromVector<float>({0, 1, 2, 3, 4, 5}, {1, 1, 2, 3})}};
  EXPECT_EQ(SerializeSafetensors(padded),
            ToBytes({72,  0,   0,   0,   0,   0,   0,   0,   123, 34, 97, 116, 116, 110, 48,
                     34,  58,  123, 34,  100, 116, 121, 112, 101, 34, 58, 34,  70,  51,  50,
                     34,  44,  34,  115, 104, 97,  112, 101, 34,  58, 91, 49,  44,  49,  44,
                     50,  44,  51,  93,  44,  34,  100, 97,  116, 97, 95, 111, 102, 102, 115,
                     101, 116, 115, 34,  58,  91,  48,  44,  50,  52, 93, 125, 125, 32,  32,
                     32,  32,  32,  32,  32,  0,   0,   0,   0,   0,  0,  128, 63,  0,   0,
                     0,   64,  0,   0,   64,  64,  0,   0,   128, 64, 0,  0,   160, 64}));
  EXPECT_EQ(SerializeSafetensors({}),
            ToBytes({8, 0, 0, 0, 0, 0, 0, 0, 123, 125, 32, 32, 32, 32, 32, 32}));
  EXPECT_EQ(SerializeSafetensors({}, {{"framework", "pt"}}),
            ToBytes({40,  0,   0,   0,  0,  0,  0,   0,   123, 34,  95,  95,  109, 101, 116, 97,
                     100, 97,  116, 97, 95, 95, 34,  58,  123, 34,  102, 114, 97,  109, 101, 119,
                     111, 114, 107, 34, 58, 34, 112, 116, 34,  125, 125, 32,  32,  32,  32,  32}));
}

// The Python layout rules for several dtypes, written out by hand: tensors sorted by descending
// dtype (I64 > F32 > I32 > BF16) then name, "__metadata__" first, compact JSON, space padding.
TEST(Safetensors, ByteExactMixedDTypesAndMetadata) {
  TensorMap m{{"z.bf16", Tensor::FromVector<BFloat16>({BFloat16(1.0f), BFloat16(-2.0f)}, {2})},
              {"a.i32", Tensor::FromVector<int32_t>({5}, {1})},
              {"b.f32", Tensor::FromVector<float>({0.5f, 2.0f}, {2, 1})},
              {"c.f32", Tensor::FromVector<float>({7.0f}, {})},
              {"d.i64", Tensor::FromVector<int64_t>({-3, 4}, {1, 2})}};
  std::string header = R"({"__metadata__":{"format":"pt"},)"
                       R"("d.i64":{"dtype":"I64","shape":[1,2],"data_offsets":[0,16]},)"
                       R"("b.f32":{"dtype":"F32","shape":[2,1],"data_offsets":[16,24]},)"
                       R"("c.f32":{"dtype":"F32","shape":[],"data_offsets":[24,28]},)"
                       R"("a.i32":{"dtype":"I32","shape":[1],"data_offsets":[28,32]},)"
                       R"("z.bf16":{"dtype":"BF16","shape":[2],"data_offsets":[32,36]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  Bytes data;
  AppendValues<int64_t>(data, {-3, 4});
  AppendValues<float>(data, {0.5f, 2.0f, 7.0f});
  AppendValues<int32_t>(data, {5});
  AppendValues<uint16_t>(data, {0x3f80, 0xc000});
  EXPECT_EQ(SerializeSafetensors(m, {{"format", "pt"}}), MakeFile(header, data));
  ExpectSameMaps(ParseSafetensors(MakeFile(header, data), "hand"), m);
}

TEST(Safetensors, AcceptsWhatOtherWritersProduce) {
  // Any entry order, whitespace, metadata last, null metadata, unknown fields, no padding.
  Bytes data;
  AppendValues<float>(data, {1.0f, 2.0f});
  AppendValues<int32_t>(data, {3});
  std::string header = R"({
    "y" : {"shape": [1], "data_offsets": [8, 12], "dtype": "I32", "extra": {"k": [1, 2]}},
    "x" : {"data_offsets": [0, 8], "dtype": "F32", "shape": [2]},
    "__metadata__": {"a": "b"} }
   )";
  TensorMap m = ParseSafetensors(MakeFile(header, data), "other");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m["x"].data<float>()[1], 2.0f);
  EXPECT_EQ(m["y"].data<int32_t>()[0], 3);
  Bytes none = MakeFile(
      R"({"__metadata__":null,"s":{"dtype":"I64","shape":[],"data_offsets":[0,8]}})", ZeroBytes(8));
  EXPECT_EQ(ParseSafetensors(none, "null-metadata").size(), 1u);
  // Zero-sized tensors may share an offset with each other and with a neighbour's boundary.
  Bytes zeros = MakeFile(R"({"e1":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                         R"("e2":{"dtype":"I64","shape":[4,0],"data_offsets":[0,0]},)"
                         R"("v":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                         R"("e3":{"dtype":"I32","shape":[0,9],"data_offsets":[4,4]}})",
                         ZeroBytes(4));
  EXPECT_EQ(ParseSafetensors(zeros, "zeros").size(), 4u);
}

TEST(Safetensors, RejectsTruncatedPrefixAndHeader) {
  ExpectRejected({}, {"0 bytes", "fewer than the 8-byte header length"});
  ExpectRejected(ZeroBytes(7), {"7 bytes"});
  ExpectRejected(MakeFile("{}", {}, 100), {"header length 100 extends beyond the end of the file"});
  ExpectRejected(MakeFile("{}", {}, int64_t{1} << 40), {"exceeds the limit"});
  Bytes huge = MakeFile("{}");
  std::memset(huge.data(), 0xff, 8);
  ExpectRejected(huge, {"exceeds the limit"});
  ExpectRejected(MakeFile(""), {"header is empty"});
  ExpectRejected(MakeFile("[]      "), {"does not start with '{'"});
  ExpectRejected(MakeFile(R"({"a":{"dtype":"F32",)"), {"not valid JSON"});
  ExpectRejected(MakeFile("{\"a\xff\":1}"), {"not valid JSON"});
  ExpectRejected(MakeFile(std::string_view("{}\0\0\0", 5)), {"NUL byte at offset 10"});
  ExpectRejected(MakeFile(R"({} {})"), {"not valid JSON"});
}

TEST(Safetensors, RejectsMalformedEntries) {
  auto one = [](std::string_view entry, size_t data_bytes = 8) {
    return MakeFile(fmt::format(R"({{"w":{}}})", entry), ZeroBytes(data_bytes));
  };
  ExpectRejected(one("[1,2]"), {"tensor 'w'", "expected an object"});
  ExpectRejected(one(R"({"shape":[2],"data_offsets":[0,8]})"), {"tensor 'w'", "no 'dtype'"});
  ExpectRejected(one(R"({"dtype":"F32","data_offsets":[0,8]})"), {"tensor 'w'", "no 'shape'"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[2]})"), {"tensor 'w'", "no 'data_offsets'"});
  ExpectRejected(one(R"({"dtype":"F16","shape":[4],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "dtype F16 is not supported", "F32, BF16, I32, I64 and I16"});
  ExpectRejected(one(R"({"dtype":"F64","shape":[1],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "dtype F64 is not supported"});
  ExpectRejected(one(R"({"dtype":"Q7","shape":[2],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "unknown dtype 'Q7'"});
  ExpectRejected(one(R"({"dtype":32,"shape":[2],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "dtype is 32"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "shape holds -2", "non-negative"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "shape holds 2.0"});
  ExpectRejected(one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"),
                 {"tensor 'w'", "shape is 2"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "too large"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "expected a non-negative integer"});
  ExpectRejected(
      one(R"({"dtype":"F32","shape":[4294967296,4294967296,4294967296,0],"data_offsets":[0,8]})"),
      {"tensor 'w'", "more elements than fit in 64 bits"});
  ExpectRejected(one(R"({"dtype":"I64","shape":[2305843009213693952],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "more than 2^64"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})"),
                 {"tensor 'w'", "expected [begin, end]"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,16]})"),
                 {"tensor 'w'", "expected [begin, end]"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"),
                 {"tensor 'w'", "data_offsets holds -8"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"),
                 {"tensor 'w'", "end before they begin"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,16]})"),
                 {"tensor 'w'", "extend beyond the data section (8 bytes)", "truncated"});
  ExpectRejected(one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "hold 8 bytes, but F32 x [3] needs 12 bytes"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "needs 4 bytes"});
}

TEST(Safetensors, RejectsBadLayoutOfTheDataSection) {
  std::string two_f32 = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)";
  ExpectRejected(MakeFile(two_f32 + R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                          ZeroBytes(12)),
                 {"tensor 'b' at [4, 12] overlaps tensor 'a' at [0, 8]"});
  ExpectRejected(
      MakeFile(two_f32 + R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", ZeroBytes(8)),
      {"overlaps"});
  ExpectRejected(MakeFile(two_f32 + R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
                          ZeroBytes(16)),
                 {"bytes [8, 12) of the data section belong to no tensor", "'b'"});
  ExpectRejected(MakeFile(two_f32 + R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                          ZeroBytes(20)),
                 {"20 bytes but the tensors cover only the first 12", "trailing"});
  ExpectRejected(
      MakeFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", ZeroBytes(8)),
      {"bytes [0, 4)", "'a'"});
  ExpectRejected(MakeFile("{}", ZeroBytes(3)), {"3 bytes but the tensors cover only the first 0"});
}

TEST(Safetensors, RejectsDuplicatesMetadataAndNesting) {
  std::string a = R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  ExpectRejected(MakeFile("{" + a + "," + a + "}", ZeroBytes(4)), {"tensor 'a' appears twice"});
  ExpectRejected(MakeFile(R"({"a":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                          ZeroBytes(4)),
                 {"entry 'a'", "key 'dtype' appears twice"});
  ExpectRejected(MakeFile(R"({"__metadata__":{"k":"1","k":"2"}})"),
                 {"entry '__metadata__'", "key 'k' appears twice"});
  ExpectRejected(MakeFile(R"({"__metadata__":[1]})"), {"__metadata__ is [1]"});
  ExpectRejected(MakeFile(R"({"__metadata__":{"k":1}})"), {"__metadata__ entry 'k' is 1"});
  ExpectRejected(MakeFile(R"({"__metadata__":{"k":{"n":"x"}}})"), {"__metadata__ entry 'k'"});
  ExpectRejected(MakeFile(std::string(1, '{') + R"("a":)" + std::string(100000, '[') + "}"),
                 {"nests deeper"});
  ExpectRejected(
      MakeFile(R"({"a":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", ZeroBytes(4)),
      {"tensor 'a'", "shape holds [1]"});
}

TEST(Safetensors, LongNamesAreShortenedInMessages) {
  std::string name(5000, 'n');
  std::string msg;
  try {
    ParseSafetensors(
        MakeFile(fmt::format(R"({{"{}":{{"dtype":"F16","shape":[],"data_offsets":[0,2]}}}})", name),
                 ZeroBytes(2)),
        "f");
  } catch (const IoError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("(5000 bytes)"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 400u);
}

// Every truncation and every single-byte corruption of a valid file either parses or throws
// IoError: no crash, no other exception, no out-of-bounds read (checked under ASan).
TEST(Safetensors, EveryTruncationAndByteFlipIsHandled) {
  TensorMap m = EveryDType();
  Bytes good = SerializeSafetensors(m, {{"k", "v"}});
  for (size_t n = 0; n < good.size(); ++n) {
    Bytes cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(ParseSafetensors(cut, "cut"), IoError) << "prefix of " << n << " bytes";
  }
  int accepted = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    for (int flip : {0x01, 0x20, 0x80, 0xff}) {
      Bytes bad = good;
      bad[i] ^= static_cast<std::byte>(flip);
      try {
        ParseSafetensors(bad, "flipped");
        ++accepted;  // e.g. a flipped data byte or a changed letter in a name
      } catch (const IoError&) {
      }
    }
  }
  EXPECT_GT(accepted, 0);
}

TEST(Safetensors, FileErrorsNameThePath) {
  TempDir dir;
  std::string missing = dir.File("none.safetensors");
  try {
    ReadSafetensors(missing);
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  EXPECT_THROW(ReadSafetensorsMetadata(dir.path()), IoError);
  // A truncated file on disk: same message as in memory, with the path.
  Bytes good = SerializeSafetensors(EveryDType());
  good.resize(good.size() - 1);
  std::string path = dir.File("cut.safetensors");
  WriteFileAtomic(path, good);
  try {
    ReadSafetensors(path);
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  }
}

TEST(Safetensors, WriteRejectsBadInputAndKeepsTheOldFile) {
  TempDir dir;
  std::string path = dir.File("keep.safetensors");
  TensorMap good{{"w", Tensor::Full({2}, 1.0)}};
  WriteSafetensors(path, good);
  Bytes before = ReadFileBytes(path);

  EXPECT_THROW(WriteSafetensors(path, {{"u", Tensor()}}), InvalidArgument);
  EXPECT_THROW(WriteSafetensors(path, {{"__metadata__", Tensor::Zeros({1})}}), InvalidArgument);
  EXPECT_THROW(WriteSafetensors(path, {{"bad\xff", Tensor::Zeros({1})}}), InvalidArgument);
  EXPECT_THROW(WriteSafetensors(path, good, {{"k", "bad\xc3"}}), InvalidArgument);
  EXPECT_EQ(ReadFileBytes(path), before);

  std::string in_the_way = dir.File("dir.safetensors");
  std::filesystem::create_directory(in_the_way);
  EXPECT_THROW(WriteSafetensors(in_the_way, good), IoError);
  EXPECT_TRUE(std::filesystem::is_directory(in_the_way));
  EXPECT_THROW(WriteSafetensors(dir.File("missing/x.safetensors"), good), IoError);
  EXPECT_EQ(dir.List(), (std::vector<std::string>{"dir.safetensors", "keep.safetensors"}));
}

}  // namespace
}  // namespace switchyard
