#include "switchyard/train/stop_signal.h"

#include <signal.h>

#include "switchyard/core/error.h"

namespace switchyard::train {

namespace {

constexpr int kStopSignals[] = {SIGINT, SIGTERM};
std::atomic<int> g_stop{0};
struct sigaction g_previous[2];
static_assert(std::atomic<int>::is_always_lock_free,
              "the handler may only touch lock-free atomics");

// Async-signal-safe: a lock-free atomic, signal() and raise().
void OnStopSignal(int signo) {
  int none = 0;
  if (g_stop.compare_exchange_strong(none, signo)) return;
  // The second signal: the default action (the process ends by the signal).
  ::signal(signo, SIG_DFL);
  ::raise(signo);
}

}  // namespace

ScopedStopSignals::ScopedStopSignals() {
  g_stop.store(0);
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // blocking calls go on; the trainer polls the flag
  for (size_t i = 0; i < 2; ++i) {
    SY_CHECK(::sigaction(kStopSignals[i], &action, &g_previous[i]) == 0, "sigaction failed");
  }
}

ScopedStopSignals::~ScopedStopSignals() {
  for (size_t i = 0; i < 2; ++i) ::sigaction(kStopSignals[i], &g_previous[i], nullptr);
}

const std::atomic<int>* ScopedStopSignals::flag() const { return &g_stop; }

}  // namespace switchyard::train
