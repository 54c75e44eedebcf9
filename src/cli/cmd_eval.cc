// `switchyard eval --model DIR --tokens FILE --out OUT.safetensors [--grads] [layout flags]`
// (docs/models.md, "eval"): a Hugging Face MoE model directory (or a run directory / checkpoint of
// switchyard's own) through switchyard's model in any layout train runs (--tp --sp --ep --etp
// --pp --cp --dp: ranks as threads of this process), writing what the
// ForCausalLM classes compute with labels = input_ids: logits [B, T, V], ce_loss, aux_loss, loss
// and, with --grads, grad.<Hugging Face name> for every parameter (the gradient of loss).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "cli/command.h"
#include "cli/launch.h"
#include "cli/layout_flags.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/json.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/config.h"
#include "switchyard/train/hf_checkpoint.h"
#include "switchyard/train/hf_eval.h"
#include "switchyard/train/hf_names.h"

namespace switchyard::cli {
namespace {

namespace hf = train::hf;

struct EvalOptions {
  std::string model;
  std::string tokens;
  std::string out;
  bool grads = false;
  int threads = 1;
  ModelLayoutFlags layout;
};

// {"input_ids": [[...], ...]}: a non-empty rectangle of integers -> int32 [B, T].
Tensor ReadTokens(const std::string& path) {
  const nlohmann::json j = ParseJsonStrict(ReadTextFile(path), path);
  SY_REQUIRE(j.is_object() && j.contains("input_ids") && j.at("input_ids").is_array() &&
                 !j.at("input_ids").empty(),
             InvalidArgument, "{}: key 'input_ids': expected a non-empty list of token lists",
             path);
  const nlohmann::json& rows = j.at("input_ids");
  const size_t width = rows.at(0).is_array() ? rows.at(0).size() : 0;
  SY_REQUIRE(width >= 2, InvalidArgument,
             "{}: key 'input_ids[0]': expected a list of at least 2 token ids", path);
  Tensor t = Tensor::Empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(width)},
                           DType::kInt32);
  for (size_t r = 0; r < rows.size(); ++r) {
    SY_REQUIRE(rows[r].is_array() && rows[r].size() == width, InvalidArgument,
               "{}: key 'input_ids[{}]': expected {} token ids like row 0 (rows must have one "
               "length), got {}",
               path, r, width, rows[r].is_array() ? std::to_string(rows[r].size()) : "no list");
    for (size_t i = 0; i < width; ++i) {
      const nlohmann::json& v = rows[r][i];
      SY_REQUIRE(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < (1ll << 31),
                 InvalidArgument, "{}: key 'input_ids[{}][{}]': expected a token id, got {}", path,
                 r, i, v.dump());
      t.data<int32_t>()[r * width + i] = static_cast<int32_t>(v.get<int64_t>());
    }
  }
  return t;
}

Tensor Scalar(double v) {
  Tensor t = Tensor::Zeros({});
  t.data<float>()[0] = static_cast<float>(v);
  return t;
}

int RunEval(const EvalOptions& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SY_REQUIRE(!fs::is_directory(o.out, ec), InvalidArgument,
             "--out '{}' is a directory: expected the path of a .safetensors file to write", o.out);
  // A Hugging Face directory, or switchyard's own run directory / checkpoint: its
  // model.safetensors holds whole tensors under switchyard's names whatever layout trained it.
  const bool is_hf = hf::IsHfDirectory(o.model);
  // A directory that cannot be read as a model is bad input (exit 2), like a bad config.
  auto as_bad_input = [](auto read) {
    try {
      return read();
    } catch (const IoError& e) {
      throw InvalidArgument(e.what());
    }
  };
  const std::string dir = as_bad_input([&] { return hf::ResolveModelPath(o.model); });
  const std::string config_path = (fs::path(dir) / (is_hf ? "config.json" : "state.json")).string();
  RequireDistinctOutput({"--out", o.out},
                        {{"--tokens", o.tokens}, {"the model's config", config_path}});
  const hf::ModelConfig config = as_bad_input([&] {
    if (is_hf) return hf::ReadModelConfig(dir);
    return hf::ModelConfigFromTrain(
        train::TrainConfigFromJson(train::ReadCheckpointConfigJson(dir)), config_path);
  });
  const hf::CheckpointReader reader = as_bad_input([&] { return hf::CheckpointReader(dir); });
  for (const std::string& name : reader.Names()) {
    RequireDistinctOutput({"--out", o.out},
                          {{"a weights file", (fs::path(dir) / reader.FileOf(name)).string()}});
  }
  const Tensor tokens = ReadTokens(o.tokens);
  train::TrainConfig tc = train::TrainConfigFromJson(hf::TrainKeysJson(config, config_path));
  tc.model.seq_len = tokens.size(1);
  tc = train::TrainConfigFromJson(o.layout.KeysJson(), tc);
  // The layout is checked as train checks it (heads, kv heads, experts, vocabulary against tp,
  // ep, cp, pp) before any rank starts and before anything is written.
  train::ValidateTrainConfig(tc);
  SY_REQUIRE(tc.ranks > 1 || (o.layout.ep <= 1 && o.layout.etp == 1), InvalidArgument,
             "--ep {} / --etp {}: one rank (tp x cp x pp x dp = 1) holds every expert whole; give "
             "the ranks to split them over (e.g. --dp {})",
             o.layout.ep, o.layout.etp, std::max(o.layout.ep, o.layout.etp));
  // Each rank reads only the parts of the tensors it holds (hf_names.h: LoadRankWeights); the
  // directory is checked against the config first, before any rank starts.
  if (is_hf)
    as_bad_input([&] {
      reader.Validate(config);
      return 0;
    });
  const hf::ModelConfig* hf_names = is_hf ? &config : nullptr;
  const hf::RankWeightLoader load = [&](train::ParameterSet& params,
                                        const train::CheckpointLayout& layout) {
    hf::LoadRankWeights(reader, hf_names, params, layout);
  };
  const hf::EvalOptions options{
      .aux_coef = config.router_aux_loss_coef, .grads = o.grads, .threads = o.threads};
  hf::EvalResult r;
  try {
    kernels::SetBlasThreads(1);  // each rank computes on its own threads
    if (tc.ranks == 1) {
      r = hf::EvaluateOnRank(tc, nullptr, 1, load, tokens, options);
    } else {
      std::unique_ptr<comm::Launcher> launcher =
          MakeLauncher("inproc", static_cast<int>(tc.ranks), {}, "eval");
      launcher->Run([&](comm::Communicator& world) {
        hf::EvalResult mine =
            hf::EvaluateOnRank(tc, &world, static_cast<int>(tc.ranks), load, tokens, options);
        if (world.rank() == 0) r = std::move(mine);
      });
    }
  } catch (const InvalidArgument& e) {
    // The tokens' errors ("tokens: ...") name the file; the layout's name their keys.
    if (std::string_view(e.what()).starts_with("tokens:")) {
      throw InvalidArgument(fmt::format("--tokens {}: {}", o.tokens, e.what()));
    }
    throw;
  }
  TensorMap out = {{"logits", r.logits},
                   {"ce_loss", Scalar(r.ce_loss)},
                   {"aux_loss", Scalar(r.aux_loss)},
                   {"loss", Scalar(r.loss)}};
  if (o.grads) {
    hf::ForEachHfTensor(
        config, [&](const std::string& sy) { return r.grads.at(sy); },
        [&](const std::string& name, const Tensor& t) { out["grad." + name] = t; });
  }
  WriteSafetensors(o.out, out);  // atomic: a failed write leaves nothing
  fmt::print("{}: logits [{}, {}, {}], ce_loss {:.6f}, aux_loss {:.6f}, loss {:.6f}{}\n", o.out,
             tokens.size(0), tokens.size(1), tc.model.vocab_size, r.ce_loss, r.aux_loss, r.loss,
             o.grads ? ", gradients of loss" : "");
  return 0;
}

SY_REGISTER_COMMAND(Command{
    .parent = "",
    .name = "eval",
    .description = "run a Hugging Face MoE model on tokens: logits, losses and gradients",
    .setup = [](CLI::App& app) -> Action {
      auto o = std::make_shared<EvalOptions>();
      app.add_option("--model", o->model,
                     "Hugging Face model directory (config.json and safetensors), or a run "
                     "directory or checkpoint of switchyard")
          ->required();
      app.add_option("--tokens", o->tokens, "JSON file {\"input_ids\": [[...], ...]} (rectangular)")
          ->required();
      app.add_option("--out", o->out, "safetensors file to write")->required();
      app.add_flag("--grads", o->grads, "also write grad.<name>: the gradient of loss");
      app.add_option("--threads", o->threads, "compute threads of each rank")
          ->check(CLI::Range(1, 1024));
      AddModelLayoutFlags(app, &o->layout);
      return [o] { return RunEval(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
