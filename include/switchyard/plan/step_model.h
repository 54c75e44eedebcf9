// The model of one training step of a layout on a cluster (docs/planner.md, "The step model"):
// per rank, compute from the GEMM rate by shape and memory bandwidth, each kind of communication
// from the alpha-beta cost of the algorithm the engine picks, what the overlaps hide, the
// pipeline bubble from the schedule simulator, and memory from train's per-rank estimate.
#pragma once

#include <cstdint>
#include <string>

#include "switchyard/plan/cluster.h"
#include "switchyard/train/config.h"
#include "switchyard/train/memory_estimate.h"

namespace switchyard::plan {

// The collectives the step model costs.
enum class Collective : uint8_t { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kSendRecv };

// Seconds one rank spends in a collective of `bytes` (nccl-tests' size: the per-rank buffer the
// collective is about; the whole W-block buffer for allgather, reduce-scatter and all-to-all)
// over `group` ranks on `link`, with the algorithm comm's selection picks for it (in-process
// transport; all-to-all over `nodes` > 1 nodes may pick the hierarchical one): the rank's
// messages are serialized, messages x latency + bytes sent / (bandwidth x efficiency). 0 for a
// group of one rank or no bytes.
struct CollectiveCost {
  std::string algorithm;  // comm's name of the algorithm ("ring", "linear", ...)
  int64_t messages = 0;   // messages the rank sends
  double bytes_sent = 0;  // payload bytes the rank sends
  double seconds = 0;
};
CollectiveCost CostOfCollective(Collective kind, double bytes, int group, const LinkSpec& link,
                                double efficiency, int nodes = 1);

// GEMM seconds of `flops` whose GEMMs have `rows` rows on one device of `cluster`.
double GemmSeconds(const Cluster& cluster, double flops, double rows);

// One step of one rank (the pipeline's slowest stage: the last, which also holds the head).
struct StepPrediction {
  // Compute per step: GEMMs (dense layers, experts, head), the attention core's products,
  // elementwise passes by bytes, the optimizer update.
  double gemm_s = 0, attention_s = 0, elementwise_s = 0, optimizer_s = 0;
  // Communication per step as issued (before overlap) and what is left exposed after it, by kind.
  double tp_comm_s = 0, cp_comm_s = 0, ep_comm_s = 0, dp_comm_s = 0, pp_comm_s = 0;
  double tp_exposed_s = 0, cp_exposed_s = 0, ep_exposed_s = 0, dp_exposed_s = 0, pp_exposed_s = 0;
  double bubble_s = 0;  // idle pipeline time of the stage (schedule simulator)
  double step_s = 0;
  train::RankMemoryEstimate memory;  // train::EstimateRankMemory
  double compute_s() const { return gemm_s + attention_s + elementwise_s + optimizer_s; }
  double exposed_comm_s() const {
    return tp_exposed_s + cp_exposed_s + ep_exposed_s + dp_exposed_s + pp_exposed_s;
  }
};

// The prediction for `config`'s layout (config.ranks ranks, placed on the cluster's devices in
// rank order, node by node). Precondition: the layout passed train's validation
// (plan/search.h: CheckLayout); ranks <= cluster.devices() (InvalidArgument otherwise).
StepPrediction PredictStep(const train::TrainConfig& config, const Cluster& cluster);

}  // namespace switchyard::plan
