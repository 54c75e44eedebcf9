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

// GEMM rate of one thread at two shapes (fit to rate(m) = peak m / (m + half_rows)), memcpy
// bandwidth, and a two-rank in-process all-reduce at two sizes (fit to latency + bytes /
// bandwidth). Takes about a second.
plan::Cluster CalibrateThisMachine(const CalibrationOptions& options);

}  // namespace switchyard::cli
