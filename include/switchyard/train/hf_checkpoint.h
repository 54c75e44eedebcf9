// The Hugging Face model format, part 2: the weights of a model directory, in safetensors files.
//
// Reading: DIR/model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map":
// {name: file}}) names the shard of every tensor; without an index DIR/model.safetensors holds them
// all (Hugging Face looks for the single file first; so does CheckpointReader). Only headers are
// read when the reader opens; ReadFloat32 reads one tensor (streaming: a model is never held in
// memory at once) and converts BF16 and F16 to float32. Errors name the file and the tensor: an
// index naming a missing or ill-named file, a tensor the index maps to a file that lacks it, a
// missing or mis-shaped tensor (IoError for files, InvalidArgument for tensors that do not fit the
// config).
//
// Writing: CheckpointWriter takes tensors one at a time and writes a shard each time the next
// tensor would take the shard above max_shard_bytes (Hugging Face's rule; a larger tensor gets a
// shard of its own), so at most one shard is held in memory. Shards are written under temporary
// names and renamed by Finish to model-0000i-of-0000N.safetensors plus the index (or
// model.safetensors alone when one shard suffices); the index is written last, so a reader never
// sees an index naming shards not yet there. A writer destroyed before Finish removes what it
// wrote.
//
// Thread-safety: a reader may be shared by threads (its reads are const); a writer is used by one.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "switchyard/core/safetensors.h"
#include "switchyard/core/tensor.h"
#include "switchyard/train/hf_config.h"

namespace switchyard::train::hf {

inline constexpr const char* kSingleFile = "model.safetensors";
inline constexpr const char* kIndexFile = "model.safetensors.index.json";

class CheckpointReader {
 public:
  // Opens DIR (headers only). IoError when neither file is there, the index is malformed, or it
  // names a file that is missing, outside DIR or lacking a tensor it maps there.
  explicit CheckpointReader(std::string dir);

  const std::string& dir() const { return dir_; }
  // Sorted tensor names.
  std::vector<std::string> Names() const;
  bool Contains(const std::string& name) const { return tensors_.count(name) > 0; }
  // The file (relative to DIR) holding `name`; IoError naming DIR and the tensor if none does.
  const std::string& FileOf(const std::string& name) const;
  // The tensor's shape as stored.
  const Shape& ShapeOf(const std::string& name) const;
  // The tensor as float32 (F32 read, BF16 and F16 converted). InvalidArgument naming the file,
  // the tensor and both shapes when its shape is not `expected`; IoError when it is missing or
  // its dtype is not a floating-point one.
  Tensor ReadFloat32(const std::string& name, const Shape& expected) const;
  // The box [begin[d], end[d]) of each dimension d of the stored tensor `name`, as float32 of
  // shape [end[d] - begin[d], ...]: only those bytes are read, one read per contiguous run (a
  // range of rows is one read; a range of columns one read per row). InvalidArgument naming the
  // file and the tensor for a box outside its shape; IoError as ReadFloat32.
  Tensor ReadBox(const std::string& name, const std::vector<int64_t>& begin,
                 const std::vector<int64_t>& end) const;
  // Bytes of tensor data read by ReadFloat32 and ReadBox since the reader opened (every copy of
  // the reader counts into the same total; thread-safe).
  uint64_t bytes_read() const { return bytes_read_->load(); }

  // Every tensor of ParameterTable(config) is present with its shape, and no other tensor is
  // there (Hugging Face's non-persistent rotary buffers, "*.rotary_emb.inv_freq", excepted).
  // Reads headers only. InvalidArgument naming the file and the first wrong tensor.
  void Validate(const ModelConfig& config) const;

 private:
  struct Location {
    std::string file;  // relative to dir_
    SafetensorsEntry entry;
    uint64_t data_start = 0;
  };
  const Location& Find(const std::string& name) const;

  std::string dir_;
  std::map<std::string, Location> tensors_;
  std::shared_ptr<std::atomic<uint64_t>> bytes_read_ = std::make_shared<std::atomic<uint64_t>>(0);
};

struct WriterOptions {
  uint64_t max_shard_bytes = 5'000'000'000;  // Hugging Face's default "5GB"
  DType dtype = DType::kFloat32;             // kFloat32 or kBFloat16 (written as F32 / BF16)
};

class CheckpointWriter {
 public:
  // DIR must exist. InvalidArgument for max_shard_bytes = 0 or another dtype.
  CheckpointWriter(std::string dir, WriterOptions options = {});
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Adds one tensor (float32 or bfloat16; converted to the options' dtype). InvalidArgument for
  // a name given twice or an undefined tensor.
  void Add(const std::string& name, const Tensor& tensor);
  // Writes what is left, renames the shards and writes the index. Returns the files written
  // (relative to DIR), in order.
  std::vector<std::string> Finish();

 private:
  void Flush();

  std::string dir_;
  WriterOptions options_;
  TensorMap pending_;
  std::set<std::string> names_;  // every tensor added
  uint64_t pending_bytes_ = 0;
  uint64_t total_bytes_ = 0;
  std::vector<std::string> temp_files_;                // shard i's temporary name
  std::vector<std::vector<std::string>> shard_names_;  // tensors of shard i
  bool finished_ = false;
};

// Converts IEEE half bits to float (exact).
float HalfToFloat(uint16_t bits);

}  // namespace switchyard::train::hf
