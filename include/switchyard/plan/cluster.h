// The machine a layout is planned for (docs/planner.md, "Cluster files"): nodes of devices, each
// device's GEMM rate and memory, and the alpha-beta cost of the links inside a node and between
// nodes. Read from a JSON file (ParseCluster) or measured on this machine by the program
// (`switchyard plan --cluster this`).
#pragma once

#include <map>
#include <string>
#include <string_view>

namespace switchyard::plan {

// One link class: a message of b bytes takes latency_us + b / bandwidth.
struct LinkSpec {
  double bandwidth_gbps = 0;  // GB/s (1e9 bytes per second), > 0
  double latency_us = 0;      // per message, >= 0
};

struct Cluster {
  std::string name;
  int nodes = 1;             // >= 1
  int devices_per_node = 1;  // >= 1
  // Per device: the GEMM rate of the training precision at large shapes (TFLOP/s, > 0) and the
  // rows m at which a GEMM of m rows reaches half of it (rate(m) = peak m / (m + half_rows);
  // 0: every shape at the peak).
  double gemm_tflops = 0;
  double gemm_half_rows = 0;
  double memory_gib = 0;             // per device, > 0
  double memory_bandwidth_gbps = 0;  // per device, > 0 (elementwise passes, the optimizer)
  LinkSpec intra_node;
  LinkSpec inter_node;  // used only with nodes > 1 (required then)
  // The achieved share of the link bandwidth per collective ("allreduce", "allgather",
  // "reduce_scatter", "alltoall", "sendrecv"), each in (0, 1]; missing: 1.
  std::map<std::string, double> collective_efficiency;
  // The devices are ranks sharing `shared_cores` CPU cores (this machine: ranks as threads);
  // 0 = every device computes on its own. With more ranks than cores a rank computes at
  // cores / ranks of the rate (docs/planner.md, "Shared cores").
  int shared_cores = 0;
  std::string source;  // where the numbers come from (free text)

  int devices() const { return nodes * devices_per_node; }
  double efficiency(std::string_view collective) const;
};

// Parses a cluster description. `where` names the input in messages ("cluster file a.json").
// InvalidArgument naming the key and what was expected: a missing required key, a value of the
// wrong type, a non-positive count, bandwidth, rate or memory, a negative latency, an efficiency
// outside (0, 1], an unknown key.
Cluster ParseCluster(std::string_view json_text, std::string_view where);
// Reads and parses a file (IoError when it cannot be read).
Cluster LoadClusterFile(const std::string& path);
// The cluster as JSON (ParseCluster reads it back).
std::string ClusterToJson(const Cluster& cluster);

}  // namespace switchyard::plan
