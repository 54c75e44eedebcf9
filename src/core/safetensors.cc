#include "switchyard/core/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "switchyard/core/file_util.h"

namespace switchyard {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

using Json = nlohmann::json;

struct DTypeEntry {
  std::string_view name;
  DType dtype;
  int order;  // position in the reference implementation's Dtype enum; writers sort descending
};
constexpr std::array<DTypeEntry, 5> kSupportedDTypes = {{{"I16", DType::kInt16, 5},
                                                         {"BF16", DType::kBFloat16, 8},
                                                         {"I32", DType::kInt32, 9},
                                                         {"F32", DType::kFloat32, 11},
                                                         {"I64", DType::kInt64, 13}}};
// dtypes of the format that switchyard does not hold (named as such in errors).
constexpr std::array<std::string_view, 15> kUnsupportedDTypes = {
    "BOOL", "U8",  "I8",  "F8_E5M2", "F8_E4M3", "F8_E8M0", "U16", "F16",
    "U32",  "F64", "U64", "F4",      "F6_E2M3", "F6_E3M2", "C64"};

// A valid header nests 3 levels deep (root object > entry > shape array > dimension); unknown
// fields of an entry are ignored like the reference implementation does, so allow some room for
// them, but refuse absurd nesting (hostile input) early.
constexpr int kMaxJsonDepth = 16;

// Quotes a name for an error message, shortened so that a hostile header cannot produce a
// gigantic message.
std::string Quoted(std::string_view s) {
  constexpr size_t kMax = 120;
  if (s.size() <= kMax) return fmt::format("'{}'", s);
  return fmt::format("'{}...' ({} bytes)", s.substr(0, kMax), s.size());
}

std::string Abbreviated(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  constexpr size_t kMax = 60;
  if (s.size() > kMax) s = s.substr(0, kMax) + "...";
  return s;
}

int DTypeOrder(DType dtype) {
  for (const auto& e : kSupportedDTypes) {
    if (e.dtype == dtype) return e.order;
  }
  SY_CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
  return 0;
}

// Context for error messages: "<file>: tensor '<name>': <problem>".
class Where {
 public:
  Where(std::string_view what, std::string_view tensor) : what_(what), tensor_(tensor) {}
  template <typename... Args>
  [[noreturn]] void Fail(fmt::format_string<Args...> format, Args&&... args) const {
    throw IoError(fmt::format("{}: tensor {}: {}", what_, Quoted(tensor_),
                              fmt::format(format, std::forward<Args>(args)...)));
  }

 private:
  std::string_view what_;
  std::string_view tensor_;
};

uint64_t NonNegativeInteger(const Json& v, const Where& where, std::string_view field) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer())
    where.Fail("{} holds {}: expected a non-negative integer", field, v.get<int64_t>());
  where.Fail("{} holds {}: expected a non-negative integer", field, Abbreviated(v));
}

DType ParseDType(const Json& v, const Where& where, bool accept_float16, bool* float16) {
  if (!v.is_string()) where.Fail("dtype is {}: expected a string such as \"F32\"", Abbreviated(v));
  const auto& name = v.get_ref<const std::string&>();
  if (accept_float16 && name == "F16") {
    *float16 = true;
    return DType::kBFloat16;  // the same element size; SafetensorsEntry::float16 says which
  }
  for (const auto& e : kSupportedDTypes) {
    if (e.name == name) return e.dtype;
  }
  for (std::string_view u : kUnsupportedDTypes) {
    if (u == name) {
      where.Fail("dtype {} is not supported: switchyard reads F32, BF16, I32, I64 and I16", name);
    }
  }
  where.Fail("unknown dtype {}: expected one of F32, BF16, I32, I64", Quoted(name));
}

SafetensorsEntry ParseEntry(const std::string& name, const Json& info, uint64_t data_size,
                            std::string_view what, bool accept_float16) {
  Where where(what, name);
  if (!info.is_object()) {
    where.Fail("entry is {}: expected an object with dtype, shape and data_offsets",
               Abbreviated(info));
  }
  SafetensorsEntry entry;
  entry.name = name;
  auto field = [&](const char* key) -> const Json& {
    auto it = info.find(key);
    if (it == info.end()) where.Fail("the entry has no '{}'", key);
    return *it;
  };

  entry.dtype = ParseDType(field("dtype"), where, accept_float16, &entry.float16);

  const Json& shape = field("shape");
  if (!shape.is_array()) where.Fail("shape is {}: expected an array of sizes", Abbreviated(shape));
  int64_t numel = 1;
  bool overflow = false;
  entry.shape.reserve(shape.size());
  for (const Json& d : shape) {
    uint64_t size = NonNegativeInteger(d, where, "shape");
    if (size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      where.Fail("shape has a dimension of {}: too large", size);
    }
    entry.shape.push_back(static_cast<int64_t>(size));
    // Left to right, like NumElements(): a later zero does not excuse an earlier overflow.
    overflow = overflow || __builtin_mul_overflow(numel, static_cast<int64_t>(size), &numel);
  }
  if (overflow) {
    where.Fail("shape {} has more elements than fit in 64 bits", ShapeToString(entry.shape));
  }

  const Json& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    where.Fail("data_offsets is {}: expected [begin, end]", Abbreviated(offsets));
  }
  entry.data_begin = NonNegativeInteger(offsets[0], where, "data_offsets");
  entry.data_end = NonNegativeInteger(offsets[1], where, "data_offsets");
  if (entry.data_begin > entry.data_end) {
    where.Fail("data_offsets [{}, {}] end before they begin", entry.data_begin, entry.data_end);
  }
  if (entry.data_end > data_size) {
    where.Fail(
        "data_offsets [{}, {}] extend beyond the data section ({} bytes): the file is truncated "
        "or the offsets are wrong",
        entry.data_begin, entry.data_end, data_size);
  }
  uint64_t nbytes = 0;
  bool too_big =
      __builtin_mul_overflow(static_cast<uint64_t>(numel), DTypeSize(entry.dtype), &nbytes);
  if (too_big || entry.data_end - entry.data_begin != nbytes) {
    where.Fail("data_offsets [{}, {}] hold {} bytes, but {} x {} needs {} bytes", entry.data_begin,
               entry.data_end, entry.data_end - entry.data_begin, SafetensorsDTypeName(entry.dtype),
               ShapeToString(entry.shape),
               too_big ? std::string("more than 2^64") : std::to_string(nbytes));
  }
  return entry;
}

// Parses and validates the JSON header. `data_size` is the size of the data section after it.
SafetensorsHeader ParseHeaderText(std::string_view text, uint64_t data_size, std::string_view what,
                                  bool accept_float16 = false) {
  SY_REQUIRE(!text.empty(), IoError, "{}: the safetensors header is empty", what);
  SY_REQUIRE(text.front() == '{', IoError,
             "{}: the safetensors header does not start with '{{' (byte 0x{:02x}): not a "
             "safetensors file?",
             what, static_cast<unsigned char>(text.front()));

  // The JSON parser stops at a NUL byte as if the input ended there; JSON text never contains
  // one, so a NUL means garbage (the format pads with spaces only).
  size_t nul = text.find('\0');
  SY_REQUIRE(nul == std::string_view::npos, IoError,
             "{}: the safetensors header contains a NUL byte at offset {}: only JSON and space "
             "padding are allowed",
             what, 8 + nul);

  // Duplicate keys and nesting depth are checked while parsing: a JSON object keeps only one
  // value per key, so duplicates are invisible afterwards.
  std::vector<std::set<std::string>> open_objects;
  std::string entry_name;  // top-level key being parsed
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth > kMaxJsonDepth) {
      throw IoError(
          fmt::format("{}: the safetensors header nests deeper than its format allows", what));
    }
    switch (event) {
      case Json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case Json::parse_event_t::object_end: open_objects.pop_back(); break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (open_objects.size() == 1) entry_name = key;
        if (!open_objects.back().insert(key).second) {
          if (open_objects.size() == 1) {
            throw IoError(
                fmt::format("{}: tensor {} appears twice in the header", what, Quoted(key)));
          }
          throw IoError(fmt::format("{}: entry {}: key {} appears twice", what, Quoted(entry_name),
                                    Quoted(key)));
        }
        break;
      }
      default: break;
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(text.begin(), text.end(), callback);
  } catch (const Json::exception& e) {
    throw IoError(fmt::format("{}: the safetensors header is not valid JSON: {}", what, e.what()));
  }
  SY_REQUIRE(root.is_object(), IoError, "{}: the safetensors header is not a JSON object", what);

  SafetensorsHeader header;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;
      SY_REQUIRE(value.is_object(), IoError,
                 "{}: __metadata__ is {}: expected an object of string values", what,
                 Abbreviated(value));
      for (const auto& [mkey, mvalue] : value.items()) {
        SY_REQUIRE(mvalue.is_string(), IoError,
                   "{}: __metadata__ entry {} is {}: expected a string", what, Quoted(mkey),
                   Abbreviated(mvalue));
        header.metadata.emplace(mkey, mvalue.get<std::string>());
      }
      continue;
    }
    header.tensors.push_back(ParseEntry(key, value, data_size, what, accept_float16));
  }

  // The data section must be covered exactly: sorted by offsets, each tensor starts where the
  // previous one ended and the last one ends at the end of the file.
  std::sort(header.tensors.begin(), header.tensors.end(), [](const auto& a, const auto& b) {
    return std::tie(a.data_begin, a.data_end) < std::tie(b.data_begin, b.data_end);
  });
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& e : header.tensors) {
    if (e.data_begin < covered) {
      throw IoError(fmt::format("{}: tensor {} at [{}, {}] overlaps tensor {} at [{}, {}]", what,
                                Quoted(e.name), e.data_begin, e.data_end, Quoted(previous->name),
                                previous->data_begin, previous->data_end));
    }
    if (e.data_begin > covered) {
      throw IoError(fmt::format(
          "{}: bytes [{}, {}) of the data section belong to no tensor (a gap before tensor {})",
          what, covered, e.data_begin, Quoted(e.name)));
    }
    covered = e.data_end;
    previous = &e;
  }
  SY_REQUIRE(covered == data_size, IoError,
             "{}: the data section has {} bytes but the tensors cover only the first {} (trailing "
             "bytes)",
             what, data_size, covered);
  return header;
}

// Reads the 8-byte header length and checks it against the file size. Returns the header length.
uint64_t HeaderLength(std::span<const std::byte> prefix, uint64_t file_size,
                      std::string_view what) {
  SY_REQUIRE(file_size >= 8, IoError,
             "{}: the file has {} bytes, fewer than the 8-byte header length of a safetensors file",
             what, file_size);
  uint64_t n = 0;
  std::memcpy(&n, prefix.data(), 8);  // little-endian host (static_assert above)
  SY_REQUIRE(n <= kSafetensorsMaxHeaderBytes, IoError,
             "{}: header length {} exceeds the limit of {} bytes: not a safetensors file?", what, n,
             kSafetensorsMaxHeaderBytes);
  SY_REQUIRE(n <= file_size - 8, IoError,
             "{}: header length {} extends beyond the end of the file ({} bytes): truncated?", what,
             n, file_size);
  return n;
}

struct Prepared {
  std::string header;  // padded JSON
  std::vector<std::pair<const std::string*, const Tensor*>> order;
  uint64_t data_size = 0;
};

std::string JsonString(std::string_view s, std::string_view role) {
  try {
    return Json(s).dump(-1, ' ', false, Json::error_handler_t::strict);
  } catch (const Json::exception&) {
    throw InvalidArgument(fmt::format("safetensors: {} {} is not valid UTF-8", role, Quoted(s)));
  }
}

Prepared Prepare(const TensorMap& tensors, const SafetensorsMetadata& metadata) {
  Prepared p;
  p.order.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    SY_REQUIRE(tensor.defined(), InvalidArgument, "safetensors: tensor {} is undefined",
               Quoted(name));
    SY_REQUIRE(name != "__metadata__", InvalidArgument,
               "safetensors: a tensor may not be named \"__metadata__\" (reserved by the format)");
    p.order.emplace_back(&name, &tensor);
  }
  // As the reference writer: larger alignment first (descending dtype order), then by name.
  std::stable_sort(p.order.begin(), p.order.end(), [](const auto& a, const auto& b) {
    int oa = DTypeOrder(a.second->dtype());
    int ob = DTypeOrder(b.second->dtype());
    if (oa != ob) return oa > ob;
    return *a.first < *b.first;
  });

  std::string& h = p.header;
  h.push_back('{');  // not `h = "{"`: GCC 12 flags that assignment with a -Wrestrict false positive
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) h += ',';
      first = false;
      h += JsonString(key, "metadata key");
      h += ':';
      h += JsonString(value, "metadata value");
    }
    h += '}';
  }
  uint64_t offset = 0;
  for (const auto& [name, tensor] : p.order) {
    if (h.size() > 1) h += ',';
    h += JsonString(*name, "tensor name");
    h += fmt::format(":{{\"dtype\":\"{}\",\"shape\":[", SafetensorsDTypeName(tensor->dtype()));
    for (size_t i = 0; i < tensor->shape().size(); ++i) {
      if (i) h += ',';
      h += std::to_string(tensor->shape()[i]);
    }
    uint64_t end = offset + tensor->nbytes();
    h += fmt::format("],\"data_offsets\":[{},{}]}}", offset, end);
    offset = end;
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  p.data_size = offset;
  return p;
}

std::array<std::byte, 8> LengthPrefix(uint64_t n) {
  std::array<std::byte, 8> out;
  std::memcpy(out.data(), &n, 8);
  return out;
}

std::span<const std::byte> TensorBytes(const Tensor& t) {
  return {static_cast<const std::byte*>(t.raw()), t.nbytes()};
}

SafetensorsHeader ReadHeader(const RandomAccessFile& file, bool accept_float16 = false) {
  std::array<std::byte, 8> prefix{};
  if (file.size() >= 8) file.ReadAt(0, prefix);
  uint64_t n = HeaderLength(prefix, file.size(), file.path());
  std::string text(n, '\0');
  file.ReadAt(8, std::as_writable_bytes(std::span<char>(text.data(), text.size())));
  SafetensorsHeader header =
      ParseHeaderText(text, file.size() - 8 - n, file.path(), accept_float16);
  header.data_start = 8 + n;
  return header;
}

}  // namespace

std::string_view SafetensorsDTypeName(DType dtype) {
  for (const auto& e : kSupportedDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  SY_CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
  return "";
}

TensorMap ParseSafetensors(std::span<const std::byte> bytes, std::string_view what) {
  uint64_t n = HeaderLength(bytes, bytes.size(), what);
  std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, n);
  SafetensorsHeader header = ParseHeaderText(text, bytes.size() - 8 - n, what);
  const std::byte* data = bytes.data() + 8 + n;
  TensorMap out;
  for (const SafetensorsEntry& e : header.tensors) {
    Tensor t = Tensor::Empty(e.shape, e.dtype);
    if (t.nbytes() > 0) std::memcpy(t.raw(), data + e.data_begin, t.nbytes());
    out.emplace(e.name, std::move(t));
  }
  return out;
}

TensorMap ReadSafetensors(const std::string& path) {
  RandomAccessFile file(path);
  SafetensorsHeader header = ReadHeader(file);
  TensorMap out;
  for (const SafetensorsEntry& e : header.tensors) {
    Tensor t = Tensor::Empty(e.shape, e.dtype);
    if (t.nbytes() > 0) {
      file.ReadAt(header.data_start + e.data_begin, {static_cast<std::byte*>(t.raw()), t.nbytes()});
    }
    out.emplace(e.name, std::move(t));
  }
  return out;
}

SafetensorsHeader ReadSafetensorsHeader(const std::string& path, bool accept_float16) {
  RandomAccessFile file(path);
  return ReadHeader(file, accept_float16);
}

std::map<std::string, std::string> ReadSafetensorsMetadata(const std::string& path) {
  return ReadSafetensorsHeader(path).metadata;
}

std::vector<std::byte> SerializeSafetensors(const TensorMap& tensors,
                                            const std::map<std::string, std::string>& metadata) {
  Prepared p = Prepare(tensors, metadata);
  // Sized once and filled by memcpy: the vector::insert form made GCC 12 print a
  // -Wstringop-overflow false positive for the 8-byte prefix.
  std::vector<std::byte> out(8 + p.header.size() + p.data_size);
  std::byte* at = out.data();
  const auto prefix = LengthPrefix(p.header.size());
  std::memcpy(at, prefix.data(), prefix.size());
  at += prefix.size();
  std::memcpy(at, p.header.data(), p.header.size());
  at += p.header.size();
  for (const auto& [name, tensor] : p.order) {
    auto bytes = TensorBytes(*tensor);
    if (!bytes.empty()) std::memcpy(at, bytes.data(), bytes.size());
    at += bytes.size();
  }
  SY_CHECK(at == out.data() + out.size(), "safetensors: serialized {} of {} bytes", at - out.data(),
           out.size());
  return out;
}

void WriteSafetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  Prepared p = Prepare(tensors, metadata);
  AtomicFileWriter writer(path);
  writer.Append(LengthPrefix(p.header.size()));
  writer.Append(std::string_view(p.header));
  for (const auto& [name, tensor] : p.order) {
    if (tensor->nbytes() > 0) writer.Append(TensorBytes(*tensor));
  }
  writer.Commit();
}

}  // namespace switchyard
