// A tiny SVG writer (no dependencies) and the two figures of a run directory: a line plot
// (loss.svg: train and val loss over steps, with reference lines such as the unigram entropy)
// and a heatmap (expert_load.svg: tokens per expert per MoE layer over steps).
//
// Output is a complete standalone SVG 1.1 document; text is XML-escaped. Non-finite values
// are skipped (a line breaks there). Thread-safety: plain values, no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace switchyard::train {

// "&<>\"'" escaped for XML text and attribute values.
std::string EscapeXml(std::string_view text);

class SvgWriter {
 public:
  SvgWriter(double width, double height);

  void Line(double x1, double y1, double x2, double y2, std::string_view stroke,
            double stroke_width = 1, std::string_view dash = "");
  // Points as x0, y0, x1, y1, ...; fewer than two points draw nothing.
  void Polyline(const std::vector<double>& xy, std::string_view stroke, double stroke_width = 1.5);
  // `title` (optional) becomes a tooltip.
  void Rect(double x, double y, double w, double h, std::string_view fill,
            std::string_view stroke = "none", std::string_view title = "");
  // anchor: "start" | "middle" | "end"; rotate in degrees around (x, y).
  void Text(double x, double y, std::string_view text, double size = 12,
            std::string_view anchor = "start", std::string_view fill = "#222", double rotate = 0);

  // The document.
  std::string str() const;

 private:
  double width_;
  double height_;
  std::string body_;
};

// Tick positions: about `target` round numbers (1, 2, 5 x 10^k steps) covering [lo, hi].
std::vector<double> NiceTicks(double lo, double hi, int target = 6);
// Short tick label: "0.5", "1200", "1.5k", "2M".
std::string TickLabel(double v);

struct PlotSeries {
  std::string name;
  std::string color;  // CSS color
  std::vector<double> x;
  std::vector<double> y;  // same length as x
};

struct ReferenceLine {
  std::string label;
  double y = 0;
  std::string color = "#888";
};

struct LinePlotOptions {
  std::string title;
  std::string x_label = "step";
  std::string y_label;
  double width = 760;
  double height = 440;
  std::vector<ReferenceLine> reference_lines;  // horizontal dashed lines
};

std::string LinePlotSvg(const std::vector<PlotSeries>& series, const LinePlotOptions& options);

// One heatmap panel: values[row][column], e.g. rows = experts of one layer, columns = steps.
struct HeatmapPanel {
  std::string title;
  std::vector<std::vector<double>> values;
};

struct HeatmapOptions {
  std::string title;
  std::string x_label = "step";
  std::string row_label = "expert";
  std::string value_label = "tokens";
  double width = 760;
};

// Panels stacked vertically sharing the column axis `columns` (e.g. the logged steps, one per
// column of every panel) and one color scale from 0 to the largest value.
std::string HeatmapSvg(const std::vector<HeatmapPanel>& panels, const std::vector<double>& columns,
                       const HeatmapOptions& options);

}  // namespace switchyard::train
