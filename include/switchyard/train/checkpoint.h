// Checkpoints: everything a run needs to continue bit for bit.
//
// A checkpoint is a directory <checkpoints>/step_<8-digit step>/ holding
//   model.safetensors      the model's values by PyTorch-style name (loadable with
//                          safetensors.torch.load_file; MoE experts as [E, ...] by global id)
//   optimizer.safetensors  AdamW state: "<param>.exp_avg", "<param>.exp_avg_sq"
//   state.json             step, optimizer step, RNG state (seed and the counters the data and
//                          random routing are keyed by), the run's config, and each file's
//                          size and FNV-1a 64 checksum
// and <checkpoints>/latest names the newest complete one.
//
// Crash safety: the files are written (and fsynced) into a temporary directory that is renamed
// to its final name only when complete; `latest` is replaced atomically after that. Saving a step
// that exists again first points `latest` at a complete hard-linked copy of the old one, so a
// save killed at any moment leaves `latest` naming a complete checkpoint (the old or the new
// one), and the next save's removal of leftovers never touches what `latest` names. Loading
// verifies every file's size and checksum: a truncated or corrupted checkpoint is an IoError that
// names the file and the problem, and the checkpoints before it stay usable (pass their
// directory to load them).
//
// Thread-safety: functions are reentrant; concurrent saves into the same directory are not
// supported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "switchyard/core/safetensors.h"

namespace switchyard::train {

struct CheckpointData {
  int64_t step = 0;            // training steps completed
  int64_t optimizer_step = 0;  // AdamW's step count
  uint64_t seed = 0;           // the run's seed (keys data sampling, init, routing)
  int64_t global_batch = 0;    // rows per step (the data sampler's counter stride)
  std::string config_json;     // the run's configuration (TrainConfigToJson)
  // What the run trains on: {"files": [...], "bytes": N, "fnv1a64": "..."} (DataIdentityJson in
  // trainer.h); "" in checkpoints written before it was recorded.
  std::string data_json;
  // The MoE blocks' layer options (moe::ToJson) the run trains with; "" for a dense model and
  // in checkpoints written before it was recorded.
  std::string moe_layer_json;
  TensorMap model;      // name -> float32 value
  TensorMap optimizer;  // "<param>.exp_avg" / "<param>.exp_avg_sq"
};

// Writes a checkpoint of `data` under `checkpoints_dir` (created if missing), updates `latest`,
// then deletes all but the newest `keep` checkpoints (keep <= 0: keep all) — never the new one
// and never the checkpoint of step `protected_step` (a resumed run's starting point; -1: none).
// Returns the new checkpoint's directory. Throws IoError; on failure the previous checkpoints
// are untouched (re-saving the step `latest` names: `latest` may be left naming a complete copy
// of it) and nothing of the failed save is left (its .partial-<pid> directory is removed).
std::string SaveCheckpoint(const std::string& checkpoints_dir, const CheckpointData& data,
                           int keep = 0, int64_t protected_step = -1);

// A run resumed from step `step` of its own checkpoints: the checkpoints of later steps belong to
// the abandoned continuation. Points `latest` at step_<step> and moves every later step_N
// directory into checkpoints/abandoned/from_step_<step>_<unix time>/ (kept, never pruned, never
// resumed by `latest`). Returns the directory they were moved to ("" when there were none).
// Throws IoError.
std::string SetAsideCheckpointsAfter(const std::string& checkpoints_dir, int64_t step);

// The `config` object of the state.json of the checkpoint `path` refers to (as JSON text),
// without loading the tensors. Throws IoError.
std::string ReadCheckpointConfigJson(const std::string& path);

// The checkpoint directory `path` refers to: a checkpoint directory itself (has state.json), a
// checkpoints directory (its `latest`), or a run directory (its checkpoints/latest). Throws
// IoError naming what was looked for.
std::string ResolveCheckpoint(const std::string& path);

// Loads and verifies the checkpoint `path` refers to (see ResolveCheckpoint).
CheckpointData LoadCheckpoint(const std::string& path);

// The run directory of the checkpoint `path` refers to (see ResolveCheckpoint): the directory
// holding its checkpoints/ directory, where a resumed run continues unless told otherwise.
// Throws InvalidArgument when the checkpoint is not in a directory named `checkpoints` (a copy
// of one outside any run), IoError when there is no checkpoint.
std::string RunDirectoryOfCheckpoint(const std::string& path);

// Checkpoint directories under `checkpoints_dir`, oldest first (by step).
std::vector<std::string> ListCheckpoints(const std::string& checkpoints_dir);

// Testing: `probe(i)` is called at i = 0, 1, 2, ... between the filesystem steps of every
// SaveCheckpoint (the first right after leftovers are removed), so that a test process can stop
// dead at each point (`_exit`) and check what a kill there leaves. Null (the default) disables
// it. Not thread-safe: set it before saving.
void SetCheckpointSaveProbeForTesting(void (*probe)(int point));

// The checkpoint checksum: core/hash.h's FnvHash continuing from `state`. Checkpoints have always
// started from this value (not the standard basis, one digit short); it stays so that existing
// checkpoints still verify.
inline constexpr uint64_t kFnv1a64Start = 1469598103934665603ull;
uint64_t Fnv1a64(std::span<const std::byte> bytes, uint64_t state = kFnv1a64Start);

}  // namespace switchyard::train
