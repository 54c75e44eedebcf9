// The cost models behind the overlap and scheduling choices of the parallel MoE layer
// (docs/overlap.md): FasterMoE's smart-schedule group size and its shadow-expert policy. Pure
// arithmetic on a link model (alpha-beta) and a GEMM rate, so every rank that feeds in the same
// numbers makes the same choice (the layer agrees on the numbers first).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/comm/communicator.h"

namespace switchyard::parallel {

// What moving bytes and multiplying matrices cost on one rank. Zero fields are measured by the
// layer when a choice needs them (MeasureCostModel).
struct CostModel {
  double link_gbps = 0;        // GB/s a rank sends to its peers (1e9 bytes per second)
  double link_latency_us = 0;  // per message
  double gemm_gflops = 0;      // expert GEMM rate of one rank
  bool complete() const { return link_gbps > 0 && gemm_gflops > 0; }
};

// Fills the zero fields of `model` (link_gbps 0: the link, latency included) by timing
// all-to-alls over `group` (a small one for the latency, 1 MiB per peer for the bandwidth) and a
// [256, M] x [M, H] GEMM with `threads` threads; the ranks agree on the slowest figures, so the
// result is equal on every rank. Collective.
CostModel MeasureCostModel(comm::Communicator& group, const CostModel& model, int64_t model_dim,
                           int64_t hidden_dim, int threads);

// ---- Smart schedule (FasterMoE) ----

inline constexpr int kSmartOff = 0;
inline constexpr int kSmartAuto = -1;
// "off" / "0" -> kSmartOff, "auto" -> kSmartAuto, else an integer g >= 1.
int SmartGroupFromString(std::string_view text);

// Estimated seconds of one pass (there and back) of a rank's token exchange and expert compute
// with group size g over P ranks, n = P / g pipelined steps, each step's transfer costing
// c = bytes / (n bw) + (P - 1) latency and its compute f = flops / (n rate):
//   T(n) = 2 c + f + max((n - 1) f, 2 (n - 1) c)
// (the first send and the last return are exposed; in between the busier of the two streams
// sets the pace).
double SmartScheduleSeconds(int group_size, int ranks, double bytes, double flops,
                            const CostModel& model);
// The divisor g of `ranks` with the smallest SmartScheduleSeconds (ties: the larger g).
int ChooseSmartGroup(int ranks, double bytes, double flops, const CostModel& model);

// ---- Shadow experts (FasterMoE) ----

enum class ShadowPolicy : uint8_t { kNone, kAuto, kList };
struct ShadowOptions {
  ShadowPolicy policy = ShadowPolicy::kNone;
  std::vector<int64_t> experts;  // kList: global expert indices
};
// "none", "auto" or a comma-separated list of expert indices ("0,3").
ShadowOptions ShadowFromString(std::string_view text);
std::string ShadowToString(const ShadowOptions& shadow);

// The numbers the shadow policy looks at.
struct ShadowProblem {
  int ranks = 1;                // P, members of the expert group; rank p owns experts
                                // [p E_l, (p + 1) E_l)
  int64_t num_experts = 0;      // E
  std::vector<int64_t> counts;  // [P, E] rows rank p sends to expert e
  int64_t model_dim = 0, hidden_dim = 0;
  bool gated = false, bias = true;
};

// Estimated seconds of a forward + backward with `shadowed` replicated: the slowest rank's
// expert compute (its own experts' rows from everyone, plus its own rows of shadowed experts)
// plus its token traffic (rows for other ranks' unshadowed experts, there and back, twice), plus
// broadcasting and reducing the parameters of every shadowed expert.
double ShadowStepSeconds(const ShadowProblem& problem, const std::vector<char>& shadowed,
                         const CostModel& model);
// The experts in decreasing total load; of the prefixes of that order (none, the hottest, the two
// hottest, ...) the one with the lowest ShadowStepSeconds. Returns its experts in increasing
// order.
std::vector<int64_t> ChooseShadowExperts(const ShadowProblem& problem, const CostModel& model);

}  // namespace switchyard::parallel
