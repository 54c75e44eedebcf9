#include "cli/bench_setup.h"

#include <time.h>

#include <algorithm>

#include "cli/flags.h"
#include "cli/launch.h"
#include "cli/timing.h"
#include "switchyard/core/error.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/kernels/ops.h"

namespace switchyard::cli {

moe::LayerConfig MoeLayerFlags::Config() const {
  moe::LayerConfig c;
  c.model_dim = model_dim;
  c.hidden_dim = hidden_dim;
  c.num_experts = experts;
  c.top_k = top_k;
  c.capacity_factor = capacity_factor;
  c.dropless = dropless;
  c.activation = kernels::ActivationFromName(activation);
  c.gated = gated;
  c.num_groups = num_groups;
  c.group_topk = group_topk;
  return c;
}

void AddMoeLayerFlags(CLI::App& app, MoeLayerFlags* f, const MoeLayerFlagSpec& spec) {
  AddIntOption(app, "--tokens", &f->tokens, int64_t{1}, spec.max_size, spec.tokens_help);
  AddIntOption(app, "--model-dim", &f->model_dim, int64_t{1}, spec.max_size, "M");
  AddIntOption(app, "--hidden-dim", &f->hidden_dim, int64_t{1}, spec.max_size,
               "H, hidden size of one expert");
  AddIntOption(app, "--experts", &f->experts, int64_t{1}, spec.max_experts, "E");
  AddIntOption(app, "--top-k", &f->top_k, int64_t{1}, spec.max_experts, "k");
  app.add_option("--capacity-factor", f->capacity_factor, "cf (0: no drops)")
      ->check(FiniteIn(-1e6, 1e6));
  app.add_flag("--dropless", f->dropless, "dropless mode (grouped GEMM, no capacity)");
  app.add_option("--activation", f->activation, "relu, gelu or silu");
  app.add_flag("--gated", f->gated, "gated experts (SwiGLU form)");
  AddIntOption(app, "--num-groups", &f->num_groups, int64_t{1}, spec.max_experts,
               "expert groups of group-limited routing (DeepSeek-V3)");
  AddIntOption(app, "--group-topk", &f->group_topk, int64_t{0}, spec.max_experts,
               "groups a token may use (0: no limit)");
}

namespace {

struct MoeLayerPreset {
  std::string_view name;
  MoeLayerFlags flags;
};

const std::vector<MoeLayerPreset>& MoeLayerPresets() {
  static const std::vector<MoeLayerPreset> presets = [] {
    auto make = [](int64_t t, int64_t m, int64_t h, int64_t e, int64_t k, float cf) {
      MoeLayerFlags f;
      f.tokens = t;
      f.model_dim = m;
      f.hidden_dim = h;
      f.experts = e;
      f.top_k = k;
      f.capacity_factor = cf;
      return f;
    };
    MoeLayerFlags fine = make(4096, 512, 256, 64, 8, 1.0f);
    fine.dropless = true;
    fine.gated = true;
    fine.activation = "silu";
    return std::vector<MoeLayerPreset>{{"A", make(4096, 512, 2048, 8, 2, 1.25f)},
                                       {"B", make(8192, 1024, 4096, 16, 2, 1.0f)},
                                       {"C", make(2048, 256, 1024, 64, 1, 1.0f)},
                                       {"F", fine}};
  }();
  return presets;
}

}  // namespace

std::string MoeLayerPresetNames() {
  std::string names;
  for (const MoeLayerPreset& p : MoeLayerPresets()) {
    names += names.empty() ? "" : ", ";
    names += p.name;
  }
  return names;
}

void ApplyMoeLayerPreset(const CLI::App& app, std::string_view name, MoeLayerFlags* f) {
  const auto& presets = MoeLayerPresets();
  const auto it = std::find_if(presets.begin(), presets.end(),
                               [&](const MoeLayerPreset& p) { return p.name == name; });
  SY_REQUIRE(it != presets.end(), InvalidArgument,
             "--preset: unknown layer '{}', expected one of {}", name, MoeLayerPresetNames());
  auto given = [&](const char* flag) { return app.get_option(flag)->count() > 0; };
  const MoeLayerFlags& p = it->flags;
  if (!given("--tokens")) f->tokens = p.tokens;
  if (!given("--model-dim")) f->model_dim = p.model_dim;
  if (!given("--hidden-dim")) f->hidden_dim = p.hidden_dim;
  if (!given("--experts")) f->experts = p.experts;
  if (!given("--top-k")) f->top_k = p.top_k;
  if (!given("--capacity-factor")) f->capacity_factor = p.capacity_factor;
  if (!given("--dropless")) f->dropless = p.dropless;
  if (!given("--activation")) f->activation = p.activation;
  if (!given("--gated")) f->gated = p.gated;
}

BenchLoopOptions AddBenchLoopFlags(CLI::App& app, BenchLoopFlags* f,
                                   const BenchLoopFlagSpec& spec) {
  BenchLoopOptions options;
  options.iters = AddIntOption(app, spec.iters_name, &f->iters, 1, spec.max_iters, spec.iters_help);
  options.warmup = AddIntOption(app, "--warmup", &f->warmup, 0, spec.max_warmup, spec.warmup_help);
  app.add_flag("--json", f->json, spec.json_help);
  return options;
}

void AddUniformLinkFlags(CLI::App& app, UniformLinkFlags* f, std::string_view between) {
  app.add_option("--intra-latency-us", f->latency_us,
                 fmt::format("emulated latency per message between {}, microseconds", between))
      ->check(FiniteIn(0, 1e9));
  app.add_option("--intra-gbps", f->gbps,
                 fmt::format("emulated bandwidth between {}, GB/s (0 = unlimited)", between))
      ->check(FiniteIn(0, 1e9));
  AddIntOption(app, "--timeout-ms", &f->timeout_ms, int64_t{1}, int64_t{86400000},
               "deadline of every collective");
}

std::unique_ptr<comm::Launcher> MakeUniformLinkLauncher(int ranks, const UniformLinkFlags& link,
                                                        uint64_t largest_message_bytes,
                                                        std::string_view command) {
  comm::InProcessOptions inprocess;
  inprocess.timeout = comm::Milliseconds(link.timeout_ms);
  inprocess.emulation =
      comm::EmulationOptions{{link.latency_us, link.gbps}, {link.latency_us, link.gbps}};
  RequireEmulationFitsDeadline(*inprocess.emulation, inprocess.timeout, "--timeout-ms",
                               largest_message_bytes);
  return MakeLauncher("inproc", ranks, inprocess, command);
}

int PrepareOneThreadPerRank() {
  KeepFreedMemoryForTraining();
  kernels::SetBlasThreads(1);
  return UsableCores();
}

std::string OversubscribedNote(int ranks, int cores, std::string_view what) {
  if (ranks <= cores) return "";
  return fmt::format(" ({} ranks on {} cores: {})", ranks, cores, what);
}

double TimedOnAllRanks(comm::Communicator& world, const std::function<void()>& fn) {
  world.Barrier().Wait();
  const double t0 = NowSeconds();
  fn();
  return MaxOverRanks(world, NowSeconds() - t0);
}

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

InterleavedTimes TimeInterleaved(const std::vector<std::function<void()>>& runs, int warmup,
                                 int iters, bool cpu_too) {
  InterleavedTimes t;
  t.wall.resize(runs.size());
  if (cpu_too) t.cpu.resize(runs.size());
  for (int i = 0; i < warmup; ++i) {
    for (const auto& run : runs) run();
  }
  for (int i = 0; i < iters; ++i) {
    for (size_t m = 0; m < runs.size(); ++m) {
      const double w0 = NowSeconds(), c0 = cpu_too ? ProcessCpuSeconds() : 0;
      runs[m]();
      if (cpu_too) t.cpu[m].push_back(ProcessCpuSeconds() - c0);
      t.wall[m].push_back(NowSeconds() - w0);
    }
  }
  return t;
}

void TextTable::PrintHeader() const {
  std::vector<std::string> titles;
  for (const Column& c : columns_) titles.push_back(c.title);
  PrintRow(titles);
}

void TextTable::PrintRow(const std::vector<std::string>& cells) const {
  std::string line = indent_;
  for (size_t i = 0; i < columns_.size(); ++i) {
    const Column& c = columns_[i];
    const std::string& cell = i < cells.size() ? cells[i] : std::string();
    if (i > 0) line += ' ';
    line += c.left ? fmt::format("{:<{}}", cell, c.width) : fmt::format("{:>{}}", cell, c.width);
  }
  fmt::print("{}\n", line);
}

}  // namespace switchyard::cli
