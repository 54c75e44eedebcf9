#include "switchyard/train/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "switchyard/core/limits.h"

namespace switchyard::train {

std::string FormatDuration(double s) {
  // Beyond ~3e11 years a duration means nothing; the bound keeps the conversion defined.
  if (!std::isfinite(s) || s < 0 || s > 1e19) return "-";
  const int64_t t = CheckedToInt64(std::round(s), "duration in seconds", 0, INT64_MAX);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

std::string FormatRate(double r) {
  if (!std::isfinite(r)) return "-";
  if (r >= 1e6) return fmt::format("{:.2f}M", r / 1e6);
  if (r >= 1e3) return fmt::format("{:.1f}k", r / 1e3);
  return fmt::format("{:.0f}", r);
}

ProgressBar::ProgressBar(std::FILE* out, bool interactive, int64_t plain_every)
    : out_(out), interactive_(interactive), plain_every_(std::max<int64_t>(1, plain_every)) {}

bool ProgressBar::IsTerminal(std::FILE* out) { return out != nullptr && isatty(fileno(out)); }

std::string ProgressBar::FormatLine(const ProgressInfo& info, int bar_width) {
  std::string line;
  if (bar_width > 0) {
    double frac = info.total > 0 ? static_cast<double>(info.step) / info.total : 0;
    if (!std::isfinite(frac)) frac = 0;
    const int filled = static_cast<int>(
        CheckedToInt64(std::floor(std::clamp(frac, 0.0, 1.0) * bar_width), "bar", 0, bar_width));
    // Appended piece by piece: `"[" + std::string(...)` trips a GCC 12 -Wrestrict false positive.
    line.push_back('[');
    line.append(static_cast<size_t>(filled), '#')
        .append(static_cast<size_t>(bar_width - filled), '-');
    line.append("] ");
  }
  int width = static_cast<int>(fmt::formatted_size("{}", info.total));
  line += fmt::format("step {:>{}}/{}", info.step, width, info.total);
  // Only figures that mean something: a value that is not known is left out, never "-".
  if (std::isfinite(info.ce_loss)) line += fmt::format("  ce_loss {:.4f}", info.ce_loss);
  if (std::isfinite(info.val_loss)) line += fmt::format("  val_ce_loss {:.4f}", info.val_loss);
  if (info.skipped_steps > 0) line += fmt::format("  skipped {}", info.skipped_steps);
  if (std::isfinite(info.tokens_per_s) && info.tokens_per_s > 0) {
    line += fmt::format("  {} tok/s", FormatRate(info.tokens_per_s));
  }
  if (std::isfinite(info.drop_rate)) line += fmt::format("  drop {:.1f}%", 100 * info.drop_rate);
  if (std::isfinite(info.eta_s) && info.eta_s >= 0) line += "  ETA " + FormatDuration(info.eta_s);
  return line;
}

void ProgressBar::Update(const ProgressInfo& info) {
  if (interactive_) {
    last_line_ = FormatLine(info, 24);
    fmt::print(out_, "\r{}\x1b[K", last_line_);
    bar_visible_ = true;
  } else if (info.step % plain_every_ == 0 || info.step == info.total) {
    fmt::print(out_, "{}\n", FormatLine(info, 0));
  }
  std::fflush(out_);
}

void ProgressBar::Print(std::string_view line) {
  if (interactive_ && bar_visible_) {
    fmt::print(out_, "\r\x1b[K{}\n{}", line, last_line_);
  } else {
    fmt::print(out_, "{}\n", line);
  }
  std::fflush(out_);
}

void ProgressBar::Finish() {
  if (interactive_ && bar_visible_) fmt::print(out_, "\n");
  bar_visible_ = false;
  std::fflush(out_);
}

}  // namespace switchyard::train
