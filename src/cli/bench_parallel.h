// `switchyard bench layer-parallel` (also reached as `switchyard bench layer --ranks W ...`): one
// MoE layer on W ranks, with the overlap schedules of docs/overlap.md measured against the plain
// path in the same run. Shared by cmd_bench_parallel.cc and cmd_bench_layer.cc.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "cli/bench_setup.h"
#include "cli/layout_flags.h"
#include "switchyard/moe/config.h"

namespace switchyard::cli {

struct BenchParallelOptions {
  // The layer and the timing loop (options `bench layer` has too).
  MoeLayerFlags layer;                           // layer.tokens: per data shard
  int threads = 0;                               // compute threads per rank (0: cores / ranks)
  BenchLoopFlags loop{.iters = 3, .warmup = 1};  // per round
  // Only here.
  int64_t global_tokens = 0;  // > 0: the whole batch instead
  int ranks = 2;
  int rounds = 2;
  bool no_reference = false;
  // The layout, the overlap schedules (compared with the plain path) and --trace (the last round).
  MoeLayoutFlags layout;
  bool no_baseline = false;
  double hot_expert_bias = 0;  // > 0: a skewed gate (expert 0 chosen first far more often)
  // Emulated topology (in-process): nodes of `links.ranks_per_node` ranks with alpha-beta links.
  NodeLinkFlags links;
};

// The timing loop's flags of `bench layer-parallel` (`bench layer` spells them alike).
inline const BenchLoopFlagSpec kParallelLoopFlags{.iters_name = "--repeat",
                                                  .max_iters = 10000,
                                                  .max_warmup = 10000,
                                                  .iters_help = "timed steps per round",
                                                  .warmup_help = "untimed steps per round"};

// Declares the options only `bench layer-parallel` has (batch, layout, schedules, emulation,
// rounds; not the layer, threads or loop) on `app`, bound to *o.
void AddParallelBenchOptions(CLI::App& app, BenchParallelOptions* o);

// The rows of the expert buffers one MoE layer `c` fills on `tokens` tokens: E x capacity (the
// capacity of `tokens`), or tokens x k dropless or with capacity_factor 0; tokens x k x |cf| when
// the capacity is beyond what the layer accepts (it refuses that itself).
double MoeExpertRows(const moe::LayerConfig& c, int64_t tokens);
// An estimate of the bytes one forward + backward of `c` holds at once on `tokens` tokens, for
// RequireMemory before anything is allocated: the activations and their gradients, the gate's
// [tokens, E] scores and their gradients, the routing, the expert buffers forward and backward,
// `param_copies` copies of the parameters with gradients and momentum, and `extra_floats` more.
// In floating point, saturating at 2^62 bytes: no product of sizes overflows before the check.
uint64_t EstimateMoeStepBytes(const moe::LayerConfig& c, int64_t tokens, double param_copies,
                              double extra_floats = 0);

// Runs the benchmark and prints its report (text or one JSON line). Returns the exit code.
int RunBenchParallel(const BenchParallelOptions& o);

}  // namespace switchyard::cli
