// Ownership of a run directory (`--out`): which directories a run may write into, and one live
// run per directory.
//
// A run directory of this program holds the marker file `.switchyard-run` (written when the run
// directory is created). A run writes into a directory that does not exist, is empty, holds the
// marker, or (written before the marker existed) holds config.json and checkpoints/latest;
// any other directory is refused, so that a user's own files are never replaced.
//
// While a run is alive it holds an exclusive flock(2) on `.switchyard-run.lock` in the directory,
// whose content is the owner's pid. A second run is refused at start naming that pid. The kernel
// releases the lock when the owner's process ends in any way (also SIGKILL), so a dead run never
// blocks the directory.
//
// Thread-safety: a RunDirectoryLock belongs to one thread.
#pragma once

#include <string>
#include <vector>

#include "switchyard/train/config.h"

namespace switchyard::train {

inline constexpr const char* kRunMarkerFile = ".switchyard-run";
inline constexpr const char* kRunLockFile = ".switchyard-run.lock";

class RunDirectoryLock {
 public:
  RunDirectoryLock() = default;
  // Checks that `dir` may be written by a run (see above), creates it and its marker if needed
  // and takes its lock. Throws InvalidArgument (a non-empty directory that is not a run
  // directory, or one owned by another live run, named with its pid) or IoError.
  explicit RunDirectoryLock(const std::string& dir);
  ~RunDirectoryLock();
  RunDirectoryLock(RunDirectoryLock&& other) noexcept;
  RunDirectoryLock& operator=(RunDirectoryLock&& other) noexcept;
  RunDirectoryLock(const RunDirectoryLock&) = delete;
  RunDirectoryLock& operator=(const RunDirectoryLock&) = delete;

  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// True when `dir` is a run directory of this program (marker, or config.json and
// checkpoints/latest).
bool IsRunDirectory(const std::string& dir);

// An input of a run, with the name the user knows it by ("data", "--config", ...).
struct RunInput {
  std::string what;
  std::string path;
};
// Refuses (InvalidArgument naming the input and the file) a run whose writes into run directory
// `dir` would replace or delete one of its `inputs`: an input that is a file the run writes there
// (config.json, metrics.jsonl, summary.json, sample.txt, the figures, trace.json, the marker and
// lock, checkpoints/latest; compared by device and inode, so links and other spellings count), an
// input inside `dir`/checkpoints other than `resume_checkpoint` (pruning deletes old
// checkpoints), or an input directory that is `dir` itself (the run's own files would join the
// data). Inputs that do not exist are skipped (reading them fails on its own).
void RequireInputsOutsideRunDirectory(const std::string& dir, const std::vector<RunInput>& inputs,
                                      const std::string& resume_checkpoint = "");

// Refuses (InvalidArgument) a run whose writes into its run directory config.out would replace
// or delete one of its inputs (RequireInputsOutsideRunDirectory): the data and held-out files
// (also those of data directories), the data directories, the MoE layer file, `config_file` (the
// --config file, "" none) and the files of the checkpoint `resume` names ("" a fresh run).
// Trainer::Run calls it on the writer; commands call it before they start the ranks, so that it
// is the first error. IoError for a missing data file or checkpoint.
void RequireRunInputsOutsideRunDirectory(const TrainConfig& config, const std::string& config_file,
                                         const std::string& resume);

}  // namespace switchyard::train
