// Helpers shared by the `switchyard bench` commands: inputs, the reduction of per-rank times, and
// figures that are printed only when they mean something (docs/cli.md): a quotient that would be
// nan or inf is absent, "-" in the text and null in --json.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/timing.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/tensor.h"

namespace switchyard::cli {

// A float32 tensor of `shape` with elements uniform in [-1, 1), a pure function of (seed, index):
// every rank that draws it gets the same values.
inline Tensor RandomTensor(Shape shape, uint64_t seed) {
  Tensor t = Tensor::Empty(std::move(shape));
  CounterRng rng(seed, kStreamData);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = 2.0f * rng.Uniform(static_cast<uint64_t>(i)) - 1;
  return t;
}

// The maximum over the ranks of `comm` of each rank's `seconds` (reduced as integer nanoseconds);
// a collective: every rank calls it.
inline double MaxOverRanks(comm::Communicator& comm, double seconds) {
  int64_t ns = static_cast<int64_t>(seconds * 1e9);
  comm.AllReduce(&ns, &ns, 1, DType::kInt64, {.reduce_op = comm::ReduceOp::kMax}).Wait();
  return static_cast<double>(ns) * 1e-9;
}

// num / den when den > 0 and both and the result are finite; else nothing.
inline std::optional<double> Quotient(double num, double den) {
  if (!(den > 0) || !std::isfinite(num) || !std::isfinite(den)) return std::nullopt;
  const double q = num / den;
  return std::isfinite(q) ? std::optional<double>(q) : std::nullopt;
}
// The median of what was measured when anything was (a fraction of a time that was 0 was never
// recorded), finite; else nothing.
inline std::optional<double> MedianIfAny(const std::vector<double>& v) {
  if (v.empty()) return std::nullopt;
  const double m = SummarizeTimes(v).median_s;
  return std::isfinite(m) ? std::optional<double>(m) : std::nullopt;
}
inline nlohmann::json JsonOf(std::optional<double> v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}
// "42%" or "-".
inline std::string Percent(std::optional<double> fraction) {
  return fraction ? fmt::format("{:.0f}%", 100 * *fraction) : std::string("-");
}
// "1.25" or "-".
inline std::string Fixed2(std::optional<double> v) {
  return v ? fmt::format("{:.2f}", *v) : std::string("-");
}

}  // namespace switchyard::cli
