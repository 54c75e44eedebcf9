// safetensors: the tensor file format of Hugging Face (what `safetensors.torch.save_file` writes
// and `load_file` reads), so that users can move tensors between switchyard and PyTorch.
//
// Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON
//   {"__metadata__": {"key": "value", ...},
//    "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
// then the data: each tensor's elements, little-endian, C order, at [begin, end) relative to the
// start of the data. See docs/formats.md for exactly what is accepted and rejected.
//
// dtypes: F32 <-> float32, BF16 <-> bfloat16, I32 <-> int32, I64 <-> int64, I16 <-> int16 (compact
// indices such as router traces). Any other dtype of the
// format (F16, F64, U8, BOOL, ...) is rejected with an IoError naming the tensor and the dtype.
//
// Reading validates like the reference implementation (and is at least as strict): the header
// must be valid JSON of the shape above; offsets must lie inside the file, match dtype x shape,
// not overlap, and cover the data exactly (no gaps, no trailing bytes); names are unique;
// shapes are non-negative and their element counts do not overflow. Any violation throws IoError
// naming the file (`what`), the tensor and the problem; a malformed file never crashes or reads
// out of bounds.
//
// Writing produces the bytes the Python library produces for the same tensors: tensors ordered
// by dtype (I64, F32, I32, BF16) then by name, `__metadata__` first, compact JSON, header padded
// with spaces to a multiple of 8 bytes. Metadata entries are written in key order (Python's order
// is unspecified). Files are written atomically (see file_util.h).
//
// Thread-safety: all functions are reentrant; none keeps state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/tensor.h"

namespace switchyard {

// Tensors by name. std::map: deterministic (sorted) iteration.
using TensorMap = std::map<std::string, Tensor>;
using SafetensorsMetadata = std::map<std::string, std::string>;

// One tensor as described in a safetensors header.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  uint64_t data_begin = 0;  // byte offsets relative to the start of the data section
  uint64_t data_end = 0;
  // "F16" (IEEE half), only from ReadSafetensorsHeader(path, accept_float16 = true): switchyard
  // holds no float16 tensors, so `dtype` is then kBFloat16 (the same element size) and the caller
  // converts the raw bytes itself (the Hugging Face reader converts them to float32).
  bool float16 = false;
};

// A validated header.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;  // ordered by data_begin
  SafetensorsMetadata metadata;           // "__metadata__"; empty if absent
  uint64_t data_start = 0;                // file offset of the data section (8 + header length)
};

// Headers larger than this are rejected (the reference implementation's limit).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// Reads every tensor of a file. Throws IoError (missing file, malformed contents, unsupported
// dtype), naming the file, the tensor and the problem.
TensorMap ReadSafetensors(const std::string& path);

// Parses a whole file held in memory; `what` names it in error messages (e.g. the path).
// The returned tensors own copies of their data. Throws IoError like ReadSafetensors.
TensorMap ParseSafetensors(std::span<const std::byte> bytes, std::string_view what);

// The "__metadata__" map of a file (empty if it has none). Reads only the header, but validates
// it against the file size like ReadSafetensors.
std::map<std::string, std::string> ReadSafetensorsMetadata(const std::string& path);

// Names, dtypes, shapes and offsets of a file's tensors, without reading their data. With
// accept_float16, "F16" entries are accepted too (SafetensorsEntry::float16).
SafetensorsHeader ReadSafetensorsHeader(const std::string& path, bool accept_float16 = false);

// Writes `tensors` (and `metadata`, omitted when empty) to `path` atomically: on any error the
// previous file at `path` is left intact. Throws InvalidArgument for an undefined tensor, a
// tensor named "__metadata__" or a name/metadata string that is not valid UTF-8; IoError when
// the file cannot be written.
void WriteSafetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The bytes WriteSafetensors writes, in memory.
std::vector<std::byte> SerializeSafetensors(
    const TensorMap& tensors, const std::map<std::string, std::string>& metadata = {});

// "F32", "BF16", "I32", "I64".
std::string_view SafetensorsDTypeName(DType dtype);

}  // namespace switchyard
