// The machine's float32 FMA peak for one thread, measured by a register-only FMA loop.
// `switchyard bench gemm` reports GEMM rates as a fraction of it, measured in the same run.
#pragma once

#include <string>

namespace switchyard::cli {

struct PeakFlops {
  double gflops = 0;  // one thread
  std::string isa;    // "avx512f", "avx2+fma" or "scalar"
};

// Runs for about `seconds`; returns the best of several rounds.
PeakFlops MeasurePeakFlops(double seconds = 0.3);

// One short round of the same loop (about 2 ms): the FMA rate of one thread right now, in GFLOP/s.
// Benchmarks run it just before each timed repetition, so that a figure and its limit share the
// time window (these VMs' speed drifts between windows).
double PeakProbeGflops();

}  // namespace switchyard::cli
