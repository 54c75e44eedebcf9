// Wall-clock timing helpers for `switchyard bench`. Medians, because these machines are noisy.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace switchyard::cli {

struct TimingStats {
  double median_s = 0;
  double min_s = 0;
  double max_s = 0;
  int repeat = 0;
};

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline TimingStats SummarizeTimes(std::vector<double> times) {
  TimingStats s;
  if (times.empty()) return s;
  std::sort(times.begin(), times.end());
  s.repeat = static_cast<int>(times.size());
  s.min_s = times.front();
  s.max_s = times.back();
  size_t n = times.size();
  s.median_s = n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  return s;
}

inline TimingStats TimeRepeated(const std::function<void()>& fn, int repeat, int warmup) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < repeat; ++i) {
    double t0 = NowSeconds();
    fn();
    times.push_back(NowSeconds() - t0);
  }
  return SummarizeTimes(std::move(times));
}

}  // namespace switchyard::cli
