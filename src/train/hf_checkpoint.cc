// Sharded safetensors of a Hugging Face model directory: lazy reading, streaming sharded writing.
#include "switchyard/train/hf_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/json.h"
#include "switchyard/train/mixed_precision.h"

namespace switchyard::train::hf {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

bool IsPlainFileName(const std::string& f) {
  return !f.empty() && f[0] != '.' && f.find('/') == std::string::npos &&
         f.find('\\') == std::string::npos;
}

// "model.layers.3.self_attn.rotary_emb.inv_freq": a buffer older checkpoints carry.
bool IsRotaryBuffer(const std::string& name) {
  const std::string_view suffix = "rotary_emb.inv_freq";
  return name.size() >= suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string ShardName(size_t i, size_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
}

void Rename(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  SY_REQUIRE(!ec, IoError, "{}: cannot rename to {}: {}", from, to, ec.message());
}

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits = 0;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant != 0) {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  } else {
    bits = sign;
  }
  float f = 0;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// ---- reading ----

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  const std::string single = dir_ + "/" + kSingleFile;
  const std::string index = dir_ + "/" + kIndexFile;
  std::map<std::string, std::set<std::string>> by_file;  // file -> tensors the index maps there
  if (fs::exists(single)) {
    by_file[kSingleFile] = {};
  } else {
    SY_REQUIRE(fs::exists(index), IoError,
               "{}: no Hugging Face weights: expected {} or {} (with its shards)", dir_,
               kSingleFile, kIndexFile);
    Json j = ParseJsonStrict(ReadTextFile(index), index, JsonErrorKind::kIoError);
    SY_REQUIRE(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), IoError,
               "{}: key 'weight_map': expected an object {{tensor name: file}}", index);
    for (const auto& [name, file] : j["weight_map"].items()) {
      SY_REQUIRE(file.is_string() && IsPlainFileName(file.get<std::string>()), IoError,
                 "{}: key 'weight_map.{}': expected a file name in the model directory, got {}",
                 index, name, file.dump());
      by_file[file.get<std::string>()].insert(name);
    }
  }
  for (const auto& [file, mapped] : by_file) {
    const std::string path = dir_ + "/" + file;
    if (!fs::exists(path)) {
      throw IoError(fmt::format("{}: key 'weight_map.{}' names {}, which does not exist", index,
                                mapped.empty() ? "?" : *mapped.begin(), path));
    }
    SafetensorsHeader h = ReadSafetensorsHeader(path, /*accept_float16=*/true);
    std::set<std::string> present;
    for (const SafetensorsEntry& e : h.tensors) {
      present.insert(e.name);
      // Single file: every tensor; sharded: the ones the index maps to this file.
      if (mapped.empty() || mapped.count(e.name) > 0) {
        tensors_[e.name] = Location{file, e, h.data_start};
      }
    }
    for (const std::string& name : mapped) {
      SY_REQUIRE(present.count(name) > 0, IoError,
                 "{}: key 'weight_map.{}' names {}, which has no tensor '{}'", index, name, path,
                 name);
    }
  }
}

std::vector<std::string> CheckpointReader::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, loc] : tensors_) names.push_back(name);
  return names;
}

const CheckpointReader::Location& CheckpointReader::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  SY_REQUIRE(it != tensors_.end(), IoError, "{}: tensor '{}' is missing from the model's weights",
             dir_, name);
  return it->second;
}

const std::string& CheckpointReader::FileOf(const std::string& name) const {
  return Find(name).file;
}

const Shape& CheckpointReader::ShapeOf(const std::string& name) const {
  return Find(name).entry.shape;
}

namespace {

// `raw` (F32, BF16 or F16 bits as stored) as float32.
Tensor StoredToFloat32(const Tensor& raw, bool half) {
  if (raw.dtype() == DType::kFloat32) return raw;
  if (!half) return ToFloat32(raw, 1);
  Tensor out = Tensor::Empty(raw.shape());
  const auto* h = static_cast<const uint16_t*>(raw.raw());
  float* o = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = HalfToFloat(h[i]);
  return out;
}

void RequireFloatingPoint(const SafetensorsEntry& entry, const std::string& path,
                          const std::string& name) {
  SY_REQUIRE(entry.float16 || entry.dtype == DType::kFloat32 || entry.dtype == DType::kBFloat16,
             IoError, "{}: tensor '{}': dtype {} is not a floating-point type (F32, BF16, F16)",
             path, name, SafetensorsDTypeName(entry.dtype));
}

}  // namespace

Tensor CheckpointReader::ReadFloat32(const std::string& name, const Shape& expected) const {
  const Location& loc = Find(name);
  const std::string path = dir_ + "/" + loc.file;
  SY_REQUIRE(loc.entry.shape == expected, InvalidArgument,
             "{}: tensor '{}': expected shape {}, got {}", path, name, ShapeToString(expected),
             ShapeToString(loc.entry.shape));
  RequireFloatingPoint(loc.entry, path, name);
  RandomAccessFile file(path);
  Tensor raw = Tensor::Empty(expected, loc.entry.dtype);
  if (raw.nbytes() > 0) {
    file.ReadAt(loc.data_start + loc.entry.data_begin,
                {static_cast<std::byte*>(raw.raw()), raw.nbytes()});
    *bytes_read_ += raw.nbytes();
  }
  return StoredToFloat32(raw, loc.entry.float16);
}

Tensor CheckpointReader::ReadBox(const std::string& name, const std::vector<int64_t>& begin,
                                 const std::vector<int64_t>& end) const {
  const Location& loc = Find(name);
  const std::string path = dir_ + "/" + loc.file;
  const Shape& full = loc.entry.shape;
  const size_t dims = full.size();
  bool inside = begin.size() == dims && end.size() == dims;
  for (size_t d = 0; inside && d < dims; ++d) {
    inside = 0 <= begin[d] && begin[d] <= end[d] && end[d] <= full[d];
  }
  SY_REQUIRE(inside, InvalidArgument,
             "{}: tensor '{}' of shape {}: the part [{}) .. [{}) is not inside it", path, name,
             ShapeToString(full), fmt::join(begin, ", "), fmt::join(end, ", "));
  RequireFloatingPoint(loc.entry, path, name);
  Shape shape(dims);
  for (size_t d = 0; d < dims; ++d) shape[d] = end[d] - begin[d];
  Tensor raw = Tensor::Empty(shape, loc.entry.dtype);
  if (raw.nbytes() == 0) return StoredToFloat32(raw, loc.entry.float16);
  const int64_t element = raw.nbytes() / raw.numel();
  // The run: the box's extent in the last dimension that is not whole, times the whole ones
  // after it; one read per combination of the indices before it.
  size_t split = dims;  // dimensions [split, dims) are whole
  while (split > 0 && begin[split - 1] == 0 && end[split - 1] == full[split - 1]) --split;
  int64_t run = 1, stride = 1;  // elements of one run; elements per index of dim split - 1
  for (size_t d = split; d < dims; ++d) run *= full[d];
  const size_t outer = split == 0 ? 0 : split - 1;  // the dimension the run starts in
  if (split > 0) {
    stride = run;
    run *= shape[outer];
  }
  RandomAccessFile file(path);
  auto* out = static_cast<std::byte*>(raw.raw());
  std::vector<int64_t> index(begin.begin(), begin.begin() + static_cast<int64_t>(outer));
  const int64_t runs = raw.numel() / run;
  for (int64_t k = 0; k < runs; ++k) {
    // The element offset of (index..., begin[outer], 0...) in the stored tensor.
    int64_t offset = 0;
    for (size_t d = 0; d < outer; ++d) offset = offset * full[d] + index[d];
    if (split > 0) offset = offset * full[outer] + begin[outer];
    offset *= stride;
    const auto bytes = static_cast<size_t>(run * element);
    file.ReadAt(loc.data_start + loc.entry.data_begin + static_cast<uint64_t>(offset * element),
                {out + k * run * element, bytes});
    *bytes_read_ += bytes;
    for (size_t d = outer; d-- > 0;) {  // the next index, last dimension fastest
      if (++index[d] < end[d]) break;
      index[d] = begin[d];
    }
  }
  return StoredToFloat32(raw, loc.entry.float16);
}

void CheckpointReader::Validate(const ModelConfig& config) const {
  std::set<std::string> expected;
  for (const TensorSpec& s : ParameterTable(config)) {
    expected.insert(s.name);
    auto it = tensors_.find(s.name);
    SY_REQUIRE(it != tensors_.end(), InvalidArgument,
               "{}: tensor '{}' (shape {}) is missing: the config ({}) needs it", dir_, s.name,
               ShapeToString(s.shape), FamilyName(config.family));
    SY_REQUIRE(it->second.entry.shape == s.shape, InvalidArgument,
               "{}/{}: tensor '{}': expected shape {} from config.json, got {}", dir_,
               it->second.file, s.name, ShapeToString(s.shape),
               ShapeToString(it->second.entry.shape));
  }
  for (const auto& [name, loc] : tensors_) {
    SY_REQUIRE(expected.count(name) > 0 || IsRotaryBuffer(name), InvalidArgument,
               "{}/{}: tensor '{}' is not a parameter of a {} model with this config.json", dir_,
               loc.file, name, FamilyName(config.family));
  }
}

// ---- writing ----

CheckpointWriter::CheckpointWriter(std::string dir, WriterOptions options)
    : dir_(std::move(dir)), options_(options) {
  SY_REQUIRE(options_.max_shard_bytes > 0, InvalidArgument,
             "max shard size: expected a positive number of bytes, got 0");
  SY_REQUIRE(options_.dtype == DType::kFloat32 || options_.dtype == DType::kBFloat16,
             InvalidArgument, "Hugging Face export dtype: expected float32 or bfloat16, got {}",
             DTypeName(options_.dtype));
  SY_REQUIRE(fs::is_directory(dir_), IoError, "{}: not a directory", dir_);
}

CheckpointWriter::~CheckpointWriter() {
  if (finished_) return;
  for (const std::string& f : temp_files_) {
    std::error_code ec;
    fs::remove(f, ec);  // best effort: nothing else may throw from a destructor
  }
}

void CheckpointWriter::Add(const std::string& name, const Tensor& tensor) {
  SY_REQUIRE(!finished_, InvalidArgument, "Hugging Face writer: Add after Finish ('{}')", name);
  SY_REQUIRE(tensor.defined(), InvalidArgument, "Hugging Face writer: tensor '{}' is undefined",
             name);
  SY_REQUIRE(names_.insert(name).second, InvalidArgument,
             "Hugging Face writer: tensor '{}' given twice", name);
  Tensor t = options_.dtype == DType::kBFloat16 ? ToBFloat16(tensor, 1) : ToFloat32(tensor, 1);
  const uint64_t bytes = static_cast<uint64_t>(t.nbytes());
  if (!pending_.empty() && pending_bytes_ + bytes > options_.max_shard_bytes) Flush();
  pending_.emplace(name, std::move(t));
  pending_bytes_ += bytes;
  total_bytes_ += bytes;
}

void CheckpointWriter::Flush() {
  if (pending_.empty()) return;
  const std::string temp =
      fmt::format("{}/.sy-shard-{}-{}.safetensors.tmp", dir_, temp_files_.size() + 1, getpid());
  temp_files_.push_back(temp);  // before writing: the destructor removes it whatever happens
  WriteSafetensors(temp, pending_, {{"format", "pt"}});
  std::vector<std::string> names;
  for (const auto& [name, t] : pending_) names.push_back(name);
  shard_names_.push_back(std::move(names));
  pending_.clear();
  pending_bytes_ = 0;
}

std::vector<std::string> CheckpointWriter::Finish() {
  SY_REQUIRE(!finished_, InvalidArgument, "Hugging Face writer: Finish called twice");
  Flush();
  SY_REQUIRE(!temp_files_.empty(), InvalidArgument, "Hugging Face writer: no tensors to write");
  std::vector<std::string> files;
  std::error_code ec;
  const size_t n = temp_files_.size();
  if (n == 1) {
    Rename(temp_files_[0], dir_ + "/" + kSingleFile);
    fs::remove(dir_ + "/" + kIndexFile, ec);  // a stale index would shadow nothing, but mislead
    files.push_back(kSingleFile);
  } else {
    Json map = Json::object();
    for (size_t i = 0; i < n; ++i) {
      const std::string name = ShardName(i, n);
      Rename(temp_files_[i], dir_ + "/" + name);
      for (const std::string& t : shard_names_[i]) map[t] = name;
      files.push_back(name);
    }
    Json index = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", map}};
    WriteTextFileAtomic(dir_ + "/" + kIndexFile, index.dump(2) + "\n");
    // Hugging Face reads model.safetensors before the index: a stale one would shadow the shards.
    fs::remove(dir_ + "/" + kSingleFile, ec);
    files.push_back(kIndexFile);
  }
  finished_ = true;
  return files;
}

}  // namespace switchyard::train::hf
