// `switchyard plan --cluster this`: this machine as a cluster, measured by short calibrations
// (docs/planner.md, "Calibration").
#pragma once

#include <cstdint>

#include "switchyard/plan/cluster.h"

namespace switchyard::cli {

struct CalibrationOptions {
  int ranks = 4;  // ranks as threads of this process: the devices of the one node
  // The emulated link between the in-process ranks (train's --link-latency-us / --link-gbps);
  // 0 and 0: the measured in-process exchange.
  double link_latency_us = 0;
  double link_gbps = 0;
};

// The GEMM rate at two shapes (fit to rate(m) = peak m / (m + half_rows)) and the memcpy
// bandwidth of one rank while `ranks` threads run them at once, and an all-reduce of `ranks`
// in-process ranks at two sizes (fit to latency + bytes / bandwidth with the messages and bytes
// of the algorithm comm picks). Takes a few seconds (more on a loaded machine).
plan::Cluster CalibrateThisMachine(const CalibrationOptions& options);

// The machine's 1-minute load average (getloadavg), -1 when unknown: printed next to every
// figure measured on this shared machine.
double LoadAverage();

}  // namespace switchyard::cli
