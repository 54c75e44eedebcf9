// The setup the `switchyard bench` commands share (docs/cli.md, "Shared bench setup"), so that
// each command states only what it measures:
//   - flags: the MoE layer (`bench layer`, `bench layer-parallel`), the timing loop (iterations,
//     warm-up, --json), and the emulated links (one uniform link for `bench tp` / `bench cp`,
//     nodes with intra/inter-node links for `bench layer-parallel` / `bench comm`);
//   - ranks: an in-process launcher over emulated links, checked against the collective deadline;
//   - timing: a barrier-started step timed on every rank (the slowest counts), interleaved
//     repetitions of several measurements so that drift hits them alike, medians;
//   - output: one JSON line, or a text table whose header and rows share the column widths.
// Figures that are not meaningful stay absent (bench_common.h: Quotient, JsonOf, Percent).
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "cli/bench_common.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/comm/launcher.h"
#include "switchyard/moe/config.h"

namespace switchyard::cli {

// ---- Flags ---------------------------------------------------------------------------------

// One MoE layer's shape (`bench layer`, `bench layer-parallel`).
struct MoeLayerFlags {
  int64_t tokens = 4096;
  int64_t model_dim = 512;
  int64_t hidden_dim = 2048;
  int64_t experts = 8;
  int64_t top_k = 2;
  float capacity_factor = 1.25f;
  bool dropless = false;
  std::string activation = "gelu";
  bool gated = false;
  int64_t num_groups = 1;  // group-limited routing: expert groups (DeepSeek-V3)
  int64_t group_topk = 0;  // groups a token may use (0: no limit)
  // Zipf exponent of forced routes (bench layer --imbalance; 0: the gate routes).
  double imbalance = 0;

  // The layer's configuration (not validated: moe::ValidateConfig or the layer does that).
  moe::LayerConfig Config() const;
};
// How large the layer's flags may be, and what --tokens means, for one command.
struct MoeLayerFlagSpec {
  int64_t max_size = int64_t{1} << 40;     // --tokens, --model-dim, --hidden-dim
  int64_t max_experts = int64_t{1} << 40;  // --experts, --top-k
  std::string tokens_help = "tokens";
};
// --tokens --model-dim --hidden-dim --experts --top-k --capacity-factor --dropless --activation
// --gated, bound to *f.
void AddMoeLayerFlags(CLI::App& app, MoeLayerFlags* f, const MoeLayerFlagSpec& spec);

// The layer configurations docs/PERFORMANCE.md measures, by name (`--preset`):
//   A  4096 tokens, 512 -> 2048, 8 experts top-2, capacity factor 1.25, GELU
//   B  8192 tokens, 1024 -> 4096, 16 experts top-2, capacity factor 1.0, GELU
//   C  2048 tokens, 256 -> 1024, 64 experts top-1, capacity factor 1.0, GELU
//   F  4096 tokens, 512 -> 256, 64 experts top-8, dropless, SwiGLU (gated, silu): fine-grained
//      experts as in OLMoE / Qwen3-MoE / DeepSeek-V3
// Returns the names, for the help text.
std::string MoeLayerPresetNames();
// Sets *f to the preset `name` except the layer flags given on `app`'s command line, so
// `--preset F --tokens 1024` is F with 1024 tokens. Throws InvalidArgument naming the presets for
// an unknown name. Call after parsing, on the app AddMoeLayerFlags was called with.
void ApplyMoeLayerPreset(const CLI::App& app, std::string_view name, MoeLayerFlags* f);

// The timing loop of a command: `warmup` untimed then `iters` timed repetitions, and --json.
struct BenchLoopFlags {
  int iters = 5;
  int warmup = 1;
  bool json = false;
};
struct BenchLoopFlagSpec {
  std::string iters_name = "--iters";  // `bench layer` spells it --repeat
  int max_iters = 10000;
  int max_warmup = 1000;
  std::string iters_help = "timed iterations";
  std::string warmup_help = "untimed iterations";
  std::string json_help = "one JSON line instead of text";
};
// Returns the options (iterations, warm-up), for commands that need to know which were given.
struct BenchLoopOptions {
  CLI::Option* iters = nullptr;
  CLI::Option* warmup = nullptr;
};
BenchLoopOptions AddBenchLoopFlags(CLI::App& app, BenchLoopFlags* f, const BenchLoopFlagSpec& spec);

// One emulated link between every pair of ranks (`bench tp`, `bench cp`): --intra-latency-us,
// --intra-gbps and --timeout-ms (the deadline of every collective).
struct UniformLinkFlags {
  // The default link: on the 2-core machines of docs/PERFORMANCE.md the communication of the
  // default blocks costs about 0.5-1x their computation.
  double latency_us = 50;
  double gbps = 0.1;
  int64_t timeout_ms = 120000;

  nlohmann::json Json() const { return {{"latency_us", latency_us}, {"gbps", gbps}}; }
};
// `between` names the ranks in the help ("the tp ranks").
void AddUniformLinkFlags(CLI::App& app, UniformLinkFlags* f, std::string_view between);

// Nodes of `ranks_per_node` ranks with intra- and inter-node alpha-beta links (`bench
// layer-parallel`, `bench comm`): the four flags of AddEmulationLinkOptions (flags.h).
struct NodeLinkFlags {
  int ranks_per_node = 0;
  double intra_latency_us = 0, intra_gbps = 0, inter_latency_us = 0, inter_gbps = 0;

  comm::EmulationOptions Emulation() const {
    return {{intra_latency_us, intra_gbps}, {inter_latency_us, inter_gbps}};
  }
};

// ---- Ranks ---------------------------------------------------------------------------------

// `ranks` threads of this process over the uniform link `link` (both link kinds), every
// collective's deadline --timeout-ms; refused (InvalidArgument naming the flag) when a message of
// `largest_message_bytes` cannot cross the link before the deadline.
std::unique_ptr<comm::Launcher> MakeUniformLinkLauncher(int ranks, const UniformLinkFlags& link,
                                                        uint64_t largest_message_bytes,
                                                        std::string_view command);

// The process settings of the benchmarks whose ranks are threads with one GEMM thread each
// (`bench tp`, `bench cp`): freed activations stay in the process (no page faults of fresh
// buffers in the timings) and BLAS runs one thread per call. Returns the usable cores.
int PrepareOneThreadPerRank();

// " (P ranks on C cores: ...)" when `ranks` exceed `cores`, `what` saying what that does; else "".
std::string OversubscribedNote(int ranks, int cores, std::string_view what);

// ---- Timing --------------------------------------------------------------------------------

// The median of `v` (0 when empty).
inline double Median(std::vector<double> v) { return SummarizeTimes(std::move(v)).median_s; }
// The median of v[first..].
inline double MedianFrom(const std::vector<double>& v, size_t first) {
  return Median({v.begin() + static_cast<std::ptrdiff_t>(first), v.end()});
}

// Every rank of `world` starts together (a barrier), runs `fn`; the time of the slowest rank.
// A collective: every rank calls it.
double TimedOnAllRanks(comm::Communicator& world, const std::function<void()>& fn);

// The CPU time of the whole process (all threads): on a shared machine it counts the work done,
// not the time other processes held the cores.
double ProcessCpuSeconds();

// `warmup` untimed, then `iters` timed rounds; each round runs every one of `runs` once, in order,
// so that a drift of the machine's speed hits them alike. wall[m] holds the wall seconds of each
// timed run of runs[m]; cpu[m] its process CPU seconds when `cpu_too`, else it is empty.
struct InterleavedTimes {
  std::vector<std::vector<double>> wall, cpu;
};
InterleavedTimes TimeInterleaved(const std::vector<std::function<void()>>& runs, int warmup,
                                 int iters, bool cpu_too = false);

// ---- Output --------------------------------------------------------------------------------

inline void PrintJsonLine(const nlohmann::json& j) { fmt::print("{}\n", j.dump()); }

// A text table: a header of column titles and rows of cells, each column of a fixed width
// (left- or right-aligned), cells separated by one space, every line indented by `indent`.
class TextTable {
 public:
  struct Column {
    std::string title;
    int width = 8;
    bool left = false;
  };
  TextTable(std::string indent, std::vector<Column> columns)
      : indent_(std::move(indent)), columns_(std::move(columns)) {}
  void PrintHeader() const;
  // One row of already formatted cells (as many as columns).
  void PrintRow(const std::vector<std::string>& cells) const;

 private:
  std::string indent_;
  std::vector<Column> columns_;
};

}  // namespace switchyard::cli
