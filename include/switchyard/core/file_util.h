// Whole-file reads and crash-safe (atomic) writes.
//
// An atomic write goes to a temporary file in the destination's directory, is flushed to disk
// (fsync), and is then renamed over the destination, after which the directory is fsynced too.
// Readers therefore see either the old file or the complete new one, never a torn mix; when a
// write fails (disk full, permission, a directory in the way, an exception while producing the
// contents) the temporary file is removed and the old file is left exactly as it was.
//
// Errors: every failure throws IoError naming the path, the operation and the system's reason.
// Thread-safety: the functions are safe to call concurrently on different paths. Concurrent
// atomic writes to the same path are safe too (each uses its own temporary file); the last
// rename wins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace switchyard {

// What an output path may name (docs/formats.md, "Output paths"):
//   missing            a new regular file is created (its directory must exist)
//   regular file       replaced atomically; it keeps its permission bits
//   symbolic link      followed (also a chain of links, also a dangling one): the file the link
//                      points to is created or replaced atomically; the link stays a link
//   directory, FIFO, character or block device, socket
//                      refused with IoError; nothing is written and nothing is changed
// A file size limit (RLIMIT_FSIZE, `ulimit -f`) that the contents would exceed is an IoError
// ("file size limit reached writing ...") raised before writing past the limit, so the process
// gets no SIGXFSZ from these writers; the temporary file is removed.

// Replaces (or creates) `path` with `bytes`, atomically as described above. New files get mode
// 0666 minus the process umask, as an ordinary open(O_CREAT) would; a replaced file keeps its
// permission bits.
void WriteFileAtomic(const std::string& path, std::span<const std::byte> bytes);
// Text convenience form of WriteFileAtomic (e.g. JSON).
void WriteTextFileAtomic(const std::string& path, std::string_view text);

// The whole contents of a regular file. Throws IoError if it is missing, a directory, or
// unreadable.
std::vector<std::byte> ReadFileBytes(const std::string& path);
// The whole contents of a regular file as text (no decoding).
std::string ReadTextFile(const std::string& path);

// A read-only descriptor of `path` and its size, for readers that map or stream the file
// themselves; the caller closes `fd`. The checks of ReadFileBytes, made without blocking: IoError
// naming what the path is when it is not a regular file (a FIFO, device, socket, directory).
struct OpenedRegularFile {
  int fd = -1;
  uint64_t size = 0;
};
OpenedRegularFile OpenRegularFile(const std::string& path);

// Throws the IoError an atomic write to `path` would throw for the kind of path it is (a
// directory, FIFO, device or socket, also behind symbolic links; a missing or non-directory
// parent), without creating anything: lets a command refuse a bad output path before it does its
// work rather than after.
void CheckOutputPath(const std::string& path);

// A path given for an output or an input, with the name the user knows it by (a flag such as
// "--out", or "layer.json"), for messages.
struct NamedPath {
  std::string_view what;
  std::string path;
};

// Throws InvalidArgument when `output` names the same file as one of `inputs`: compared by file
// identity (device and inode, after following symbolic links), so "x", "./x", "dir/../x", a
// symbolic link to x and a hard link to x all count as x. Inputs with an empty path, and an
// output that does not exist yet, never match. Call it before writing any output of a command
// that reads inputs, so that a mistyped path never overwrites an input.
void RequireDistinctOutput(const NamedPath& output, std::initializer_list<NamedPath> inputs);

// A file opened for reading at arbitrary offsets (pread), for formats whose header says where
// the data lies. Thread-safe: ReadAt may be called from several threads at once.
class RandomAccessFile {
 public:
  // Opens a regular file; throws IoError if it is missing, a directory, or unreadable.
  explicit RandomAccessFile(std::string path);
  ~RandomAccessFile();
  RandomAccessFile(const RandomAccessFile&) = delete;
  RandomAccessFile& operator=(const RandomAccessFile&) = delete;

  // Size in bytes when opened.
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Fills `out` with the bytes at [offset, offset + out.size()). Throws IoError if the range
  // extends past the end of the file or the read fails.
  void ReadAt(uint64_t offset, std::span<std::byte> out) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Streaming form of WriteFileAtomic, for contents too large to build in memory first:
//   AtomicFileWriter w(path);   // creates the temporary file
//   w.Append(header); w.Append(data);
//   w.Commit();                 // fsync + rename; the new contents become visible
// Destroying the writer without Commit() (e.g. during an exception) removes the temporary file
// and leaves `path` untouched. Not thread-safe: one writer belongs to one thread at a time.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends bytes to the temporary file. Throws IoError (and the writer is then unusable).
  void Append(std::span<const std::byte> bytes);
  void Append(std::string_view text);
  // Flushes, fsyncs and renames the temporary file over the destination. At most once.
  void Commit();

  const std::string& path() const { return path_; }
  // Bytes appended so far.
  size_t size() const { return size_; }

 private:
  void Abort() noexcept;

  std::string path_;
  std::string target_;  // path_ with symbolic links followed: the file that is replaced
  std::string temp_path_;
  int fd_ = -1;
  size_t size_ = 0;
  bool committed_ = false;
};

}  // namespace switchyard
