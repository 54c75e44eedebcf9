#include "switchyard/core/npy.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <optional>

#include "switchyard/core/file_util.h"

namespace switchyard {
namespace {

static_assert(std::endian::native == std::endian::little,
              ".npy files are read as little-endian; big-endian hosts are not supported");

constexpr std::array<unsigned char, 6> kMagic = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr size_t kMagicLen = 8;           // magic + major + minor version bytes
constexpr size_t kArrayAlign = 64;        // numpy's ARRAY_ALIGN
constexpr size_t kGrowthAxisDigits = 21;  // numpy's GROWTH_AXIS_MAX_DIGITS
constexpr uint64_t kMaxHeaderBytes = 1 << 20;
constexpr size_t kMaxDims = 64;  // NPY_MAXDIMS of NumPy 2

struct NpyHeader {
  DType dtype = DType::kFloat32;
  Shape shape;
  uint64_t data_start = 0;  // offset of the first element
};

std::string_view NpyDescr(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "<f4";
    case DType::kInt32: return "<i4";
    case DType::kInt64: return "<i8";
    case DType::kInt16: return "<i2";
    case DType::kBFloat16: break;
  }
  return "";
}

// Parser for the Python dict literal in an .npy header, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// Accepts exactly what numpy writes, with Python's freedom in spacing, quotes and trailing
// commas, and nothing else (no escapes, no nested containers other than the shape tuple).
class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string_view what) : text_(text), what_(what) {}

  NpyHeader Parse() {
    std::optional<std::string> descr;
    std::optional<bool> fortran_order;
    std::optional<Shape> shape;
    SkipSpace();
    Expect('{', "the header dictionary");
    SkipSpace();
    while (!Peek('}')) {
      std::string key = ParseString("a key");
      SkipSpace();
      Expect(':', "after the key");
      SkipSpace();
      if (key == "descr") {
        Require(!descr, "key 'descr' appears twice");
        if (Peek('[')) Fail("structured dtypes (descr is a list) are not supported");
        descr = ParseString("the value of 'descr'");
      } else if (key == "fortran_order") {
        Require(!fortran_order, "key 'fortran_order' appears twice");
        fortran_order = ParseBool();
      } else if (key == "shape") {
        Require(!shape, "key 'shape' appears twice");
        shape = ParseShape();
      } else {
        Fail(fmt::format("unexpected key '{}': expected descr, fortran_order and shape",
                         Shortened(key)));
      }
      SkipSpace();
      if (!Consume(',')) break;
      SkipSpace();
    }
    Expect('}', "the end of the header dictionary");
    SkipSpace();
    Require(pos_ == text_.size(), "unexpected text after the header dictionary");
    Require(descr.has_value(), "the header has no 'descr'");
    Require(fortran_order.has_value(), "the header has no 'fortran_order'");
    Require(shape.has_value(), "the header has no 'shape'");

    NpyHeader header;
    header.shape = std::move(*shape);
    if (*descr == "<f4") {
      header.dtype = DType::kFloat32;
    } else if (*descr == "<i4") {
      header.dtype = DType::kInt32;
    } else if (*descr == "<i8") {
      header.dtype = DType::kInt64;
    } else if (*descr == "<i2") {
      header.dtype = DType::kInt16;
    } else {
      Fail(
          fmt::format("dtype '{}' is not supported: switchyard reads '<f4' (float32), '<i4' "
                      "(int32), '<i8' (int64) and '<i2' (int16)",
                      Shortened(*descr)));
    }
    if (*fortran_order) {
      int non_trivial = 0;
      for (int64_t d : header.shape) non_trivial += d > 1 ? 1 : 0;
      Require(non_trivial <= 1,
              fmt::format("fortran_order True with shape {} is not supported: save the array in "
                          "C order (numpy.ascontiguousarray)",
                          ShapeToString(header.shape)));
    }
    return header;
  }

 private:
  [[noreturn]] void Fail(const std::string& problem) const {
    throw IoError(fmt::format("{}: .npy header: {}", what_, problem));
  }
  void Require(bool ok, const std::string& problem) const {
    if (!ok) Fail(problem);
  }
  static std::string Shortened(std::string_view s) {
    return s.size() <= 40 ? std::string(s) : std::string(s.substr(0, 40)) + "...";
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\t' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool Peek(char c) const { return pos_ < text_.size() && text_[pos_] == c; }
  bool Consume(char c) {
    if (!Peek(c)) return false;
    ++pos_;
    return true;
  }
  void Expect(char c, std::string_view context) {
    if (Consume(c)) return;
    Fail(fmt::format("expected '{}' for {} at byte {}, found {}", c, context, pos_, Found()));
  }
  std::string Found() const {
    if (pos_ >= text_.size()) return "the end of the header";
    unsigned char c = static_cast<unsigned char>(text_[pos_]);
    if (c >= 0x20 && c < 0x7f) return fmt::format("'{}'", static_cast<char>(c));
    return fmt::format("byte 0x{:02x}", c);
  }

  std::string ParseString(std::string_view context) {
    if (!Peek('\'') && !Peek('"')) {
      Fail(fmt::format("expected a quoted string for {} at byte {}, found {}", context, pos_,
                       Found()));
    }
    char quote = text_[pos_++];
    size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != quote) {
      if (text_[pos_] == '\\' || text_[pos_] == '\n') {
        Fail(fmt::format("unsupported character in the string for {}", context));
      }
      ++pos_;
    }
    Require(pos_ < text_.size(), fmt::format("unterminated string for {}", context));
    return std::string(text_.substr(start, pos_++ - start));
  }

  bool ParseBool() {
    if (text_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (text_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    Fail(fmt::format("fortran_order must be True or False, found {}", Found()));
  }

  int64_t ParseDimension() {
    Require(!Peek('-'), "shape has a negative dimension");
    Require(pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9',
            fmt::format("expected a dimension in the shape at byte {}, found {}", pos_, Found()));
    int64_t value = 0;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      int digit = text_[pos_++] - '0';
      Require(!__builtin_mul_overflow(value, int64_t{10}, &value) &&
                  !__builtin_add_overflow(value, int64_t{digit}, &value),
              "shape has a dimension too large for 64 bits");
    }
    Consume('L');  // Python 2 long literal, as old numpy versions wrote
    return value;
  }

  // "()", "(5,)", "(2, 3)", "(2, 3,)".
  Shape ParseShape() {
    Require(Consume('('), fmt::format("shape must be a tuple such as (2, 3), found {}", Found()));
    Shape shape;
    SkipSpace();
    bool trailing_comma = false;
    while (!Peek(')')) {
      Require(shape.size() < kMaxDims, fmt::format("shape has more than {} dimensions", kMaxDims));
      shape.push_back(ParseDimension());
      SkipSpace();
      trailing_comma = Consume(',');
      if (!trailing_comma) break;
      SkipSpace();
    }
    Expect(')', "the end of the shape tuple");
    // (5) is the integer 5 in Python, not a tuple.
    Require(shape.size() != 1 || trailing_comma, "shape (n) is not a tuple: expected (n,)");
    int64_t numel = 1;
    for (int64_t d : shape) {
      Require(!__builtin_mul_overflow(numel, d, &numel),
              fmt::format("shape {} has more elements than fit in 64 bits", ShapeToString(shape)));
    }
    return shape;
  }

  std::string_view text_;
  std::string_view what_;
  size_t pos_ = 0;
};

// Parses the magic, version and header of a file of `file_size` bytes whose first bytes are in
// `prefix` (at least 10 bytes, or the whole file if shorter), and checks the data size.
// When `prefix` is too short to hold the whole header, sets *needed to the number of bytes
// required and returns an unspecified header; the caller reads more and calls again.
NpyHeader ParseHeader(std::span<const std::byte> prefix, uint64_t file_size, std::string_view what,
                      uint64_t* needed) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(prefix[i]); };
  SY_REQUIRE(file_size >= kMagic.size() && std::memcmp(prefix.data(), kMagic.data(), 6) == 0,
             IoError, "{}: not a .npy file (it does not start with \"\\x93NUMPY\")", what);
  SY_REQUIRE(file_size >= kMagicLen, IoError,
             "{}: the file ends inside the .npy version ({} bytes)", what, file_size);
  unsigned major = byte(6);
  unsigned minor = byte(7);
  SY_REQUIRE((major == 1 || major == 2 || major == 3) && minor == 0, IoError,
             "{}: .npy format version {}.{} is not supported: expected 1.0, 2.0 or 3.0", what,
             major, minor);
  size_t len_bytes = major == 1 ? 2 : 4;
  SY_REQUIRE(file_size >= kMagicLen + len_bytes, IoError,
             "{}: the file ends inside the .npy header length ({} bytes)", what, file_size);
  if (prefix.size() < kMagicLen + len_bytes) {
    *needed = kMagicLen + len_bytes;
    return {};
  }
  uint64_t header_len = 0;
  for (size_t i = 0; i < len_bytes; ++i) header_len |= uint64_t{byte(kMagicLen + i)} << (8 * i);
  SY_REQUIRE(header_len <= kMaxHeaderBytes, IoError,
             "{}: .npy header length {} exceeds the limit of {} bytes", what, header_len,
             kMaxHeaderBytes);
  uint64_t data_start = kMagicLen + len_bytes + header_len;
  SY_REQUIRE(data_start <= file_size, IoError,
             "{}: .npy header length {} extends beyond the end of the file ({} bytes): truncated?",
             what, header_len, file_size);
  if (prefix.size() < data_start) {
    *needed = data_start;
    return {};
  }
  *needed = 0;
  std::string_view text(reinterpret_cast<const char*>(prefix.data()) + kMagicLen + len_bytes,
                        header_len);
  NpyHeader header = HeaderParser(text, what).Parse();
  header.data_start = data_start;
  uint64_t data_bytes = file_size - data_start;
  uint64_t expected = 0;
  bool too_big = __builtin_mul_overflow(static_cast<uint64_t>(NumElements(header.shape)),
                                        DTypeSize(header.dtype), &expected);
  SY_REQUIRE(!too_big && data_bytes >= expected, IoError,
             "{}: {} {} needs {} bytes of data but the file holds {} after the header: truncated?",
             what, NpyDescr(header.dtype), ShapeToString(header.shape),
             too_big ? std::string("more than 2^64") : std::to_string(expected), data_bytes);
  SY_REQUIRE(data_bytes == expected, IoError,
             "{}: {} {} needs {} bytes of data but the file holds {} after the header (trailing "
             "bytes)",
             what, NpyDescr(header.dtype), ShapeToString(header.shape), expected, data_bytes);
  return header;
}

std::string ShapeRepr(const Shape& shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + ")";
}

// Magic, version, length and padded header text, exactly as numpy.save writes them.
std::string HeaderBytes(const Tensor& t) {
  SY_REQUIRE(t.defined(), InvalidArgument, "WriteNpy: the tensor is undefined");
  SY_REQUIRE(t.dtype() != DType::kBFloat16, InvalidArgument,
             "WriteNpy: bfloat16 has no .npy dtype; convert to float32 (Tensor::To) or write "
             "safetensors, which stores BF16");
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
                                 NpyDescr(t.dtype()), ShapeRepr(t.shape()));
  if (!t.shape().empty()) {
    size_t digits = std::to_string(t.shape()[0]).size();
    dict.append(kGrowthAxisDigits > digits ? kGrowthAxisDigits - digits : 0, ' ');
  }
  for (int major : {1, 2}) {
    size_t len_bytes = major == 1 ? 2 : 4;
    size_t hlen = dict.size() + 1;  // + '\n'
    size_t pad = kArrayAlign - (kMagicLen + len_bytes + hlen) % kArrayAlign;
    uint64_t total = hlen + pad;
    if (major == 1 && total > 0xffff) continue;
    std::string out(reinterpret_cast<const char*>(kMagic.data()), kMagic.size());
    out += static_cast<char>(major);
    out += '\0';
    for (size_t i = 0; i < len_bytes; ++i) out += static_cast<char>((total >> (8 * i)) & 0xff);
    out += dict;
    out.append(pad, ' ');
    out += '\n';
    return out;
  }
  SY_CHECK(false, "unreachable");
  return "";
}

}  // namespace

Tensor ParseNpy(std::span<const std::byte> bytes, std::string_view what) {
  uint64_t needed = 0;
  NpyHeader header = ParseHeader(bytes, bytes.size(), what, &needed);
  SY_CHECK(needed == 0, "whole file given, yet {} bytes needed", needed);
  Tensor t = Tensor::Empty(header.shape, header.dtype);
  if (t.nbytes() > 0) std::memcpy(t.raw(), bytes.data() + header.data_start, t.nbytes());
  return t;
}

Tensor ReadNpy(const std::string& path) {
  RandomAccessFile file(path);
  std::vector<std::byte> prefix(std::min<uint64_t>(file.size(), 128));
  file.ReadAt(0, prefix);
  uint64_t needed = 0;
  NpyHeader header = ParseHeader(prefix, file.size(), path, &needed);
  if (needed > 0) {
    prefix.resize(needed);
    file.ReadAt(0, prefix);
    header = ParseHeader(prefix, file.size(), path, &needed);
    SY_CHECK(needed == 0, "{} bytes read, yet {} needed", prefix.size(), needed);
  }
  Tensor t = Tensor::Empty(header.shape, header.dtype);
  if (t.nbytes() > 0)
    file.ReadAt(header.data_start, {static_cast<std::byte*>(t.raw()), t.nbytes()});
  return t;
}

std::vector<std::byte> SerializeNpy(const Tensor& t) {
  std::string header = HeaderBytes(t);
  std::vector<std::byte> out(header.size() + t.nbytes());
  std::memcpy(out.data(), header.data(), header.size());
  if (t.nbytes() > 0) std::memcpy(out.data() + header.size(), t.raw(), t.nbytes());
  return out;
}

void WriteNpy(const std::string& path, const Tensor& t) {
  std::string header = HeaderBytes(t);
  AtomicFileWriter writer(path);
  writer.Append(std::string_view(header));
  if (t.nbytes() > 0) writer.Append({static_cast<const std::byte*>(t.raw()), t.nbytes()});
  writer.Commit();
}

}  // namespace switchyard
