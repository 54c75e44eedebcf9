#include "switchyard/train/run_dir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train {

namespace fs = std::filesystem;

bool IsRunDirectory(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kRunMarkerFile, ec)) return true;
  return fs::exists(fs::path(dir) / "config.json", ec) &&
         fs::exists(fs::path(dir) / "checkpoints" / "latest", ec);
}

RunDirectoryLock::RunDirectoryLock(const std::string& dir) {
  std::error_code ec;
  const bool exists = fs::exists(dir, ec);
  if (exists) {
    SY_REQUIRE(fs::is_directory(dir, ec), InvalidArgument,
               "run directory '{}' exists and is not a directory: choose another 'out'", dir);
    SY_REQUIRE(fs::is_empty(dir, ec) || IsRunDirectory(dir), InvalidArgument,
               "'{}' is not empty and is not a switchyard run directory (it has no {} marker): "
               "its files would be replaced; choose a new or empty 'out'",
               dir, kRunMarkerFile);
  }
  fs::create_directories(dir, ec);
  SY_REQUIRE(!ec, IoError, "{}: cannot create run directory: {}", dir, ec.message());
  const std::string lock = (fs::path(dir) / kRunLockFile).string();
  fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  SY_REQUIRE(fd_ >= 0, IoError, "{}: cannot open: {}", lock, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof(buf) - 1, 0);
    std::string owner = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    while (!owner.empty() && (owner.back() == '\n' || owner.back() == ' ')) owner.pop_back();
    ::close(fd_);
    fd_ = -1;
    SY_REQUIRE(err != EWOULDBLOCK, InvalidArgument,
               "run directory '{}' is in use by another switchyard run (pid {}): wait for it to "
               "end, or choose another 'out'",
               dir, owner.empty() ? "unknown" : owner);
    throw IoError(fmt::format("{}: cannot lock: {}", lock, std::strerror(err)));
  }
  const std::string pid = fmt::format("{}\n", ::getpid());
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw IoError(fmt::format("{}: cannot write: {}", lock, std::strerror(err)));
  }
  const std::string marker = (fs::path(dir) / kRunMarkerFile).string();
  if (!fs::exists(marker, ec)) {
    WriteTextFileAtomic(marker, "{\"program\": \"switchyard\", \"what\": \"run directory\"}\n");
  }
}

RunDirectoryLock::~RunDirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

RunDirectoryLock::RunDirectoryLock(RunDirectoryLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)) {}

RunDirectoryLock& RunDirectoryLock::operator=(RunDirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

}  // namespace switchyard::train
