#include "switchyard/core/file_util.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
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

// Runs `read` on a thread and returns its IoError message; a read that blocks for 20 s is a
// failure (it used to block for ever in open(2)), and a writer is then opened on `fifo` so that
// the blocked reader sees the end of its input and the test ends.
std::string IoErrorWithin20s(const std::string& fifo, std::function<void()> read) {
  auto done = std::make_shared<std::promise<std::string>>();
  std::future<std::string> result = done->get_future();
  std::thread([done, read = std::move(read)] { done->set_value(IoErrorOf(read)); }).detach();
  if (result.wait_for(std::chrono::seconds(20)) == std::future_status::ready) return result.get();
  ADD_FAILURE() << "reading the FIFO " << fifo << " blocked";
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) ::close(fd);
  return result.get();
}

TEST(FileUtil, InputsThatAreNotRegularFilesAreRefusedWithoutBlocking) {
  // A FIFO with no writer blocked open(2) for ever; /dev/zero never ends. Every reader refuses
  // them by what they are, naming the path, before reading a byte.
  TempDir dir;
  const std::string fifo = dir.File("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::pair<const char*, std::function<void(const std::string&)>>> readers = {
      {"ReadFileBytes", [](const std::string& p) { ReadFileBytes(p); }},
      {"ReadTextFile", [](const std::string& p) { ReadTextFile(p); }},
      {"RandomAccessFile", [](const std::string& p) { RandomAccessFile f(p); }},
  };
  for (const auto& [name, read] : readers) {
    SCOPED_TRACE(name);
    std::string msg = IoErrorWithin20s(fifo, [&, read = read] { read(fifo); });
    EXPECT_NE(msg.find("cannot read '" + fifo + "': it is a FIFO (named pipe), not a regular file"),
              std::string::npos)
        << msg;
    msg = IoErrorOf([&, read = read] { read("/dev/zero"); });
    EXPECT_NE(msg.find("cannot read '/dev/zero': it is a character device"), std::string::npos)
        << msg;
    msg = IoErrorOf([&, read = read] { read(dir.path()); });
    EXPECT_NE(msg.find("it is a directory, not a regular file"), std::string::npos) << msg;
  }
  struct stat st {};
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));  // left as it was
  // A symbolic link to the FIFO is the FIFO.
  const std::string link = dir.File("link");
  ASSERT_EQ(::symlink(fifo.c_str(), link.c_str()), 0);
  std::string msg = IoErrorWithin20s(fifo, [&] { ReadTextFile(link); });
  EXPECT_NE(msg.find("it is a FIFO (named pipe)"), std::string::npos) << msg;
  // A socket cannot even be opened (ENXIO): still named for what it is.
  const std::string socket_path = dir.File("sock");
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(socket_path.size(), sizeof(addr.sun_path));
  std::copy(socket_path.begin(), socket_path.end(), addr.sun_path);
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  msg = IoErrorOf([&] { ReadTextFile(socket_path); });
  ::close(sock);
  EXPECT_NE(msg.find("cannot read '" + socket_path + "': it is a socket, not a regular file"),
            std::string::npos)
      << msg;
  // A regular file is still read whole, and a symbolic link to one too.
  WriteTextFileAtomic(dir.File("text"), "abc");
  ASSERT_EQ(::symlink(dir.File("text").c_str(), dir.File("text-link").c_str()), 0);
  EXPECT_EQ(ReadTextFile(dir.File("text-link")), "abc");
  RandomAccessFile f(dir.File("text"));
  std::vector<std::byte> two(2);
  f.ReadAt(1, two);
  EXPECT_EQ(two, Bytes("bc"));
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
  // A file size limit stops the write part way through (this works as root too,
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
  EXPECT_NE(msg.find("file size limit reached writing '" + path + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("limit (RLIMIT_FSIZE, ulimit -f) is 4096 bytes"), std::string::npos) << msg;
  EXPECT_EQ(ReadTextFile(path), "the old contents");
  EXPECT_EQ(dir.List(), std::vector<std::string>{"old.bin"});
}

// Runs `body` in a forked child (which may change process-wide limits and signal dispositions)
// and returns its exit code; a child killed by a signal gives 128 + the signal, as a shell does.
template <typename Fn>
int InChild(Fn&& body) {
  ::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = body();
    } catch (...) {
      rc = 3;
    }
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// With the signal at its default (kill the process), as in a program that does not ignore
// SIGXFSZ, a write over the limit is an IoError and the process lives on; streaming writers too.
TEST(FileUtil, FileSizeLimitIsAnErrorNotASignal) {
  TempDir dir;
  std::string path = dir.File("old.bin");
  WriteTextFileAtomic(path, "the old contents");
  for (bool ignore_signal : {false, true}) {
    for (bool streaming : {false, true}) {
      // 0 is a limit too (`ulimit -f 0`: no file may grow at all).
      const rlim_t limit = streaming ? 8192 : 0;
      int rc = InChild([&] {
        if (ignore_signal) ::signal(SIGXFSZ, SIG_IGN);
        struct rlimit small {};
        ::getrlimit(RLIMIT_FSIZE, &small);
        small.rlim_cur = limit;
        if (::setrlimit(RLIMIT_FSIZE, &small) != 0) return 10;
        std::string msg = IoErrorOf([&] {
          if (!streaming) {
            WriteTextFileAtomic(path, std::string(100000, 'n'));
            return;
          }
          AtomicFileWriter w(path);
          for (int i = 0; i < 100; ++i) w.Append(std::string(1000, 'n'));
          w.Commit();
        });
        if (msg.find("file size limit reached writing '" + path + "'") == std::string::npos) {
          return 11;
        }
        return 0;
      });
      EXPECT_EQ(rc, 0) << "ignore_signal " << ignore_signal << " streaming " << streaming
                       << (rc == 128 + SIGXFSZ ? ": killed by SIGXFSZ" : "");
      EXPECT_EQ(ReadTextFile(path), "the old contents");
      EXPECT_EQ(dir.List(), std::vector<std::string>{"old.bin"});
    }
  }
}

TEST(FileUtil, SymlinkOutputReplacesItsTarget) {
  TempDir dir;
  std::string target = dir.File("target.bin");
  std::string link = dir.File("link.bin");
  WriteTextFileAtomic(target, "old");
  ::chmod(target.c_str(), 0600);
  std::filesystem::create_symlink("target.bin", link);  // relative, as ln -s makes them
  WriteTextFileAtomic(link, "new through the link");
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(ReadTextFile(target), "new through the link");
  struct stat st {};
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // the target keeps its permission bits
  // A chain of links, and a dangling link (its target is created, as a shell's `>` does).
  std::filesystem::create_symlink(link, dir.File("link2.bin"));
  WriteTextFileAtomic(dir.File("link2.bin"), "chain");
  EXPECT_EQ(ReadTextFile(target), "chain");
  std::filesystem::create_symlink("new.bin", dir.File("dangling.bin"));
  WriteTextFileAtomic(dir.File("dangling.bin"), "created");
  EXPECT_TRUE(std::filesystem::is_symlink(dir.File("dangling.bin")));
  EXPECT_EQ(ReadTextFile(dir.File("new.bin")), "created");
  EXPECT_EQ(dir.List(), (std::vector<std::string>{"dangling.bin", "link.bin", "link2.bin",
                                                  "new.bin", "target.bin"}));
  // A loop of links is an error.
  std::filesystem::create_symlink("loop_b", dir.File("loop_a"));
  std::filesystem::create_symlink("loop_a", dir.File("loop_b"));
  std::string msg = IoErrorOf([&] { WriteTextFileAtomic(dir.File("loop_a"), "x"); });
  EXPECT_NE(msg.find("too many levels of symbolic links"), std::string::npos) << msg;
}

TEST(FileUtil, SpecialFilesAreRefusedAndLeftAlone) {
  TempDir dir;
  std::string fifo = dir.File("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string msg = IoErrorOf([&] { WriteTextFileAtomic(fifo, "x"); });
  EXPECT_NE(msg.find("cannot write '" + fifo + "': it is a FIFO (named pipe)"), std::string::npos)
      << msg;
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  // CheckOutputPath says the same without writing anything.
  msg = IoErrorOf([&] { CheckOutputPath(fifo); });
  EXPECT_NE(msg.find("it is a FIFO (named pipe)"), std::string::npos) << msg;
  EXPECT_NO_THROW(CheckOutputPath(dir.File("new.bin")));
  EXPECT_THROW(CheckOutputPath(dir.File("no/new.bin")), IoError);
  EXPECT_THROW(CheckOutputPath(dir.path()), IoError);
  // Through a symbolic link too; the message names the target.
  std::filesystem::create_symlink("pipe", dir.File("to_pipe"));
  msg = IoErrorOf([&] { WriteTextFileAtomic(dir.File("to_pipe"), "x"); });
  EXPECT_NE(msg.find("it is a FIFO (named pipe) (the target of the symbolic link"),
            std::string::npos)
      << msg;
  EXPECT_EQ(dir.List(), (std::vector<std::string>{"pipe", "to_pipe"}));
  msg = IoErrorOf([&] { WriteTextFileAtomic("/dev/null", "x"); });
  EXPECT_NE(msg.find("it is a character device"), std::string::npos) << msg;
  struct stat st {};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  // A parent that is a file, not a directory.
  WriteTextFileAtomic(dir.File("plain"), "p");
  msg = IoErrorOf([&] { WriteTextFileAtomic(dir.File("plain/child"), "x"); });
  EXPECT_NE(msg.find("cannot write '" + dir.File("plain/child") + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'" + dir.File("plain") + "' is not a directory"), std::string::npos) << msg;
}

std::string InvalidArgumentOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(FileUtil, RequireDistinctOutputComparesFiles) {
  TempDir dir;
  std::string a = dir.File("a.bin");
  WriteTextFileAtomic(a, "a");
  WriteTextFileAtomic(dir.File("b.bin"), "b");
  std::filesystem::create_directory(dir.File("sub"));
  std::filesystem::create_symlink(a, dir.File("link.bin"));
  std::filesystem::create_hard_link(a, dir.File("hard.bin"));
  for (const std::string& same :
       {a, dir.path() + "/./a.bin", dir.path() + "/sub/../a.bin", dir.File("link.bin"),
        dir.File("hard.bin"), dir.path() + "//a.bin"}) {
    std::string msg = InvalidArgumentOf([&] {
      RequireDistinctOutput({"--out", same}, {{"--config", dir.File("b.bin")}, {"--tensors", a}});
    });
    EXPECT_NE(msg.find("--out '" + same + "' names the same file as --tensors '" + a + "'"),
              std::string::npos)
        << same << ": " << msg;
  }
  // Relative spellings from the current directory.
  auto old_cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  EXPECT_THROW(RequireDistinctOutput({"--out", "./a.bin"}, {{"--tensors", "a.bin"}}),
               InvalidArgument);
  // Two outputs that do not exist yet but are the same path.
  EXPECT_THROW(RequireDistinctOutput({"--out", "new.bin"}, {{"--trace", "./sub/../new.bin"}}),
               InvalidArgument);
  std::filesystem::current_path(old_cwd);
  EXPECT_NO_THROW(RequireDistinctOutput({"--out", dir.File("b.bin")}, {{"--tensors", a}}));
  EXPECT_NO_THROW(RequireDistinctOutput({"--out", dir.File("new.bin")}, {{"--tensors", a}}));
  EXPECT_NO_THROW(RequireDistinctOutput({"--out", a}, {{"--trace", ""}}));
  EXPECT_NO_THROW(RequireDistinctOutput({"--out", ""}, {{"--tensors", a}}));
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
