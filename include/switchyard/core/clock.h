// The clock of every duration switchyard measures (step times, communication waits, traces).
#pragma once

#include <chrono>

namespace switchyard {

// Seconds since an arbitrary epoch on the monotonic clock (std::chrono::steady_clock): only
// differences of two readings mean anything.
inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace switchyard
