// A read-only memory mapping of a whole file, for the dataset readers: the pages are read on
// first touch, so opening a 20 GB dataset costs no memory and no time beyond its header.
//
// Only regular files are accepted: the file is opened with O_NONBLOCK (so that a FIFO cannot
// block the open waiting for a writer) and then refused by fstat when it is a FIFO, device,
// socket or directory. (core/file_util is getting a shared helper for this check; this one is
// local until then.)
// Thread-safety: immutable after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace switchyard::train::dataset {

class MappedFile {
 public:
  // Throws IoError naming `path` when it is missing, unreadable, not a regular file or cannot be
  // mapped. An empty file maps to an empty span.
  explicit MappedFile(std::string path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace switchyard::train::dataset
