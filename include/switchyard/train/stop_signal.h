// Stopping a training run by a signal (SIGINT, SIGTERM) without losing completed steps.
//
// While a ScopedStopSignals lives, the first SIGINT or SIGTERM only records its number in a flag
// that the run passes as RunOptions::stop_signal: the trainer finishes the step under way, the
// ranks agree on the step to stop after, the last completed step is saved as a checkpoint and
// Run returns with RunSummary::stop_signal set; the program then exits with 128 + the signal's
// number (the shell's convention for a process ended by that signal). A second SIGINT or SIGTERM
// ends the process at once (the signal's default action), for a run that does not get to the end
// of its step. Under mpirun every process receives its own signal (mpirun forwards them); the
// ranks' agreement after each step makes them all stop after the same step.
//
// Thread-safety: one ScopedStopSignals per process at a time (the handlers are process-wide);
// the flag may be read from any thread.
#pragma once

#include <atomic>

namespace switchyard::train {

class ScopedStopSignals {
 public:
  // Installs the handlers (sigaction) and clears the flag; the destructor restores the previous
  // handlers.
  ScopedStopSignals();
  ~ScopedStopSignals();
  ScopedStopSignals(const ScopedStopSignals&) = delete;
  ScopedStopSignals& operator=(const ScopedStopSignals&) = delete;

  // 0 until a signal arrives, then its number.
  const std::atomic<int>* flag() const;
};

}  // namespace switchyard::train
