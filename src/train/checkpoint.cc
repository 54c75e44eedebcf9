#include "switchyard/train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/hash.h"
#include "switchyard/core/json.h"

namespace switchyard::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kLatestFile = "latest";

void (*g_save_probe)(int point) = nullptr;

std::string StepDirName(int64_t step) { return fmt::format("step_{:08}", step); }

void FsyncDirectory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  SY_REQUIRE(fd >= 0, IoError, "{}: cannot open directory to sync: {}", dir, std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  SY_REQUIRE(rc == 0, IoError, "{}: fsync failed: {}", dir, std::strerror(err));
}

json FileEntry(std::span<const std::byte> bytes) {
  return json{{"bytes", bytes.size()}, {"fnv1a64", fmt::format("{:016x}", Fnv1a64(bytes))}};
}

// Steps of the step_* directories in `dir` (complete ones: no temporary suffix).
std::vector<std::pair<int64_t, std::string>> StepDirs(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (!e.is_directory() || !name.starts_with("step_") || name.size() != 13) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    out.emplace_back(std::stoll(name.substr(5)), e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The name `latest` holds ("" when there is none or it is unreadable).
std::string LatestName(const std::string& checkpoints_dir) {
  std::string name;
  try {
    name = ReadTextFile(checkpoints_dir + "/" + kLatestFile);
  } catch (const Error&) {
    return "";
  }
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name;
}

void WriteLatest(const std::string& checkpoints_dir, const std::string& name) {
  WriteTextFileAtomic(checkpoints_dir + "/" + kLatestFile, name + "\n");
}

// What a save leaves only while it runs (see SaveCheckpoint): step_<8 digits>.<suffix>
// directories (.partial-<pid> being written, .prev-<pid> a copy of a checkpoint being replaced,
// .trash-<pid> being deleted) and AtomicFileWriter's temporary files for `latest`.
bool IsSaveLeftover(const std::string& name) {
  return (name.starts_with("step_") && name.size() > 14 && name[13] == '.') ||
         name.starts_with(std::string(".") + kLatestFile + ".tmp.");
}

// Removes the leftovers of saves that were killed, except the one `latest` names.
void RemoveSaveLeftovers(const std::string& checkpoints_dir) {
  const std::string latest = LatestName(checkpoints_dir);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (IsSaveLeftover(name) && name != latest) fs::remove_all(e.path(), ec);
  }
}

// Deletes a checkpoint directory so that a kill midway never leaves a half-deleted directory
// under a checkpoint's name: renamed to a leftover name first.
void RemoveCheckpointDir(const std::string& dir) {
  const std::string trash = fmt::format("{}.trash-{}", dir, ::getpid());
  std::error_code ec;
  fs::remove_all(trash, ec);
  fs::rename(dir, trash);
  fs::remove_all(trash, ec);
}

// A complete copy of checkpoint `from` at `to` that shares the files' storage (hard links; a
// filesystem without them gets copies), synced.
void LinkCheckpointCopy(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::remove_all(to, ec);
  fs::create_directory(to);
  for (const auto& e : fs::directory_iterator(from)) {
    if (!e.is_regular_file()) continue;
    const std::string target = to + "/" + e.path().filename().string();
    fs::create_hard_link(e.path(), target, ec);
    if (ec) WriteFileAtomic(target, ReadFileBytes(e.path().string()));
  }
  FsyncDirectory(to);
}

}  // namespace

uint64_t Fnv1a64(std::span<const std::byte> bytes, uint64_t state) { return FnvHash(bytes, state); }

std::vector<std::string> ListCheckpoints(const std::string& checkpoints_dir) {
  std::vector<std::string> out;
  for (auto& [step, path] : StepDirs(checkpoints_dir)) out.push_back(path);
  return out;
}

void SetCheckpointSaveProbeForTesting(void (*probe)(int point)) { g_save_probe = probe; }

// The save sequence. Invariant: at every instant `latest` names a complete checkpoint (the one
// it named before the save, a complete copy of it, or the new one), and no step leaves a
// half-written or half-deleted directory under a checkpoint's name. Each step is atomic
// (rename, AtomicFileWriter) and synced before the next; `probe()` marks the points in between.
//   1. remove leftovers of killed saves, except one that `latest` names;
//   2. write and sync the files into step_N.partial-<pid>;
//   3. if step_N exists (the same step saved again):
//        if `latest` names step_N: link a complete copy step_N.prev-<pid>, point `latest` at it;
//        rename step_N to step_N.trash-<pid>;
//   4. rename step_N.partial-<pid> to step_N, sync the directory;
//   5. point `latest` at step_N;
//   6. delete the trash and the copy, prune old checkpoints (renamed to .trash first).
std::string SaveCheckpoint(const std::string& checkpoints_dir, const CheckpointData& data, int keep,
                           int64_t protected_step) {
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  SY_REQUIRE(!ec, IoError, "{}: cannot create checkpoint directory: {}", checkpoints_dir,
             ec.message());
  int point = 0;
  auto probe = [&] {
    if (g_save_probe != nullptr) g_save_probe(point++);
  };
  RemoveSaveLeftovers(checkpoints_dir);
  probe();
  const std::string name = StepDirName(data.step);
  const std::string final_dir = checkpoints_dir + "/" + name;
  const std::string temp_dir = fmt::format("{}.partial-{}", final_dir, ::getpid());
  const std::string prev_dir = fmt::format("{}.prev-{}", final_dir, ::getpid());
  const std::string trash_dir = fmt::format("{}.trash-{}", final_dir, ::getpid());
  fs::remove_all(temp_dir, ec);
  fs::create_directory(temp_dir, ec);
  SY_REQUIRE(!ec, IoError, "{}: cannot create: {}", temp_dir, ec.message());
  try {
    std::vector<std::byte> model = SerializeSafetensors(
        data.model, {{"format", "switchyard-checkpoint"}, {"step", std::to_string(data.step)}});
    std::vector<std::byte> optim = SerializeSafetensors(
        data.optimizer,
        {{"format", "switchyard-adamw"}, {"optimizer_step", std::to_string(data.optimizer_step)}});
    WriteFileAtomic(temp_dir + "/" + kModelFile, model);
    probe();
    WriteFileAtomic(temp_dir + "/" + kOptimizerFile, optim);
    probe();
    json config = data.config_json.empty() ? json::object() : json::parse(data.config_json);
    json state = {
        {"format_version", kFormatVersion},
        {"step", data.step},
        {"optimizer", {{"type", "adamw"}, {"step", data.optimizer_step}}},
        {"rng",
         {{"generator", "philox4x32-10"},
          {"seed", data.seed},
          // Every random draw is keyed by (seed, stream, counter); the counters continue from:
          {"data_counter", data.step * data.global_batch},
          {"next_step", data.step}}},
        {"global_batch", data.global_batch},
        {"config", config},
        {"data", data.data_json.empty() ? json() : json::parse(data.data_json)},
        {"moe_layer", data.moe_layer_json.empty() ? json() : json::parse(data.moe_layer_json)},
        {"files", {{kModelFile, FileEntry(model)}, {kOptimizerFile, FileEntry(optim)}}}};
    WriteTextFileAtomic(temp_dir + "/" + kStateFile, state.dump(2) + "\n");
    FsyncDirectory(temp_dir);
    probe();
    if (fs::exists(final_dir, ec)) {  // saving the same step again: replace it
      if (LatestName(checkpoints_dir) == name) {
        LinkCheckpointCopy(final_dir, prev_dir);
        FsyncDirectory(checkpoints_dir);
        probe();
        WriteLatest(checkpoints_dir, fs::path(prev_dir).filename().string());
        probe();
      }
      fs::remove_all(trash_dir, ec);
      fs::rename(final_dir, trash_dir);
      FsyncDirectory(checkpoints_dir);
      probe();
    }
    fs::rename(temp_dir, final_dir);
    FsyncDirectory(checkpoints_dir);
    probe();
  } catch (...) {
    // Nothing of the failed save stays: the partial directory goes, a replaced checkpoint comes
    // back under its name, the copy goes unless `latest` names it (the next save removes it).
    fs::remove_all(temp_dir, ec);
    if (!fs::exists(final_dir, ec) && fs::exists(trash_dir, ec))
      fs::rename(trash_dir, final_dir, ec);
    if (LatestName(checkpoints_dir) != fs::path(prev_dir).filename().string()) {
      fs::remove_all(prev_dir, ec);
    }
    try {
      throw;
    } catch (const fs::filesystem_error& e) {
      throw IoError(fmt::format("{}: cannot write checkpoint: {}", final_dir, e.what()));
    } catch (const json::exception& e) {
      throw InvalidArgument(fmt::format("checkpoint config is not valid JSON: {}", e.what()));
    } catch (const IoError& e) {
      throw IoError(fmt::format("{}: cannot write checkpoint: {}", final_dir, e.what()));
    }
  }
  WriteLatest(checkpoints_dir, name);
  probe();
  try {
    RemoveSaveLeftovers(checkpoints_dir);  // the trash, the copy, what killed saves left
    probe();
    if (keep > 0) {
      auto dirs = StepDirs(checkpoints_dir);
      for (size_t i = 0; i + static_cast<size_t>(keep) < dirs.size(); ++i) {
        if (dirs[i].second == final_dir || dirs[i].first == protected_step) continue;
        RemoveCheckpointDir(dirs[i].second);
        probe();
      }
    }
  } catch (const fs::filesystem_error& e) {
    throw IoError(fmt::format("{}: saved, but removing old checkpoints failed: {}", checkpoints_dir,
                              e.what()));
  }
  return final_dir;
}

std::string RunDirectoryOfCheckpoint(const std::string& path) {
  fs::path checkpoint = fs::path(ResolveCheckpoint(path)).lexically_normal();
  if (checkpoint.filename().empty()) checkpoint = checkpoint.parent_path();  // a trailing '/'
  const fs::path checkpoints = checkpoint.parent_path();
  SY_REQUIRE(checkpoints.filename() == "checkpoints", InvalidArgument,
             "{}: the checkpoint {} is not in the checkpoints/ directory of a run, so there is no "
             "run directory to continue in: set 'out'",
             path, checkpoint.string());
  const fs::path run = checkpoints.parent_path();
  return run.empty() ? std::string(".") : run.string();
}

std::string ResolveCheckpoint(const std::string& path) {
  std::error_code ec;
  if (fs::exists(path + "/" + kStateFile, ec)) return path;
  for (const std::string& dir : {path, path + "/checkpoints"}) {
    std::string latest = dir + "/" + kLatestFile;
    if (fs::exists(latest, ec)) {
      std::string name = ReadTextFile(latest);
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
      SY_REQUIRE(!name.empty() && name.find('/') == std::string::npos, IoError,
                 "{}: expected the name of a checkpoint directory, got '{}'", latest, name);
      return dir + "/" + name;
    }
  }
  throw IoError(
      fmt::format("no checkpoint at '{}': expected a checkpoint directory (with {}), a checkpoints "
                  "directory or a run directory (with {})",
                  path, kStateFile, "checkpoints/latest"));
}

CheckpointData LoadCheckpoint(const std::string& path) {
  const std::string dir = ResolveCheckpoint(path);
  std::string where = fmt::format("checkpoint {}", dir);
  std::string previous;
  {
    auto dirs = StepDirs(fs::path(dir).parent_path().string());
    for (auto& [s, p] : dirs) {
      if (fs::path(p) != fs::path(dir) && p < dir) previous = p;
    }
  }
  auto fail = [&](const std::string& what) {
    return IoError(fmt::format("{}: {}{}", where, what,
                               previous.empty()
                                   ? ""
                                   : fmt::format(" (the previous checkpoint {} can be resumed "
                                                 "instead)",
                                                 previous)));
  };
  std::error_code ec;
  if (!fs::exists(dir + "/" + kStateFile, ec)) throw fail("state.json is missing");
  json state;
  try {
    state =
        ParseJsonStrict(ReadTextFile(dir + "/" + kStateFile), kStateFile, JsonErrorKind::kIoError);
  } catch (const std::exception& e) {
    throw fail(fmt::format("state.json is malformed: {}", e.what()));
  }
  CheckpointData data;
  try {
    int version = state.at("format_version").get<int>();
    if (version != kFormatVersion) {
      throw fail(
          fmt::format("format_version {} is not supported (expected {})", version, kFormatVersion));
    }
    data.step = state.at("step").get<int64_t>();
    data.optimizer_step = state.at("optimizer").at("step").get<int64_t>();
    data.seed = state.at("rng").at("seed").get<uint64_t>();
    data.global_batch = state.at("global_batch").get<int64_t>();
    data.config_json = state.at("config").dump();
    if (state.contains("data") && !state.at("data").is_null()) {
      data.data_json = state.at("data").dump();
    }
    if (state.contains("moe_layer") && !state.at("moe_layer").is_null()) {
      data.moe_layer_json = state.at("moe_layer").dump();
    }
    for (const char* file : {kModelFile, kOptimizerFile}) {
      const json& entry = state.at("files").at(file);
      uint64_t expected_bytes = entry.at("bytes").get<uint64_t>();
      std::string expected_hash = entry.at("fnv1a64").get<std::string>();
      std::string p = dir + "/" + file;
      if (!fs::exists(p, ec)) throw fail(fmt::format("{} is missing", file));
      std::vector<std::byte> bytes = ReadFileBytes(p);
      if (bytes.size() != expected_bytes) {
        throw fail(fmt::format("{} is truncated or altered: {} bytes, expected {}", file,
                               bytes.size(), expected_bytes));
      }
      std::string hash = fmt::format("{:016x}", Fnv1a64(bytes));
      if (hash != expected_hash) {
        throw fail(fmt::format("{} is corrupted: checksum {} does not match {} in state.json", file,
                               hash, expected_hash));
      }
      TensorMap tensors = ParseSafetensors(bytes, p);
      (std::string(file) == kModelFile ? data.model : data.optimizer) = std::move(tensors);
    }
  } catch (const json::exception& e) {
    throw fail(fmt::format("state.json lacks a field or has a wrong type: {}", e.what()));
  }
  return data;
}

}  // namespace switchyard::train

namespace switchyard::train {

std::string SetAsideCheckpointsAfter(const std::string& checkpoints_dir, int64_t step) {
  std::vector<std::pair<int64_t, std::string>> later;
  for (auto& [s, path] : StepDirs(checkpoints_dir)) {
    if (s > step) later.emplace_back(s, path);
  }
  if (later.empty()) return "";
  WriteLatest(checkpoints_dir, StepDirName(step));
  const std::string aside = fmt::format("{}/abandoned/from_{}_{}", checkpoints_dir,
                                        StepDirName(step), static_cast<int64_t>(::time(nullptr)));
  std::error_code ec;
  fs::create_directories(aside, ec);
  SY_REQUIRE(!ec, IoError, "{}: cannot create: {}", aside, ec.message());
  for (auto& [s, path] : later) {
    fs::rename(path, aside + "/" + fs::path(path).filename().string(), ec);
    SY_REQUIRE(!ec, IoError, "{}: cannot move to {}: {}", path, aside, ec.message());
  }
  FsyncDirectory(checkpoints_dir);
  return aside;
}

std::string ReadCheckpointConfigJson(const std::string& path) {
  const std::string file = ResolveCheckpoint(path) + "/" + kStateFile;
  try {
    json state = ParseJsonStrict(ReadTextFile(file), file, JsonErrorKind::kIoError);
    return state.at("config").dump();
  } catch (const json::exception& e) {
    throw IoError(fmt::format("{}: malformed or without 'config': {}", file, e.what()));
  }
}

}  // namespace switchyard::train
