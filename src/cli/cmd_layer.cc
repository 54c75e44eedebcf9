// `switchyard layer`: runs one MoE layer on tensors from a safetensors file and writes its outputs,
// routing and (with dy) gradients, so users can check switchyard against their own PyTorch code.
#include <fmt/format.h>

#include <memory>
#include <string>
#include <string_view>

#include "cli/command.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"

namespace switchyard::cli {
namespace {

struct LayerOptions {
  std::string config_path;
  std::string tensors_path;
  std::string out_path;
  int threads = 0;  // 0: the usable cores
  int64_t global_token_offset = 0;
  uint64_t step = 0;
  bool quiet = false;
};

Tensor ScalarF32(float v) { return Tensor::Full({}, v, DType::kFloat32); }
Tensor VectorI64(const std::vector<int64_t>& v) {
  return Tensor::FromVector(v, {static_cast<int64_t>(v.size())});
}

int RunLayer(const LayerOptions& o) {
  moe::LayerConfig config;
  try {
    config = moe::LayerConfigFromJson(ReadTextFile(o.config_path));
  } catch (const InvalidArgument& e) {
    // LayerConfigFromJson says "layer.json: ..."; name the actual file instead.
    std::string_view msg = e.what();
    if (msg.starts_with("layer.json: ")) msg.remove_prefix(12);
    throw InvalidArgument(fmt::format("{}: {}", o.config_path, msg));
  }
  TensorMap in = ReadSafetensors(o.tensors_path);
  auto x_it = in.find("x");
  SY_REQUIRE(x_it != in.end(), InvalidArgument,
             "{}: missing tensor 'x' (expected [num_tokens, {}] float32 or bfloat16)",
             o.tensors_path, config.model_dim);
  const Tensor& x = x_it->second;
  moe::LayerParams params;
  try {
    params = moe::ParamsFromMap(config, in);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: {}", o.tensors_path, e.what()));
  }

  int threads = o.threads > 0 ? o.threads : UsableCores();
  kernels::SetBlasThreads(threads);
  moe::MoeLayer layer(config);
  moe::ForwardOptions fo;
  fo.global_token_offset = o.global_token_offset;
  fo.step = o.step;
  fo.threads = threads;
  auto dy_it = in.find("dy");
  fo.save_for_backward = dy_it != in.end();
  moe::LayerOutput out;
  try {
    out = layer.Forward(params, x, fo);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: {}", o.tensors_path, e.what()));
  }

  TensorMap result;
  result["y"] = out.y;
  result["l_aux"] = ScalarF32(out.l_aux);
  result["z_loss"] = ScalarF32(out.z_loss);
  result["capacity"] = Tensor::Full({}, static_cast<double>(out.capacity), DType::kInt64);
  result["routing.topk_idx"] = out.topk_idx;
  result["routing.locations"] = out.locations;
  result["routing.gates"] = out.gates;
  result["routing.combine_weights"] = out.combine_weights;
  result["routing.expert_loads"] = VectorI64(out.expert_loads);
  result["routing.expert_counts"] = VectorI64(out.expert_counts);
  if (dy_it != in.end()) {
    moe::LayerGradients g;
    try {
      g = layer.Backward(params, out, dy_it->second, threads);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: {}", o.tensors_path, e.what()));
    }
    result["grad.x"] = g.x;
    for (auto& [name, t] : moe::ParamsToMap(config, g.params)) result["grad." + name] = t;
  }
  WriteSafetensors(o.out_path, result, {{"switchyard.layer_config", moe::ToJson(config)}});
  if (!o.quiet) {
    int64_t kept = 0;
    for (int64_t n : out.expert_counts) kept += n;
    fmt::print("layer: {} tokens, k = {}, capacity {}, dropped {} of {} routed, l_aux {:.6g}{}\n",
               x.size(0), layer.top_k(), out.capacity, out.dropped, kept + out.dropped, out.l_aux,
               dy_it != in.end() ? ", gradients written" : "");
    fmt::print("wrote {} tensors to {}\n", result.size(), o.out_path);
  }
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "layer",
    "Run one MoE layer: layer.json + tensors (x, weights, optional dy) -> y, l_aux, routing, "
    "gradients",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<LayerOptions>();
      app.add_option("--config", o->config_path, "layer.json with the layer options")->required();
      app.add_option(
             "--tensors", o->tensors_path,
             "safetensors file with x [T, M], the weights (gate.weight, experts.fc1.weight, "
             "...) and optionally dy [T, M]")
          ->required();
      app.add_option("--out", o->out_path, "safetensors file to write")->required();
      app.add_option("--threads", o->threads, "compute threads (default: the usable cores)")
          ->check(CLI::Range(0, 256));
      app.add_option("--global-token-offset", o->global_token_offset,
                     "global index of the first token (keys the random draws)")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 50));
      app.add_option("--step", o->step, "training step (keys the random draws)");
      app.add_flag("--quiet", o->quiet, "print nothing on success");
      return [o] { return RunLayer(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
