#include "switchyard/train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kLatestFile = "latest";

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

}  // namespace

uint64_t Fnv1a64(std::span<const std::byte> bytes) {
  uint64_t h = 1469598103934665603ull;
  for (std::byte b : bytes) {
    h ^= static_cast<uint64_t>(b);
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<std::string> ListCheckpoints(const std::string& checkpoints_dir) {
  std::vector<std::string> out;
  for (auto& [step, path] : StepDirs(checkpoints_dir)) out.push_back(path);
  return out;
}

std::string SaveCheckpoint(const std::string& checkpoints_dir, const CheckpointData& data,
                           int keep) {
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  SY_REQUIRE(!ec, IoError, "{}: cannot create checkpoint directory: {}", checkpoints_dir,
             ec.message());
  // Leftovers of runs killed while saving.
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    if (e.path().filename().string().find(".partial") != std::string::npos) {
      fs::remove_all(e.path(), ec);
    }
  }
  const std::string final_dir = checkpoints_dir + "/" + StepDirName(data.step);
  const std::string temp_dir = fmt::format("{}.partial-{}", final_dir, ::getpid());
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
    WriteFileAtomic(temp_dir + "/" + kOptimizerFile, optim);
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
        {"files", {{kModelFile, FileEntry(model)}, {kOptimizerFile, FileEntry(optim)}}}};
    WriteTextFileAtomic(temp_dir + "/" + kStateFile, state.dump(2) + "\n");
    FsyncDirectory(temp_dir);
    if (fs::exists(final_dir, ec)) {  // saving the same step again: replace it
      std::string old = final_dir + ".partial-old";
      fs::rename(final_dir, old);
      fs::rename(temp_dir, final_dir);
      fs::remove_all(old, ec);
    } else {
      fs::rename(temp_dir, final_dir);
    }
    FsyncDirectory(checkpoints_dir);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(temp_dir, ec);
    throw IoError(fmt::format("{}: cannot write checkpoint: {}", final_dir, e.what()));
  } catch (const json::exception& e) {
    fs::remove_all(temp_dir, ec);
    throw InvalidArgument(fmt::format("checkpoint config is not valid JSON: {}", e.what()));
  } catch (...) {
    fs::remove_all(temp_dir, ec);
    throw;
  }
  WriteTextFileAtomic(checkpoints_dir + "/" + kLatestFile, StepDirName(data.step) + "\n");
  if (keep > 0) {
    auto dirs = StepDirs(checkpoints_dir);
    for (size_t i = 0; i + static_cast<size_t>(keep) < dirs.size(); ++i) {
      if (dirs[i].second != final_dir) fs::remove_all(dirs[i].second, ec);
    }
  }
  return final_dir;
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
    state = json::parse(ReadTextFile(dir + "/" + kStateFile));
  } catch (const json::exception& e) {
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
