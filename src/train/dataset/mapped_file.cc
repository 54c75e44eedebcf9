#include "train/dataset/mapped_file.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train::dataset {

MappedFile::MappedFile(std::string path) : path_(std::move(path)) {
  // Core's checks (a FIFO, device, socket or directory is refused without blocking).
  const OpenedRegularFile file = OpenRegularFile(path_);
  const int fd = file.fd;
  size_ = static_cast<size_t>(file.size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw IoError(fmt::format("cannot map dataset file '{}' ({} bytes): {}", path_, size_,
                                std::strerror(err)));
    }
    data_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace switchyard::train::dataset
