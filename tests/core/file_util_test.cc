#include "switchyard/core/file_util.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/temp_dir.h"
#include "switchyard/core/error.h"

namespace switchyard {
namespace {

using ::switchyard::testing::TempDir;

std::vector<std::byte> Bytes(std::string_view s) {
  auto b = std::as_bytes(std::span<const char>(s.data(), s.size()));
  return {b.begin(), b.end()};
}

// Runs `fn` and returns the IoError message it throws ("" if it throws nothing).
template <typename Fn>
std::string IoErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

TEST(FileUtil, WriteCreatesAndReplaces) {
  TempDir dir;
  std::string path = dir.File("a.bin");
  WriteFileAtomic(path, Bytes("first contents"));
  EXPECT_EQ(ReadTextFile(path), "first contents");
  WriteFileAtomic(path, Bytes("second"));
  EXPECT_EQ(ReadFileBytes(path), Bytes("second"));
  WriteTextFileAtomic(path, "");
  EXPECT_TRUE(ReadFileBytes(path).empty());
  EXPECT_EQ(dir.List(), std::vector<std::string>{"a.bin"});  // no temporary file left
}

TEST(FileUtil, RelativePathInCurrentDirectory) {
  TempDir dir;
  auto old_cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  WriteTextFileAtomic("rel.txt", "x");
  EXPECT_EQ(ReadTextFile("rel.txt"), "x");
  std::filesystem::current_path(old_cwd);
  EXPECT_EQ(dir.List(), std::vector<std::string>{"rel.txt"});
}

TEST(FileUtil, NewFileModeFollowsUmask) {
  TempDir dir;
  mode_t old = ::umask(022);
  WriteTextFileAtomic(dir.File("m"), "x");
  ::umask(old);
  struct stat st;
  ASSERT_EQ(::stat(dir.File("m").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  // Replacing keeps the existing permission bits.
  ASSERT_EQ(::chmod(dir.File("m").c_str(), 0600), 0);
  WriteTextFileAtomic(dir.File("m"), "y");
  ASSERT_EQ(::stat(dir.File("m").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ReadTextFile(dir.File("m")), "y");
}

TEST(FileUtil, ReadErrorsNameThePath) {
  TempDir dir;
  std::string missing = dir.File("missing.bin");
  std::string msg = IoErrorOf([&] { ReadFileBytes(missing); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
  msg = IoErrorOf([&] { ReadFileBytes(dir.path()); });
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
  msg = IoErrorOf([&] { RandomAccessFile f(dir.path()); });
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
}

TEST(FileUtil, DirectoryInTheWayLeavesItIntact) {
  TempDir dir;
  std::string path = dir.File("d");
  std::filesystem::create_directory(path);
  WriteTextFileAtomic(path + "/inside", "keep");
  std::string msg = IoErrorOf([&] { WriteTextFileAtomic(path, "new"); });
  EXPECT_NE(msg.find("directory is in the way"), std::string::npos) << msg;
  EXPECT_EQ(ReadTextFile(path + "/inside"), "keep");
  EXPECT_EQ(dir.List(), std::vector<std::string>{"d"});
}

TEST(FileUtil, MissingParentDirectory) {
  TempDir dir;
  std::string path = dir.File("no/such/dir/f.bin");
  std::string msg = IoErrorOf([&] { WriteTextFileAtomic(path, "x"); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
}

TEST(FileUtil, FailureMidWriteKeepsTheOldFile) {
  // A file size limit makes write() fail with EFBIG part way through (this works as root too,
  // unlike a read-only directory).
  TempDir dir;
  std::string path = dir.File("old.bin");
  WriteTextFileAtomic(path, "the old contents");
  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string big(100000, 'n');
  std::string msg = IoErrorOf([&] { WriteTextFileAtomic(path, big); });
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("write failed after 4096 bytes"), std::string::npos) << msg;
  EXPECT_EQ(ReadTextFile(path), "the old contents");
  EXPECT_EQ(dir.List(), std::vector<std::string>{"old.bin"});
}

TEST(FileUtil, AbandonedWriterLeavesNothing) {
  TempDir dir;
  std::string path = dir.File("a.bin");
  WriteTextFileAtomic(path, "old");
  {
    AtomicFileWriter w(path);
    w.Append(std::string_view("partial new contents"));
    EXPECT_EQ(w.size(), 20u);
    EXPECT_EQ(dir.List().size(), 2u);  // the temporary file exists beside the destination
    EXPECT_EQ(ReadTextFile(path), "old");
  }
  EXPECT_EQ(ReadTextFile(path), "old");
  EXPECT_EQ(dir.List(), std::vector<std::string>{"a.bin"});
}

TEST(FileUtil, WriterCannotCommitTwice) {
  TempDir dir;
  AtomicFileWriter w(dir.File("x"));
  w.Append(std::string_view("abc"));
  w.Commit();
  EXPECT_THROW(w.Commit(), IoError);
  EXPECT_THROW(w.Append(std::string_view("more")), IoError);
  EXPECT_EQ(ReadTextFile(dir.File("x")), "abc");
}

TEST(FileUtil, ConcurrentWritersToOnePathNeverTear) {
  TempDir dir;
  std::string path = dir.File("shared.bin");
  constexpr int kThreads = 4;
  constexpr int kRounds = 10;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::string contents(10000 + t, static_cast<char>('a' + t));
      for (int r = 0; r < kRounds; ++r) WriteTextFileAtomic(path, contents);
    });
  }
  for (auto& th : threads) th.join();
  std::string final_contents = ReadTextFile(path);
  ASSERT_GE(final_contents.size(), 10000u);
  int t = static_cast<int>(final_contents.size()) - 10000;
  ASSERT_LT(t, kThreads);
  EXPECT_EQ(final_contents, std::string(10000 + t, static_cast<char>('a' + t)));
  EXPECT_EQ(dir.List(), std::vector<std::string>{"shared.bin"});
}

TEST(FileUtil, RandomAccessReads) {
  TempDir dir;
  std::string path = dir.File("r.bin");
  WriteTextFileAtomic(path, "0123456789");
  RandomAccessFile f(path);
  EXPECT_EQ(f.size(), 10u);
  std::vector<std::byte> out(4);
  f.ReadAt(3, out);
  EXPECT_EQ(out, Bytes("3456"));
  f.ReadAt(6, out);
  EXPECT_EQ(out, Bytes("6789"));
  std::vector<std::byte> none;
  f.ReadAt(10, none);
  std::string msg = IoErrorOf([&] { f.ReadAt(7, out); });
  EXPECT_NE(msg.find("beyond the end of the file (10 bytes)"), std::string::npos) << msg;
  EXPECT_THROW(f.ReadAt(~uint64_t{0}, out), IoError);
}

}  // namespace
}  // namespace switchyard
