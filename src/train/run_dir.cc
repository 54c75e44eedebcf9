#include "switchyard/train/run_dir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/data.h"

namespace switchyard::train {

namespace fs = std::filesystem;

bool IsRunDirectory(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kRunMarkerFile, ec)) return true;
  return fs::exists(fs::path(dir) / "config.json", ec) &&
         fs::exists(fs::path(dir) / "checkpoints" / "latest", ec);
}

namespace {

// True when every entry of `dir` is one a run creates before its marker: the lock file (a run
// locks the directory first, then writes the marker) and the marker's temporary file (a kill
// while it was written). Such a directory is as good as empty: a run that was starting, or one
// killed before its marker existed.
bool HoldsOnlyRunEntries(const std::string& dir) {
  std::error_code ec;
  const std::string marker_temp = std::string(".") + kRunMarkerFile + ".tmp.";
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name != kRunLockFile && !name.starts_with(marker_temp)) return false;
  }
  return !ec;
}

}  // namespace

RunDirectoryLock::RunDirectoryLock(const std::string& dir) {
  std::error_code ec;
  const bool exists = fs::exists(dir, ec);
  if (exists) {
    SY_REQUIRE(fs::is_directory(dir, ec), InvalidArgument,
               "run directory '{}' exists and is not a directory: choose another 'out'", dir);
    SY_REQUIRE(HoldsOnlyRunEntries(dir) || IsRunDirectory(dir), InvalidArgument,
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

namespace {

// The files a run writes at the top of its run directory (and checkpoints/latest).
constexpr const char* kRunFiles[] = {
    "config.json",     "metrics.jsonl", "summary.json", "sample.txt", "loss.svg",
    "expert_load.svg", "trace.json",    kRunMarkerFile, kRunLockFile, "checkpoints/latest"};

// Whether `inner` is `outer` or lies below it (both existing, compared by canonical paths).
bool IsWithin(const fs::path& inner, const fs::path& outer) {
  std::error_code ec;
  const fs::path a = fs::weakly_canonical(fs::absolute(inner, ec), ec);
  const fs::path b = fs::weakly_canonical(fs::absolute(outer, ec), ec);
  if (ec) return false;
  auto [end_b, at_a] = std::mismatch(b.begin(), b.end(), a.begin(), a.end());
  return end_b == b.end();
}

}  // namespace

void RequireInputsOutsideRunDirectory(const std::string& dir, const std::vector<RunInput>& inputs,
                                      const std::string& resume_checkpoint) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;  // a new run directory holds no input
  for (const RunInput& in : inputs) {
    if (in.path.empty() || !fs::exists(in.path, ec)) continue;
    if (fs::is_directory(in.path, ec)) {
      SY_REQUIRE(!fs::equivalent(in.path, dir, ec), InvalidArgument,
                 "{} '{}' is the run directory 'out' '{}': the run's own files would be read as "
                 "input; choose another 'out'",
                 in.what, in.path, dir);
      continue;
    }
    for (const char* name : kRunFiles) {
      const std::string output = (fs::path(dir) / name).string();
      RequireDistinctOutput({"the run's file", output}, {{in.what, in.path}});
    }
    const fs::path checkpoints = fs::path(dir) / "checkpoints";
    const bool resumed_from = !resume_checkpoint.empty() && IsWithin(in.path, resume_checkpoint);
    SY_REQUIRE(resumed_from || !fs::exists(checkpoints, ec) || !IsWithin(in.path, checkpoints),
               InvalidArgument,
               "{} '{}' lies in the checkpoints of run directory 'out' '{}', which the run "
               "replaces and prunes: copy it elsewhere or choose another 'out'",
               in.what, in.path, dir);
  }
}

void RequireRunInputsOutsideRunDirectory(const TrainConfig& c, const std::string& config_file,
                                         const std::string& resume) {
  const std::string resume_dir = resume.empty() ? std::string() : ResolveCheckpoint(resume);
  std::vector<RunInput> inputs;
  for (const auto& [key, list] :
       {std::pair<const char*, const std::string&>{"data", c.data}, {"val_data", c.val_data}}) {
    for (size_t at = 0; at < list.size();) {  // the files and directories given
      const size_t comma = std::min(list.find(',', at), list.size());
      inputs.push_back({key, list.substr(at, comma - at)});
      at = comma + 1;
    }
  }
  for (const std::string& f : RunCorpusFiles(c.data, c.val_data, c.data_format)) {
    inputs.push_back({"data file", f});  // also the files of data directories
  }
  inputs.push_back({"moe_layer_config", c.moe_layer_config});
  inputs.push_back({"--config", config_file});
  if (!resume_dir.empty()) {
    for (const char* f : {"state.json", "model.safetensors", "optimizer.safetensors"}) {
      inputs.push_back({"the resumed checkpoint's", resume_dir + "/" + f});
    }
  }
  RequireInputsOutsideRunDirectory(c.out, inputs, resume_dir);
}

}  // namespace switchyard::train
