// The training progress line: step, cross-entropy, tokens/s, drop rate and ETA. On a terminal it is
// one bar redrawn in place ("\r" + clear to end of line); otherwise (a log file, a pipe, CI) it
// prints a plain line every `plain_every` steps and at the last step.
//
// Thread-safety: one thread drives a ProgressBar.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace switchyard::train {

struct ProgressInfo {
  int64_t step = 0;           // steps completed
  int64_t total = 0;          // steps of the run
  double ce_loss = NAN;       // training cross-entropy of the current log interval (NaN: none)
  double val_loss = NAN;      // last held-out cross-entropy (NaN: none yet)
  int64_t skipped_steps = 0;  // non-finite steps skipped so far
  double tokens_per_s = NAN;
  double drop_rate = NAN;  // fraction of routed (token, choice) pairs dropped; NaN: dense
  double eta_s = NAN;      // seconds left (NaN: unknown)
};

// "1h02m", "3m05s", "12s", "-" for NaN.
std::string FormatDuration(double seconds);
// "950", "12.3k", "1.20M".
std::string FormatRate(double per_second);

class ProgressBar {
 public:
  ProgressBar(std::FILE* out, bool interactive, int64_t plain_every = 10);
  // True when `out` is a terminal.
  static bool IsTerminal(std::FILE* out);

  // Draws the bar (interactive) or prints a line when step % plain_every == 0 or
  // step == total (plain).
  void Update(const ProgressInfo& info);
  // Prints a line of its own (e.g. an evaluation result) without breaking the bar.
  void Print(std::string_view line);
  // Ends the bar's line (interactive).
  void Finish();

  // The text of one update, without control characters.
  static std::string FormatLine(const ProgressInfo& info, int bar_width);

 private:
  std::FILE* out_;
  bool interactive_;
  int64_t plain_every_;
  bool bar_visible_ = false;
  std::string last_line_;
};

}  // namespace switchyard::train
