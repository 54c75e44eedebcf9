#include "switchyard/core/file_util.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "switchyard/core/error.h"
#include "switchyard/core/limits.h"

namespace switchyard {
namespace {

std::string SystemError(int err) { return std::strerror(err); }

// Directory part of `path` ("." when there is none), for the temporary file and the dir fsync.
std::string DirName(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string BaseName(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Makes the rename durable. Failure to open the directory (e.g. no read permission) is not an
// error: the data is already on disk, only the name may be lost in a power cut.
void SyncDirectory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Follows symbolic links from `path` (a chain of them, also a dangling one) to the path of the
// file they finally name, which need not exist.
std::string FollowLinks(const std::string& path) {
  std::string current = path;
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st {};
    if (::lstat(current.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return current;
    std::string target(PATH_MAX, '\0');
    ssize_t n = ::readlink(current.c_str(), target.data(), target.size());
    if (n < 0) {
      int err = errno;
      throw IoError(fmt::format("cannot write '{}': reading the symbolic link '{}' failed: {}",
                                path, current, SystemError(err)));
    }
    target.resize(static_cast<size_t>(n));
    current = !target.empty() && target[0] == '/' ? target : DirName(current) + "/" + target;
  }
  throw IoError(fmt::format("cannot write '{}': too many levels of symbolic links", path));
}

std::string_view KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// The limit RLIMIT_FSIZE puts on the size of a file this process writes (`ulimit -f 0` is a limit
// of 0 bytes); the largest uint64 when there is none.
uint64_t FileSizeLimit() {
  struct rlimit r {};
  if (::getrlimit(RLIMIT_FSIZE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) {
    return std::numeric_limits<uint64_t>::max();
  }
  return static_cast<uint64_t>(r.rlim_cur);
}

[[noreturn]] void ThrowFileSizeLimit(const std::string& path, uint64_t needed) {
  uint64_t limit = FileSizeLimit();
  throw IoError(fmt::format(
      "file size limit reached writing '{}': the file needs at least {} bytes but the limit "
      "(RLIMIT_FSIZE, ulimit -f) is {} bytes; the temporary file was removed and '{}' is "
      "unchanged",
      path, needed, limit, path));
}

// Opens `path` for reading if it is a regular file; `st` receives its stat. Everything else is
// refused before a read could block or never end: opening a FIFO (named pipe) waits for a writer,
// and reading one, or a character device such as /dev/zero, waits for data or never reaches an
// end. So the file is opened with O_NONBLOCK (open returns at once even for a FIFO), checked with
// fstat on the descriptor (no race with the path being swapped), and only a regular file is set
// back to blocking reads. Every reader of this file (ReadFileBytes, ReadTextFile,
// RandomAccessFile) opens its input here.
int OpenRegularFileForReading(const std::string& path, struct stat* st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    struct stat any {};
    // A socket cannot be opened at all (ENXIO): say what it is rather than "No such device".
    if (::stat(path.c_str(), &any) == 0 && !S_ISREG(any.st_mode) && !S_ISDIR(any.st_mode)) {
      throw IoError(fmt::format(
          "cannot read '{}': it is {}, not a regular file; switchyard reads its inputs only from "
          "regular files",
          path, KindOf(any.st_mode)));
    }
    throw IoError(fmt::format("cannot read '{}': {}", path, SystemError(err)));
  }
  std::string problem;
  if (::fstat(fd, st) != 0) {
    problem = SystemError(errno);
  } else if (!S_ISREG(st->st_mode)) {
    problem = fmt::format(
        "it is {}, not a regular file; switchyard reads its inputs only from regular files",
        KindOf(st->st_mode));
  } else {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) problem = SystemError(errno);
  }
  if (!problem.empty()) {
    ::close(fd);
    throw IoError(fmt::format("cannot read '{}': {}", path, problem));
  }
  return fd;
}

class FileCloser {
 public:
  explicit FileCloser(int fd) : fd_(fd) {}
  ~FileCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileCloser(const FileCloser&) = delete;
  FileCloser& operator=(const FileCloser&) = delete;

 private:
  int fd_;
};

// The checks of an output path (file_util.h, "What an output path may name"): returns the path of
// the file to create or replace (symbolic links followed) and whether it exists (then `existing`
// holds its stat), or throws IoError.
std::string ResolveOutputPath(const std::string& path, struct stat* existing, bool* exists) {
  SY_REQUIRE(!path.empty(), IoError, "cannot write a file with an empty path");
  SY_REQUIRE(path.back() != '/', IoError, "cannot write '{}': the path names a directory", path);
  std::string target = FollowLinks(path);
  const std::string via =
      target == path ? "" : fmt::format(" (the target of the symbolic link, '{}')", target);
  *exists = ::stat(target.c_str(), existing) == 0;
  if (*exists && S_ISDIR(existing->st_mode)) {
    throw IoError(fmt::format("cannot write '{}': a directory is in the way{}", path, via));
  }
  if (*exists && !S_ISREG(existing->st_mode)) {
    throw IoError(
        fmt::format("cannot write '{}': it is {}{}; switchyard writes only regular files, so "
                    "nothing was written (give the path of a file)",
                    path, KindOf(existing->st_mode), via));
  }
  if (!*exists) {
    const std::string dir = DirName(target);
    struct stat dir_st {};
    if (::stat(dir.c_str(), &dir_st) != 0) {
      int err = errno;
      throw IoError(fmt::format("cannot write '{}': its directory '{}' cannot be used: {}", path,
                                dir, SystemError(err)));
    }
    SY_REQUIRE(S_ISDIR(dir_st.st_mode), IoError, "cannot write '{}': '{}' is not a directory", path,
               dir);
  }
  return target;
}

}  // namespace

void CheckOutputPath(const std::string& path) {
  struct stat existing {};
  bool exists = false;
  ResolveOutputPath(path, &existing, &exists);
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  struct stat existing {};
  bool exists = false;
  target_ = ResolveOutputPath(path_, &existing, &exists);
  const std::string dir = DirName(target_);
  const std::string base = BaseName(target_);
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    temp_path_ = fmt::format("{}/.{}.tmp.{}.{}", dir, base, ::getpid(), counter.fetch_add(1));
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0 || errno != EEXIST) break;
  }
  if (fd_ < 0) {
    int err = errno;
    throw IoError(fmt::format("cannot write '{}': creating temporary file '{}' failed: {}", path_,
                              temp_path_, SystemError(err)));
  }
  // A replaced file keeps its permission bits (best effort: a failure here is not an error).
  if (exists) ::fchmod(fd_, existing.st_mode & 07777);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) Abort();
}

void AtomicFileWriter::Abort() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!temp_path_.empty()) {
    ::unlink(temp_path_.c_str());
    temp_path_.clear();
  }
}

void AtomicFileWriter::Append(std::span<const std::byte> bytes) {
  SY_REQUIRE(fd_ >= 0 && !committed_, IoError,
             "cannot write '{}': the writer was already committed or failed", path_);
  // Refused before writing past a file size limit: write() would raise SIGXFSZ, which kills a
  // process that does not ignore it.
  if (size_ + bytes.size() > FileSizeLimit()) {
    Abort();
    ThrowFileSizeLimit(path_, size_ + bytes.size());
  }
  const std::byte* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd_, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      Abort();
      if (err == EFBIG) ThrowFileSizeLimit(path_, size_ + left);
      throw IoError(fmt::format("cannot write '{}': write failed after {} bytes: {}", path_, size_,
                                SystemError(err)));
    }
    p += n;
    left -= static_cast<size_t>(n);
    size_ += static_cast<size_t>(n);
  }
}

void AtomicFileWriter::Append(std::string_view text) {
  Append(std::as_bytes(std::span<const char>(text.data(), text.size())));
}

void AtomicFileWriter::Commit() {
  SY_REQUIRE(fd_ >= 0 && !committed_, IoError,
             "cannot write '{}': the writer was already committed or failed", path_);
  if (::fsync(fd_) != 0) {
    int err = errno;
    Abort();
    throw IoError(fmt::format("cannot write '{}': fsync failed: {}", path_, SystemError(err)));
  }
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    int err = errno;
    Abort();
    throw IoError(fmt::format("cannot write '{}': close failed: {}", path_, SystemError(err)));
  }
  if (::rename(temp_path_.c_str(), target_.c_str()) != 0) {
    int err = errno;
    Abort();
    throw IoError(
        fmt::format("cannot write '{}': renaming the temporary file into place failed: {}", path_,
                    SystemError(err)));
  }
  temp_path_.clear();
  committed_ = true;
  SyncDirectory(DirName(target_));
}

OpenedRegularFile OpenRegularFile(const std::string& path) {
  struct stat st {};
  const int fd = OpenRegularFileForReading(path, &st);
  return {fd, static_cast<uint64_t>(st.st_size)};
}

RandomAccessFile::RandomAccessFile(std::string path) : path_(std::move(path)) {
  struct stat st {};
  fd_ = OpenRegularFileForReading(path_, &st);
  size_ = static_cast<uint64_t>(st.st_size);
}

RandomAccessFile::~RandomAccessFile() {
  if (fd_ >= 0) ::close(fd_);
}

void RandomAccessFile::ReadAt(uint64_t offset, std::span<std::byte> out) const {
  SY_REQUIRE(offset <= size_ && out.size() <= size_ - offset, IoError,
             "cannot read '{}': bytes [{}, {}) lie beyond the end of the file ({} bytes)", path_,
             offset, offset + out.size(), size_);
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n =
        ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw IoError(
          fmt::format("cannot read '{}' at offset {}: {}", path_, offset + done, SystemError(err)));
    }
    SY_REQUIRE(n > 0, IoError, "cannot read '{}': the file shrank to {} bytes while being read",
               path_, offset + done);
    done += static_cast<size_t>(n);
  }
}

void WriteFileAtomic(const std::string& path, std::span<const std::byte> bytes) {
  AtomicFileWriter writer(path);
  writer.Append(bytes);
  writer.Commit();
}

void WriteTextFileAtomic(const std::string& path, std::string_view text) {
  AtomicFileWriter writer(path);
  writer.Append(text);
  writer.Commit();
}

void RequireDistinctOutput(const NamedPath& output, std::initializer_list<NamedPath> inputs) {
  if (output.path.empty()) return;
  struct stat out {};
  const bool out_exists = ::stat(output.path.c_str(), &out) == 0;
  // For paths that do not exist (yet): the same path once "." / ".." and links are resolved.
  auto canonical = [](const std::string& p) {
    std::error_code ec;
    auto c = std::filesystem::weakly_canonical(std::filesystem::absolute(p, ec), ec);
    return ec ? std::filesystem::path(p).lexically_normal() : c;
  };
  for (const NamedPath& in : inputs) {
    if (in.path.empty()) continue;
    struct stat st {};
    const bool in_exists = ::stat(in.path.c_str(), &st) == 0;
    const bool same = out_exists && in_exists ? st.st_dev == out.st_dev && st.st_ino == out.st_ino
                                              : canonical(in.path) == canonical(output.path);
    SY_REQUIRE(!same, InvalidArgument,
               "{} '{}' names the same file as {} '{}': refusing to overwrite it (give the output "
               "another path)",
               output.what, output.path, in.what, in.path);
  }
}

std::vector<std::byte> ReadFileBytes(const std::string& path) {
  struct stat st {};
  const int fd = OpenRegularFileForReading(path, &st);
  FileCloser closer(fd);
  RequireMemory(static_cast<uint64_t>(st.st_size), fmt::format("reading the whole of '{}'", path));
  std::vector<std::byte> bytes(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw IoError(fmt::format("cannot read '{}': {}", path, SystemError(err)));
    }
    if (n == 0) break;  // the file shrank while we read it
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

std::string ReadTextFile(const std::string& path) {
  std::vector<std::byte> bytes = ReadFileBytes(path);
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

}  // namespace switchyard
