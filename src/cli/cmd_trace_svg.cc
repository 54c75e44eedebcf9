// `switchyard trace-svg`: draws a Chrome trace-event file written by `--trace` (parallel/trace.h)
// as an SVG timeline: one row per track (rank x compute / comm), one box per event, coloured by
// what it is (token sends and returns, expert compute, other collectives, the rest), with the
// event's name, duration and arguments as a tooltip. For docs and for looking at overlap without
// a trace viewer.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cli/command.h"
#include "cli/flags.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/json.h"
#include "switchyard/core/limits.h"
#include "switchyard/train/svg.h"

namespace switchyard::cli {
namespace {

struct TraceSvgOptions {
  std::string in_path;
  std::string out_path;
  double width = 1400;
  std::string category = "all";  // forward | backward | sync | all
  std::string title;
  std::string positional_in, positional_out;  // `trace-svg TRACE SVG`
};

// The positional form fills what the flags left empty (with --trace given, a lone positional is
// the output); both forms naming different files, or neither naming one, is an error.
void ResolvePositionals(TraceSvgOptions& o) {
  // `--trace T.json OUT.svg`: the one positional is the output.
  if (!o.in_path.empty() && o.out_path.empty() && !o.positional_in.empty() &&
      o.positional_out.empty()) {
    std::swap(o.positional_in, o.positional_out);
  }
  for (auto [flag, value, positional] : {std::tuple<const char*, std::string*, const std::string*>{
                                             "--trace", &o.in_path, &o.positional_in},
                                         std::tuple<const char*, std::string*, const std::string*>{
                                             "--out", &o.out_path, &o.positional_out}}) {
    if (value->empty()) {
      *value = *positional;
    } else {
      SY_REQUIRE(positional->empty() || *positional == *value, InvalidArgument,
                 "trace-svg: {} {} and the positional argument '{}' name different files; give "
                 "one of them",
                 flag, *value, *positional);
    }
    SY_REQUIRE(!value->empty(), InvalidArgument,
               "trace-svg: {} PATH is required (or the older form: trace-svg TRACE SVG)", flag);
  }
}

struct Box {
  int tid = 0;
  std::string name, category, tooltip;
  double ts = 0, dur = 0;  // microseconds
};

// Colour by kind of event.
std::string_view ColourOf(const std::string& name) {
  if (name.starts_with("send c")) return "#3b7dd8";
  if (name.starts_with("return c")) return "#19a3a3";
  if (name.starts_with("experts c") || name.starts_with("shadow experts")) return "#e8833a";
  if (name.starts_with("broadcast") || name.starts_with("reduce e")) return "#c94f7c";
  if (name.find("routing") != std::string::npos || name.find("weights") != std::string::npos ||
      name.find("tensor") != std::string::npos) {
    return "#8e6bbf";
  }
  return "#9aa5b1";
}

constexpr uint64_t kMemoryPerTraceByte = 24;

// Timestamps and durations in microseconds: at most about 31 years, so that the time axis (and
// its tick loop) stays finite.
constexpr double kMaxTraceMicros = 1e15;

// One event's fields, each checked for its type (docs/formats.md, "Trace files"): a field of the
// wrong type is an error naming the event and the key, never a raw nlohmann type_error.
class EventFields {
 public:
  EventFields(const nlohmann::json& e, const std::string& file, size_t index)
      : e_(e), file_(file), index_(index) {}

  // The string `key` of `in` (the event, or an object inside it named `label` in messages).
  std::string Text(const char* key, const nlohmann::json& in, std::string fallback,
                   const char* label) const {
    if (!in.contains(key)) return fallback;
    Require(in[key].is_string(), label, in[key], "a string");
    return in[key].get<std::string>();
  }
  std::string Text(const char* key, std::string fallback = "") const {
    return Text(key, e_, std::move(fallback), key);
  }
  // A finite number in [lo, kMaxTraceMicros]; `fallback` when absent.
  double Micros(const char* key, double lo, double fallback) const {
    if (!e_.contains(key)) return fallback;
    const nlohmann::json& v = e_[key];
    Require(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= lo &&
                v.get<double>() <= kMaxTraceMicros,
            key, v, fmt::format("a number of microseconds in [{:g}, {:g}]", lo, kMaxTraceMicros));
    return v.get<double>();
  }
  int Tid() const {
    const nlohmann::json& v = e_["tid"];
    Require(v.is_number_integer() && v.get<int64_t>() >= std::numeric_limits<int>::min() &&
                v.get<int64_t>() <= std::numeric_limits<int>::max(),
            "tid", v, "an integer that fits in 32 bits");
    return static_cast<int>(v.get<int64_t>());
  }
  void Require(bool ok, const char* key, const nlohmann::json& value,
               std::string_view expected) const {
    if (ok) return;
    std::string shown = value.dump();
    if (shown.size() > 60) shown = shown.substr(0, 60) + "...";
    throw InvalidArgument(fmt::format("{}: traceEvents[{}]: \"{}\" is {}; expected {}", file_,
                                      index_, key, shown, expected));
  }

 private:
  const nlohmann::json& e_;
  const std::string& file_;
  size_t index_;
};

int RunTraceSvg(const TraceSvgOptions& o) {
  RequireDistinctOutput({"output", o.out_path}, {{"input", o.in_path}});
  // Strict: malformed JSON or a key repeated in one object is an error (core/json.h).
  const std::string text = ReadTextFile(o.in_path);
  // The parsed events, their boxes and the picture take about 20 bytes per byte of the trace
  // (measured: 24.7 MB of JSON, 472 MB at the peak).
  RequireMemory(static_cast<uint64_t>(text.size()) * kMemoryPerTraceByte,
                fmt::format("trace-svg: the {} of '{}' (about {} bytes of memory per byte)",
                            FormatBytes(text.size()), o.in_path, kMemoryPerTraceByte));
  const nlohmann::json j = ParseJsonStrict(text, o.in_path);
  SY_REQUIRE(j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array(),
             InvalidArgument, "{}: expected a Chrome trace-event object with \"traceEvents\"",
             o.in_path);
  std::map<int, std::string> tracks;
  std::vector<Box> boxes;
  const nlohmann::json& events = j["traceEvents"];
  for (size_t i = 0; i < events.size(); ++i) {
    const nlohmann::json& e = events[i];
    if (!e.is_object() || !e.contains("ph") || !e.contains("tid")) continue;
    const EventFields f(e, o.in_path, i);
    const int tid = f.Tid();
    const std::string ph = f.Text("ph");
    if (ph == "M") {
      if (f.Text("name") == "thread_name") {
        const std::string fallback = fmt::format("tid {}", tid);
        tracks[tid] = e.contains("args") && e["args"].is_object()
                          ? f.Text("name", e["args"], fallback, "args.name")
                          : fallback;
      }
      continue;
    }
    if (ph != "X") continue;
    Box b;
    b.tid = tid;
    b.name = f.Text("name");
    b.category = f.Text("cat");
    if (o.category != "all" && b.category != o.category) continue;
    b.ts = f.Micros("ts", -kMaxTraceMicros, 0.0);
    b.dur = f.Micros("dur", 0.0, 0.0);
    b.tooltip =
        fmt::format("{} ({}): {:.3f} ms at {:.3f} ms", b.name, b.category, b.dur / 1e3, b.ts / 1e3);
    if (e.contains("args") && e["args"].is_object()) {
      for (const auto& [k, v] : e["args"].items()) {
        if (k != "rank" && k != "stream") b.tooltip += fmt::format(", {} {}", k, v.dump());
      }
    }
    if (!tracks.count(tid)) tracks[tid] = fmt::format("tid {}", tid);
    boxes.push_back(std::move(b));
  }
  SY_REQUIRE(!boxes.empty(), InvalidArgument, "{}: no events{}", o.in_path,
             o.category == "all" ? "" : fmt::format(" of category '{}'", o.category));
  double t0 = boxes[0].ts, t1 = boxes[0].ts + boxes[0].dur;
  for (const Box& b : boxes) {
    t0 = std::min(t0, b.ts);
    t1 = std::max(t1, b.ts + b.dur);
  }
  const double span = std::max(1.0, t1 - t0);
  const double left = 130, right = 20, top = 40, row = 26, gap = 6;
  const double height = top + static_cast<double>(tracks.size()) * (row + gap) + 60;
  train::SvgWriter svg(o.width, height);
  const double plot_w = o.width - left - right;
  auto x_of = [&](double us) { return left + (us - t0) / span * plot_w; };
  svg.Text(left, 22, o.title.empty() ? fmt::format("{} ({})", o.in_path, o.category) : o.title, 14);
  std::map<int, double> y_of;
  double y = top;
  for (const auto& [tid, name] : tracks) {
    y_of[tid] = y;
    svg.Rect(left, y, plot_w, row, tid % 2 ? "#f4f6f8" : "#fbfcfd");
    svg.Text(left - 8, y + row * 0.65, name, 12, "end");
    y += row + gap;
  }
  // Time axis: about 10 ticks at a round step.
  const double raw = span / 1e3 / 10;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step_ms = raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
  for (double ms = 0; ms <= span / 1e3 + 1e-9; ms += step_ms) {
    const double x = x_of(t0 + ms * 1e3);
    svg.Line(x, top - 4, x, y, "#d0d5db", 0.5, "2,3");
    svg.Text(x, y + 16, fmt::format("{:g} ms", ms), 10, "middle", "#555");
  }
  for (const Box& b : boxes) {
    const double x = x_of(b.ts);
    const double w = std::max(0.5, b.dur / span * plot_w);
    const bool backward = b.category == "backward";
    svg.Rect(x, y_of[b.tid] + (backward ? 3 : 1), w, row - (backward ? 6 : 2), ColourOf(b.name),
             backward ? "#333" : "#ffffff", b.tooltip);
    if (w > 7.0 * static_cast<double>(b.name.size())) {
      svg.Text(x + w / 2, y_of[b.tid] + row * 0.65, b.name, 10, "middle", "#fff");
    }
  }
  // Legend.
  double lx = left;
  const double ly = y + 30;
  for (auto [label, colour] :
       std::vector<std::pair<std::string, std::string>>{{"send (tokens to experts)", "#3b7dd8"},
                                                        {"experts", "#e8833a"},
                                                        {"return (outputs back)", "#19a3a3"},
                                                        {"shadow broadcast / reduce", "#c94f7c"},
                                                        {"other collectives", "#8e6bbf"},
                                                        {"gate, encode, decode, ...", "#9aa5b1"}}) {
    svg.Rect(lx, ly - 10, 12, 12, colour);
    svg.Text(lx + 16, ly, label, 11);
    lx += 20 + 7.0 * static_cast<double>(label.size());
  }
  svg.Text(o.width - right, ly, "outlined: backward", 11, "end", "#555");
  WriteTextFileAtomic(o.out_path, svg.str());
  fmt::print("trace-svg: {} events on {} tracks, {:.2f} ms -> {}\n", boxes.size(), tracks.size(),
             span / 1e3, o.out_path);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "trace-svg", "Draw a --trace file (Chrome trace-event JSON) as an SVG timeline",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<TraceSvgOptions>();
      // --trace / --out, or the older positional form `trace-svg TRACE SVG`.
      app.add_option("--trace", o->in_path, "trace JSON written by --trace")->type_name("PATH");
      app.add_option("--out", o->out_path, "SVG file to write")->type_name("PATH");
      app.add_option("TRACE", o->positional_in, "the trace, as a positional argument (= --trace)")
          ->type_name("PATH");
      app.add_option("SVG", o->positional_out, "the SVG file, as a positional argument (= --out)")
          ->type_name("PATH");
      app.add_option("--width", o->width, "picture width in pixels")->check(FiniteIn(200, 20000));
      app.add_option("--category", o->category, "forward | backward | sync | all")
          ->check(CLI::IsMember({"forward", "backward", "sync", "all"}));
      app.add_option("--title", o->title, "title line (default: the file and category)");
      return [o] {
        ResolvePositionals(*o);
        return RunTraceSvg(*o);
      };
    }});

}  // namespace
}  // namespace switchyard::cli
