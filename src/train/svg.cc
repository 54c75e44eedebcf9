#include "switchyard/train/svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace switchyard::train {

std::string EscapeXml(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

SvgWriter::SvgWriter(double width, double height) : width_(width), height_(height) {}

void SvgWriter::Line(double x1, double y1, double x2, double y2, std::string_view stroke,
                     double stroke_width, std::string_view dash) {
  body_ += fmt::format(
      "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" "
      "stroke-width=\"{}\"{}/>\n",
      x1, y1, x2, y2, EscapeXml(stroke), stroke_width,
      dash.empty() ? "" : fmt::format(" stroke-dasharray=\"{}\"", EscapeXml(dash)));
}

void SvgWriter::Polyline(const std::vector<double>& xy, std::string_view stroke,
                         double stroke_width) {
  if (xy.size() < 4) return;
  std::string pts;
  for (size_t i = 0; i + 1 < xy.size(); i += 2) {
    pts += fmt::format("{}{:.1f},{:.1f}", i ? " " : "", xy[i], xy[i + 1]);
  }
  body_ += fmt::format(
      "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{}\" "
      "stroke-linejoin=\"round\"/>\n",
      pts, EscapeXml(stroke), stroke_width);
}

void SvgWriter::Rect(double x, double y, double w, double h, std::string_view fill,
                     std::string_view stroke, std::string_view title) {
  std::string attrs =
      fmt::format("x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"{}\"", x, y,
                  w, h, EscapeXml(fill));
  if (stroke != "none") attrs += fmt::format(" stroke=\"{}\"", EscapeXml(stroke));
  if (title.empty()) {
    body_ += fmt::format("<rect {}/>\n", attrs);
  } else {
    body_ += fmt::format("<rect {}><title>{}</title></rect>\n", attrs, EscapeXml(title));
  }
}

void SvgWriter::Text(double x, double y, std::string_view text, double size,
                     std::string_view anchor, std::string_view fill, double rotate) {
  std::string transform =
      rotate != 0 ? fmt::format(" transform=\"rotate({} {:.1f} {:.1f})\"", rotate, x, y) : "";
  body_ += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"{}\" text-anchor=\"{}\" fill=\"{}\"{}>{}"
      "</text>\n",
      x, y, size, EscapeXml(anchor), EscapeXml(fill), transform, EscapeXml(text));
}

std::string SvgWriter::str() const {
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\">\n"
      "<rect x=\"0\" y=\"0\" width=\"{0}\" height=\"{1}\" fill=\"#ffffff\"/>\n{2}</svg>\n",
      width_, height_, body_);
}

std::vector<double> NiceTicks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {};
  if (hi < lo) std::swap(lo, hi);
  if (hi == lo) return {lo};
  double raw = (hi - lo) / std::max(1, target);
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  }
  std::vector<double> ticks;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) {
    ticks.push_back(std::abs(v) < step * 1e-9 ? 0.0 : v);
  }
  return ticks;
}

std::string TickLabel(double v) {
  double a = std::abs(v);
  if (a >= 1e6) return fmt::format("{:g}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:g}k", v / 1e3);
  return fmt::format("{:g}", std::round(v * 1e6) / 1e6);
}

namespace {

struct Frame {
  double left = 70, right = 20, top = 40, bottom = 50;
};

}  // namespace

std::string LinePlotSvg(const std::vector<PlotSeries>& series, const LinePlotOptions& o) {
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin;
  double ymin = xmin, ymax = -xmin;
  for (const auto& s : series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      xmin = std::min(xmin, s.x[i]);
      xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]);
      ymax = std::max(ymax, s.y[i]);
    }
  }
  for (const auto& r : o.reference_lines) {
    if (!std::isfinite(r.y)) continue;
    ymin = std::min(ymin, r.y);
    ymax = std::max(ymax, r.y);
  }
  bool empty = !std::isfinite(xmin) || !std::isfinite(ymin);
  if (empty) xmin = 0, xmax = 1, ymin = 0, ymax = 1;
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) ymax = ymin + 1;
  double ypad = 0.05 * (ymax - ymin);
  ymin -= ypad;
  ymax += ypad;

  Frame f;
  SvgWriter svg(o.width, o.height);
  double pw = o.width - f.left - f.right, ph = o.height - f.top - f.bottom;
  auto px = [&](double x) { return f.left + (x - xmin) / (xmax - xmin) * pw; };
  auto py = [&](double y) { return f.top + (1 - (y - ymin) / (ymax - ymin)) * ph; };

  svg.Text(o.width / 2, 24, o.title, 16, "middle");
  for (double t : NiceTicks(ymin, ymax)) {
    svg.Line(f.left, py(t), f.left + pw, py(t), "#e6e6e6");
    svg.Text(f.left - 6, py(t) + 4, TickLabel(t), 11, "end", "#444");
  }
  for (double t : NiceTicks(xmin, xmax)) {
    svg.Line(px(t), f.top, px(t), f.top + ph, "#f0f0f0");
    svg.Text(px(t), f.top + ph + 16, TickLabel(t), 11, "middle", "#444");
  }
  svg.Rect(f.left, f.top, pw, ph, "none", "#888");
  svg.Text(f.left + pw / 2, o.height - 10, o.x_label, 12, "middle");
  svg.Text(16, f.top + ph / 2, o.y_label, 12, "middle", "#222", -90);
  if (empty) svg.Text(f.left + pw / 2, f.top + ph / 2, "no data yet", 14, "middle", "#888");

  for (const auto& r : o.reference_lines) {
    if (!std::isfinite(r.y)) continue;
    svg.Line(f.left, py(r.y), f.left + pw, py(r.y), r.color, 1.2, "6,4");
    svg.Text(f.left + 6, py(r.y) - 5, r.label, 11, "start", r.color);
  }
  for (const auto& s : series) {
    std::vector<double> pts;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) {
        svg.Polyline(pts, s.color);
        pts.clear();
        continue;
      }
      pts.push_back(px(s.x[i]));
      pts.push_back(py(s.y[i]));
    }
    if (pts.size() == 2) {  // a single point: draw a dot
      svg.Rect(pts[0] - 2, pts[1] - 2, 4, 4, s.color);
    }
    svg.Polyline(pts, s.color);
  }
  // Legend, top right inside the plot.
  double ly = f.top + 16;
  for (const auto& s : series) {
    svg.Line(f.left + pw - 150, ly - 4, f.left + pw - 126, ly - 4, s.color, 3);
    svg.Text(f.left + pw - 120, ly, s.name, 12);
    ly += 18;
  }
  return svg.str();
}

namespace {

// A sequential color scale (viridis stops), t in [0, 1].
std::string ScaleColor(double t) {
  static constexpr double kStops[][3] = {
      {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0) * 4;
  int i = std::min(3, static_cast<int>(t));
  double u = t - i;
  int c[3];
  for (int k = 0; k < 3; ++k) {
    c[k] = static_cast<int>(std::lround(kStops[i][k] + u * (kStops[i + 1][k] - kStops[i][k])));
  }
  return fmt::format("#{:02x}{:02x}{:02x}", c[0], c[1], c[2]);
}

}  // namespace

std::string HeatmapSvg(const std::vector<HeatmapPanel>& panels, const std::vector<double>& columns,
                       const HeatmapOptions& o) {
  Frame f;
  f.right = 90;  // color bar
  const double row_h = 14, panel_gap = 34;
  double vmax = 0;
  for (const auto& p : panels) {
    for (const auto& row : p.values) {
      for (double v : row) {
        if (std::isfinite(v)) vmax = std::max(vmax, v);
      }
    }
  }
  double height = f.top + f.bottom;
  for (const auto& p : panels) height += panel_gap + row_h * static_cast<double>(p.values.size());
  height = std::max(height, 160.0);
  SvgWriter svg(o.width, height);
  svg.Text(o.width / 2, 24, o.title, 16, "middle");
  double pw = o.width - f.left - f.right;
  size_t ncols = columns.size();
  if (panels.empty() || ncols == 0) {
    svg.Text(o.width / 2, height / 2, "no MoE layers / no data yet", 14, "middle", "#888");
    return svg.str();
  }
  double cw = pw / static_cast<double>(ncols);
  double y = f.top;
  for (const auto& p : panels) {
    y += panel_gap;
    svg.Text(f.left, y - 8, p.title, 12);
    for (size_t r = 0; r < p.values.size(); ++r) {
      const auto& row = p.values[r];
      for (size_t c = 0; c < ncols && c < row.size(); ++c) {
        svg.Rect(f.left + cw * static_cast<double>(c), y + row_h * static_cast<double>(r),
                 cw + 0.05, row_h, ScaleColor(vmax > 0 ? row[c] / vmax : 0), "none",
                 fmt::format("{} {} {} {}: {} {}", o.x_label, TickLabel(columns[c]), o.row_label, r,
                             TickLabel(row[c]), o.value_label));
      }
      if (p.values.size() <= 16 || r % 4 == 0) {
        svg.Text(f.left - 6, y + row_h * (static_cast<double>(r) + 0.75), std::to_string(r), 10,
                 "end", "#444");
      }
    }
    y += row_h * static_cast<double>(p.values.size());
  }
  // Column axis under the last panel.
  double cmin = columns.front(), cmax = columns.back();
  for (double t : NiceTicks(cmin, cmax)) {
    double frac = cmax > cmin ? (t - cmin) / (cmax - cmin) : 0;
    double x = f.left + cw * (0.5 + frac * static_cast<double>(ncols - 1));
    svg.Line(x, y, x, y + 4, "#444");
    svg.Text(x, y + 16, TickLabel(t), 11, "middle", "#444");
  }
  svg.Text(f.left + pw / 2, y + 34, o.x_label, 12, "middle");
  svg.Text(16, f.top + (y - f.top) / 2, o.row_label, 12, "middle", "#222", -90);
  // Color bar.
  double bx = f.left + pw + 24, by = f.top + panel_gap, bh = std::max(60.0, y - by);
  for (int i = 0; i < 32; ++i) {
    svg.Rect(bx, by + bh * (1 - (i + 1) / 32.0), 14, bh / 32.0 + 0.05, ScaleColor(i / 31.0));
  }
  svg.Text(bx + 18, by + 8, TickLabel(vmax), 10);
  svg.Text(bx + 18, by + bh, "0", 10);
  svg.Text(bx + 7, by - 8, o.value_label, 10, "middle");
  return svg.str();
}

}  // namespace switchyard::train
