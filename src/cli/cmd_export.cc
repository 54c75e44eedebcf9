// `switchyard export --run RUN [--step N] --to hf --out DIR [--max-shard-size 5GB]`
// (docs/models.md, "export"): a run's checkpoint as a Hugging Face model directory: config.json
// (architectures, model_type and every key Hugging Face reads) and safetensors under Hugging
// Face's names, sharded above --max-shard-size with model.safetensors.index.json. The checkpoint
// is read tensor by tensor (its model.safetensors holds full tensors, experts stacked by global
// id, whatever the layout that trained it); each expert's matrices are copied out of their stacked
// tensor one at a time, and the writer holds at most one shard. Shards are written under
// temporary names and renamed when all are complete; config.json is written last.
#include <fmt/format.h>

#include <cctype>
#include <filesystem>
#include <string>

#include "cli/command.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/config.h"
#include "switchyard/train/hf_checkpoint.h"
#include "switchyard/train/hf_names.h"

namespace switchyard::cli {
namespace {

namespace hf = train::hf;
namespace fs = std::filesystem;

struct ExportOptions {
  std::string run;
  int64_t step = -1;
  std::string to;
  std::string out;
  std::string max_shard_size = "5GB";
  std::string dtype = "f32";
};

// Hugging Face's sizes: "5GB" = 5 * 10^9, "500MiB" = 500 * 2^20, a bare integer in bytes.
uint64_t ParseShardSize(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0) ++i;
  std::string unit = text.substr(i);
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::pair<const char*, uint64_t> units[] = {{"", 1},
                                                    {"B", 1},
                                                    {"KB", 1000},
                                                    {"MB", 1000'000},
                                                    {"GB", 1000'000'000},
                                                    {"KIB", 1ull << 10},
                                                    {"MIB", 1ull << 20},
                                                    {"GIB", 1ull << 30}};
  for (const auto& [name, scale] : units) {
    if (i == 0 || i > 12 || unit != name) continue;
    const uint64_t n = std::stoull(text.substr(0, i)) * scale;
    if (n > 0) return n;
  }
  throw InvalidArgument(fmt::format(
      "--max-shard-size '{}': expected a positive size such as 5GB, 500MB, 2GiB or 100000", text));
}

// The checkpoint of --run (and --step).
std::string CheckpointOf(const ExportOptions& o) {
  std::string latest;
  try {
    latest = train::ResolveCheckpoint(o.run);
  } catch (const IoError& e) {
    throw InvalidArgument(e.what());  // a missing run is bad input (exit 2)
  }
  if (o.step < 0) return latest;
  const std::string dir =
      (fs::path(latest).parent_path() / fmt::format("step_{:08d}", o.step)).string();
  SY_REQUIRE(fs::exists(fs::path(dir) / "state.json"), InvalidArgument,
             "--step {}: {} has no checkpoint of that step (expected {})", o.step, o.run, dir);
  return dir;
}

int RunExport(const ExportOptions& o) {
  SY_REQUIRE(o.to == "hf", InvalidArgument, "--to '{}': expected hf", o.to);
  SY_REQUIRE(o.dtype == "f32" || o.dtype == "bf16", InvalidArgument,
             "--dtype '{}': expected f32 or bf16", o.dtype);
  const uint64_t max_shard = ParseShardSize(o.max_shard_size);
  const std::string ckpt = CheckpointOf(o);
  std::error_code ec;
  for (const std::string& input : {o.run, ckpt}) {
    SY_REQUIRE(!fs::equivalent(o.out, input, ec), InvalidArgument,
               "--out '{}' is the run's directory {}: expected a new directory for the export",
               o.out, input);
  }
  SY_REQUIRE(!fs::exists(o.out) || fs::is_directory(o.out), InvalidArgument,
             "--out '{}' exists and is not a directory", o.out);
  const train::TrainConfig tc = train::TrainConfigFromJson(train::ReadCheckpointConfigJson(ckpt));
  const hf::ModelConfig config = hf::ModelConfigFromTrain(tc, ckpt + "/state.json");
  const hf::CheckpointReader reader(ckpt);  // its model.safetensors, headers only
  fs::create_directories(o.out);
  hf::CheckpointWriter writer(o.out,
                              {.max_shard_bytes = max_shard,
                               .dtype = o.dtype == "bf16" ? DType::kBFloat16 : DType::kFloat32});
  // One stacked expert tensor is kept while its experts are written.
  std::string cached_name;
  Tensor cached;
  hf::ForEachHfTensor(
      config,
      [&](const std::string& sy) {
        if (sy != cached_name) {
          cached = reader.ReadFloat32(sy, reader.ShapeOf(sy));
          cached_name = sy;
        }
        return cached;
      },
      [&](const std::string& name, const Tensor& t) { writer.Add(name, t); });
  const std::vector<std::string> files = writer.Finish();
  WriteTextFileAtomic((fs::path(o.out) / "config.json").string(), hf::ModelConfigToJson(config));
  fmt::print("{}: {} ({}), {} weight file(s), from {}\n", o.out,
             hf::FamilyArchitecture(config.family), hf::FamilyName(config.family), files.size(),
             ckpt);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    .parent = "",
    .name = "export",
    .description = "write a run's checkpoint as a Hugging Face model directory",
    .setup = [](CLI::App& app) -> Action {
      auto o = std::make_shared<ExportOptions>();
      app.add_option("--run", o->run, "run directory, checkpoints directory or checkpoint")
          ->required();
      app.add_option("--step", o->step, "the checkpoint of this step (default: the latest)")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
      app.add_option("--to", o->to, "format: hf")->required();
      app.add_option("--out", o->out, "directory to write")->required();
      app.add_option("--max-shard-size", o->max_shard_size,
                     "largest weight file, Hugging Face's units (5GB = 5e9 bytes, 2GiB)");
      app.add_option("--dtype", o->dtype, "f32 | bf16");
      return [o] { return RunExport(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
