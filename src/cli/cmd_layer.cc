// `switchyard layer`: runs one MoE layer on tensors from a safetensors file and writes its outputs,
// routing and (with dy) gradients, so users can check switchyard against their own PyTorch code.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <string_view>

#include "cli/command.h"
#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/layout_flags.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "switchyard/parallel/driver.h"
#include "switchyard/parallel/schedule.h"
#include "switchyard/parallel/trace.h"

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
  // Expert parallelism (docs/parallel.md): W ranks as threads, or this process's MPI world.
  int ranks = 1;
  bool ranks_given = false;  // under MPI without --ranks: the world size
  // The layout and overlap schedules (docs/overlap.md): the same outputs for every schedule.
  MoeLayoutFlags layout;
};

std::string ResolvedTransport(const LayerOptions& o) {
  return ResolveTransport(o.layout.transport);
}

// The layer on o.ranks ranks (parallel/driver.h); the same outputs as the single-rank layer.
// Returns false on MPI ranks other than 0, which write nothing.
bool RunParallel(const LayerOptions& o, const moe::LayerConfig& config, bool training,
                 const moe::LayerParams& params, const Tensor& x, const Tensor& dy,
                 moe::LayerOutput* out, moe::LayerGradients* grads) {
  parallel::DriverOptions d;
  const std::string transport = ResolvedTransport(o);
  std::unique_ptr<comm::Launcher> launcher = MakeLauncher(transport, o.ranks, {}, "layer");
  if (transport == "mpi") {
    SY_REQUIRE(!o.ranks_given || o.ranks == launcher->world_size(), InvalidArgument,
               "--ranks {} but mpirun started {} processes (one rank per process); start {} "
               "processes or pass --ranks {}",
               o.ranks, launcher->world_size(), o.ranks, launcher->world_size());
  }
  d.parallel = o.layout.Options(launcher->world_size());
  d.threads = o.threads;
  // The process-wide BLAS budget of each rank, set here at the program's edge.
  kernels::SetBlasThreads(o.threads > 0
                              ? o.threads
                              : ComputeThreadsPerRank(launcher->ranks_in_process(), UsableCores()));
  d.global_token_offset = o.global_token_offset;
  d.training = training;
  d.step = o.step;
  parallel::Tracer tracer;
  if (!o.layout.trace_path.empty()) d.tracer = &tracer;
  parallel::LayerRunResult run = parallel::RunLayerOnRanks(*launcher, config, params, x, dy, d);
  if (!run.is_root) return false;
  if (!o.layout.trace_path.empty()) tracer.WriteJson(o.layout.trace_path);
  *out = run.output;
  grads->x = run.grad_x;
  grads->params = run.grads;
  if (!o.quiet) {
    fmt::print(
        "layer: {} ranks ({}), {} arrangement, dispatch {}, adaptive r {}{}, scope {}\n",
        run.ranks.size(), transport, o.layout.arrangement, o.layout.dispatch, run.adaptive_r,
        o.layout.hierarchical > 0 ? fmt::format(", 2DH {} ranks/node", o.layout.hierarchical) : "",
        o.layout.scope);
    // The adaptive-r volume model's prediction for the r used (docs/parallel.md), as `bench
    // layer-parallel` reports it: the driver's predicted_volume (elements per rank per step; MB as
    // float32).
    fmt::print(
        "layer: volume model for r = {}{}: predicted volume {} elements ({:.3g} MB as float32) per "
        "rank per step\n",
        run.adaptive_r, o.layout.adaptive_r == "auto" ? " (auto)" : "", run.predicted_volume,
        run.predicted_volume * sizeof(float) / 1e6);
    if (run.overlap_degree > 1 || run.smart_group > 0 || !run.shadowed.empty()) {
      fmt::print("layer: overlap degree {}, smart schedule {}, shadowed experts {}\n",
                 run.overlap_degree,
                 run.smart_group > 0 ? fmt::format("g = {}", run.smart_group) : "off",
                 run.shadowed.empty() ? "none" : fmt::format("{}", fmt::join(run.shadowed, ",")));
    }
    if (!o.layout.trace_path.empty())
      fmt::print("layer: trace written to {}\n", o.layout.trace_path);
  }
  return true;
}

Tensor ScalarF32(float v) { return Tensor::Full({}, v, DType::kFloat32); }
Tensor VectorI64(const std::vector<int64_t>& v) {
  return Tensor::FromVector(v, {static_cast<int64_t>(v.size())});
}

// Every name in the tensors file must be one the layer reads: a misspelt 'dY' would otherwise be
// ignored and the run would silently compute no gradients.
void RequireKnownTensors(const LayerOptions& o, const moe::LayerConfig& config,
                         const TensorMap& in) {
  std::vector<std::string> expected{"x", "dy"};
  for (const auto& [name, shape] : moe::ParamShapes(config)) expected.push_back(name);
  std::vector<std::string> unknown;
  for (const auto& [name, t] : in) {
    if (std::find(expected.begin(), expected.end(), name) == expected.end()) {
      unknown.push_back(fmt::format("'{}'", name));
    }
  }
  SY_REQUIRE(unknown.empty(), InvalidArgument,
             "{}: unknown tensor{} {}: this layer config reads only {} (dy is optional)",
             o.tensors_path, unknown.size() > 1 ? "s" : "", fmt::join(unknown, ", "),
             fmt::join(expected, ", "));
}

int RunLayer(const LayerOptions& o) {
  // Outputs never overwrite inputs (nor each other), whatever spelling names the same file.
  RequireDistinctOutput({"--out", o.out_path}, {{"--tensors", o.tensors_path},
                                                {"--config", o.config_path},
                                                {"--trace", o.layout.trace_path}});
  RequireDistinctOutput({"--trace", o.layout.trace_path},
                        {{"--tensors", o.tensors_path}, {"--config", o.config_path}});
  // And are writable kinds of path (not a directory, FIFO or device), before any work is done.
  // Under MPI only rank 0 writes, perhaps on another file system than this rank: it checks when
  // it writes.
  if (ResolvedTransport(o) != "mpi") {
    CheckOutputPath(o.out_path);
    if (!o.layout.trace_path.empty()) CheckOutputPath(o.layout.trace_path);
  }
  moe::LayerConfig config;
  bool training = true;  // the file's "training" key: the mode of the calls
  try {
    moe::LayerFile file = moe::LayerFileFromJson(ReadTextFile(o.config_path));
    config = file.config;
    training = file.training.value_or(true);
  } catch (const InvalidArgument& e) {
    // LayerConfigFromJson says "layer.json: ..."; name the actual file instead.
    std::string_view msg = e.what();
    if (msg.starts_with("layer.json: ")) msg.remove_prefix(12);
    throw InvalidArgument(fmt::format("{}: {}", o.config_path, msg));
  }
  TensorMap in = ReadSafetensors(o.tensors_path);
  RequireKnownTensors(o, config, in);
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
  fo.training = training;
  auto dy_it = in.find("dy");
  fo.save_for_backward = dy_it != in.end();
  moe::LayerOutput out;
  moe::LayerGradients parallel_grads;
  const bool parallel = o.ranks > 1 || ResolvedTransport(o) != "inproc" ||
                        !o.layout.trace_path.empty() || o.layout.overlap_degree > 1 ||
                        o.layout.smart != "off" || o.layout.shadow != "none";
  try {
    if (parallel) {
      if (!RunParallel(o, config, training, params, x, dy_it != in.end() ? dy_it->second : Tensor(),
                       &out, &parallel_grads)) {
        return 0;
      }
    } else {
      out = layer.Forward(params, x, fo);
    }
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
    moe::LayerGradients g = parallel_grads;
    try {
      if (!parallel) g = layer.Backward(params, out, dy_it->second, threads);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: {}", o.tensors_path, e.what()));
    }
    result["grad.x"] = g.x;
    for (auto& [name, t] : moe::ParamsToMap(config, g.params)) result["grad." + name] = t;
  }
  WriteSafetensors(o.out_path, result,
                   {{"switchyard.layer_config", moe::ToJson(config, training)}});
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
      AddIntOption(app, "--threads", &o->threads, 0, 256,
                   "compute threads (default: the usable cores)");
      AddIntOption(app, "--global-token-offset", &o->global_token_offset, int64_t{0},
                   int64_t{1} << 50, "global index of the first token (keys the random draws)");
      AddIntOption(app, "--step", &o->step, 0, std::numeric_limits<int64_t>::max(),
                   "training step (keys the random draws)");
      app.add_flag("--quiet", o->quiet, "print nothing on success");
      // Expert parallelism: the same outputs for every layout (docs/parallel.md).
      CLI::Option* ranks =
          AddIntOption(app, "--ranks", &o->ranks, 1, 4096,
                       "run on W ranks (threads; under mpirun: the MPI world, its size if unset)");
      AddMoeLayoutFlags(app, &o->layout,
                        "write the parallel run's timeline as a Chrome trace-event JSON file");
      return [o, ranks] {
        o->ranks_given = ranks->count() > 0;
        return RunLayer(*o);
      };
    }});

}  // namespace
}  // namespace switchyard::cli
