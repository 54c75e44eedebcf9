// `switchyard bench layer-parallel` (also reached as `switchyard bench layer --ranks W ...`): one
// MoE layer on W ranks, with the overlap schedules of docs/overlap.md measured against the plain
// path in the same run. Shared by cmd_bench_parallel.cc and cmd_bench_layer.cc.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "switchyard/moe/config.h"

namespace switchyard::cli {

struct BenchParallelOptions {
  // The layer (options `bench layer` has too).
  int64_t tokens = 4096;  // per data shard
  int64_t model_dim = 512;
  int64_t hidden_dim = 2048;
  int64_t experts = 8;
  int64_t top_k = 2;
  float capacity_factor = 1.25f;
  bool dropless = false;
  std::string activation = "gelu";
  bool gated = false;
  int threads = 0;
  int repeat = 3;
  int warmup = 1;
  bool json = false;
  // Only here.
  int64_t global_tokens = 0;  // > 0: the whole batch instead
  int ranks = 2;
  int tp = 1, ep = 0, etp = 1;
  std::string arrangement = "deepspeed";
  std::string dispatch = "alltoall";
  std::string adaptive_r = "default";
  int hierarchical = 0;
  bool no_tp_dedup = false;
  std::string scope = "global";
  std::string transport = "auto";
  int rounds = 2;
  bool no_reference = false;
  // Overlap and scheduling, and the plain path they are compared with.
  int overlap_degree = 1;
  std::string smart = "off";
  std::string shadow = "none";
  bool no_baseline = false;
  double hot_expert_bias = 0;  // > 0: a skewed gate (expert 0 chosen first far more often)
  std::string trace_path;
  // Emulated topology (in-process): nodes of `emulate_per_node` ranks with alpha-beta links.
  int emulate_per_node = 0;
  double intra_gbps = 0, intra_latency_us = 0, inter_gbps = 0, inter_latency_us = 0;
};

// Declares the options only `bench layer-parallel` has (batch, layout, schedules, emulation,
// rounds) on `app`, bound to *o.
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
