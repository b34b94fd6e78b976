#include "reports/writers/svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "reports/writers/xml_text.h"

namespace meshproof::reports::svg {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Plot-area geometry shared by both chart kinds.
struct Frame {
  double left = 76, right = 16, top = 0, bottom = 46;
  double width = 0, height = 0;
  double x0() const { return left; }
  double x1() const { return width - right; }
  double y0() const { return height - bottom; }  // bottom of the plot area (pixels grow down)
  double y1() const { return top; }
};

struct LegendItem {
  std::string label;
  std::string color;
  std::string shape;  // "line", "dash", "box", "tick"
};

// Approximate text width of 12px sans-serif, for legend layout.
double text_width(const std::string& s) { return 6.8 * static_cast<double>(s.size()); }

// Lays the legend out in rows under the title; returns the y where the plot area may start.
double legend(std::string& out, const std::vector<LegendItem>& items, double width, double y) {
  double x = 76;
  if (items.empty()) return y;
  for (const LegendItem& it : items) {
    const double w = 26 + text_width(it.label) + 18;
    if (x + w > width - 8 && x > 76) {
      x = 76;
      y += 18;
    }
    if (it.shape == "box") {
      out += fmt::format(R"(<rect x="{:.1f}" y="{:.1f}" width="14" height="10" fill="{}"/>)", x,
                         y - 9, it.color);
    } else if (it.shape == "tick") {
      out += fmt::format(
          R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="{}" stroke-width="3"/>)",
          x, y - 4, x + 14, y - 4, it.color);
    } else {
      out += fmt::format(
          R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="{}" stroke-width="2"{}/>)",
          x, y - 4, x + 20, y - 4, it.color,
          it.shape == "dash" ? R"( stroke-dasharray="6 3")" : "");
    }
    out += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="legend">{}</text>)", x + 26, y,
                       xml_escape(it.label));
    x += w;
  }
  return y + 14;
}

std::string open_svg(double width, double height, const std::string& title) {
  return fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{0}" height="{1}" viewBox="0 0 {0} {1}" )"
      R"(role="img" aria-label="{2}" font-family="sans-serif" font-size="12">)"
      R"(<title>{2}</title>)"
      R"(<style>.legend,.tick{{fill:#333}} .axis{{fill:#000}} .title{{font-weight:bold;font-size:14px}})"
      R"( .none{{fill:#888}}</style>)"
      R"(<rect x="0" y="0" width="{0}" height="{1}" fill="#ffffff"/>)"
      R"(<text x="{3:.1f}" y="18" text-anchor="middle" class="title">{2}</text>)",
      width, height, xml_escape(title), width / 2);
}

// Axes with grid lines, tick labels and axis labels. x_ticks may be empty (categorical axis).
void axes(std::string& out, const Frame& f, const Ticks& yt, const Ticks* xt,
          const std::string& x_label, const std::string& y_label) {
  auto ypix = [&](double v) { return f.y0() - (v - yt.lo) / (yt.hi - yt.lo) * (f.y0() - f.y1()); };
  for (double v : yt.values) {
    const double y = ypix(v);
    out +=
        fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="#e4e4e4"/>)",
                    f.x0(), y, f.x1(), y);
    out += fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="#000"/>)",
                       f.x0() - 5, y, f.x0(), y);
    out += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" text-anchor="end" class="tick">{}</text>)",
                       f.x0() - 8, y + 4, xml_escape(format_tick(v, yt.step)));
  }
  if (xt != nullptr) {
    for (double v : xt->values) {
      const double x = f.x0() + (v - xt->lo) / (xt->hi - xt->lo) * (f.x1() - f.x0());
      out +=
          fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="#e4e4e4"/>)",
                      x, f.y1(), x, f.y0());
      out += fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="#000"/>)",
                         x, f.y0(), x, f.y0() + 5);
      out +=
          fmt::format(R"(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" class="tick">{}</text>)",
                      x, f.y0() + 18, xml_escape(format_tick(v, xt->step)));
    }
  }
  // Axis lines last so that grid lines do not cover them.
  out += fmt::format(R"(<line x1="{0:.1f}" y1="{1:.1f}" x2="{0:.1f}" y2="{2:.1f}" stroke="#000"/>)",
                     f.x0(), f.y0(), f.y1());
  out += fmt::format(R"(<line x1="{0:.1f}" y1="{2:.1f}" x2="{1:.1f}" y2="{2:.1f}" stroke="#000"/>)",
                     f.x0(), f.x1(), f.y0());
  out += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" class="axis">{}</text>)",
                     (f.x0() + f.x1()) / 2, f.height - 8, xml_escape(x_label));
  const double cy = (f.y0() + f.y1()) / 2;
  out += fmt::format(
      R"svg(<text x="16" y="{0:.1f}" text-anchor="middle" class="axis" transform="rotate(-90 16 {0:.1f})">{1}</text>)svg",
      cy, xml_escape(y_label));
}

void extend(double v, double& lo, double& hi) {
  if (!std::isfinite(v)) return;
  lo = std::min(lo, v);
  hi = std::max(hi, v);
}

std::string no_data(std::string out, const Frame& f) {
  out +=
      fmt::format(R"(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" class="none">no data</text>)",
                  (f.x0() + f.x1()) / 2, (f.y0() + f.y1()) / 2);
  return out + "</svg>";
}

}  // namespace

const std::string& palette(size_t i) {
  static const std::vector<std::string> kColors = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                                   "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                                                   "#bcbd22", "#17becf"};
  return kColors[i % kColors.size()];
}

Ticks nice_ticks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (lo > hi) std::swap(lo, hi);
  if (hi - lo <= std::abs(hi) * 1e-12 || hi == lo) {
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  target = std::max(target, 2);
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (raw <= step * 1.0000001) break;
  }
  Ticks t;
  t.step = step;
  t.lo = std::floor(lo / step + 1e-9) * step;
  t.hi = std::ceil(hi / step - 1e-9) * step;
  if (t.hi <= t.lo) t.hi = t.lo + step;
  const long n = std::lround((t.hi - t.lo) / step);
  for (long i = 0; i <= n; ++i) t.values.push_back(t.lo + static_cast<double>(i) * step);
  return t;
}

std::string format_tick(double value, double step) {
  double r = step > 0 ? std::round(value / step) * step : value;
  if (std::abs(r) < step * 1e-6) r = 0;  // print 0, not 1e-17
  return fmt::format("{:g}", r);
}

std::string render_line_plot(const LinePlot& plot) {
  Frame f;
  f.width = plot.width;
  f.height = plot.height;
  std::string out = open_svg(f.width, f.height, plot.title);
  std::vector<LegendItem> items;
  for (const Band& b : plot.bands) items.push_back({b.label, b.color, "box"});
  for (const Series& s : plot.series)
    items.push_back({s.label, s.color, s.dashed ? "dash" : "line"});
  f.top = legend(out, items, f.width, 38) + 6;

  double xlo = kInf, xhi = -kInf, ylo = kInf, yhi = -kInf;
  for (const Series& s : plot.series) {
    for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      extend(s.x[i], xlo, xhi);
      extend(s.y[i], ylo, yhi);
    }
  }
  for (const Band& b : plot.bands) {
    for (size_t i = 0; i < b.x.size() && i < b.lo.size() && i < b.hi.size(); ++i) {
      extend(b.x[i], xlo, xhi);
      extend(b.lo[i], ylo, yhi);
      extend(b.hi[i], ylo, yhi);
    }
  }
  if (xlo > xhi) return no_data(out, f);
  const Ticks xt = nice_ticks(xlo, xhi, 8);
  const Ticks yt = nice_ticks(ylo, yhi, 6);
  auto px = [&](double v) { return f.x0() + (v - xt.lo) / (xt.hi - xt.lo) * (f.x1() - f.x0()); };
  auto py = [&](double v) { return f.y0() - (v - yt.lo) / (yt.hi - yt.lo) * (f.y0() - f.y1()); };
  axes(out, f, yt, &xt, plot.x_label, plot.y_label);

  for (const Band& b : plot.bands) {
    // Polygon: along hi left to right, back along lo; one polygon per finite run.
    const size_t n = std::min({b.x.size(), b.lo.size(), b.hi.size()});
    size_t i = 0;
    while (i < n) {
      while (i < n && !(std::isfinite(b.lo[i]) && std::isfinite(b.hi[i]))) ++i;
      const size_t start = i;
      while (i < n && std::isfinite(b.lo[i]) && std::isfinite(b.hi[i])) ++i;
      if (i == start) continue;
      std::string pts;
      for (size_t k = start; k < i; ++k)
        pts += fmt::format("{:.1f},{:.1f} ", px(b.x[k]), py(b.hi[k]));
      for (size_t k = i; k-- > start;)
        pts += fmt::format("{:.1f},{:.1f} ", px(b.x[k]), py(b.lo[k]));
      pts.pop_back();
      out += fmt::format(R"(<polygon points="{}" fill="{}" fill-opacity="0.18" stroke="{}" )"
                         R"(stroke-opacity="0.5"><title>{}</title></polygon>)",
                         pts, b.color, b.color, xml_escape(b.label));
    }
  }
  for (const Series& s : plot.series) {
    const size_t n = std::min(s.x.size(), s.y.size());
    std::string pts;
    auto flush = [&] {
      if (pts.empty()) return;
      pts.pop_back();
      out += fmt::format(R"(<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{}/>)",
                         pts, s.color, s.dashed ? R"( stroke-dasharray="6 3")" : "");
      pts.clear();
    };
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(s.y[i]) || !std::isfinite(s.x[i])) {
        flush();
        continue;
      }
      pts += fmt::format("{:.1f},{:.1f} ", px(s.x[i]), py(s.y[i]));
    }
    flush();
    if (s.markers) {
      for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(s.y[i]) || !std::isfinite(s.x[i])) continue;
        out += fmt::format(
            R"(<circle cx="{:.1f}" cy="{:.1f}" r="2.5" fill="{}"><title>{}: x={:g} y={:.6g}</title></circle>)",
            px(s.x[i]), py(s.y[i]), s.color, xml_escape(s.label), s.x[i], s.y[i]);
      }
    }
  }
  return out + "</svg>";
}

std::string render_stacked_bars(const StackedBars& plot) {
  Frame f;
  f.width = plot.width;
  f.height = plot.height;
  std::string out = open_svg(f.width, f.height, plot.title);
  std::vector<LegendItem> items;
  for (size_t s = 0; s < plot.segment_labels.size(); ++s) {
    const std::string& color = s < plot.segment_colors.size() ? plot.segment_colors[s] : palette(s);
    items.push_back({plot.segment_labels[s], color, "box"});
  }
  if (!plot.markers.empty()) items.push_back({plot.marker_label, "#000000", "tick"});
  f.top = legend(out, items, f.width, 38) + 6;

  const size_t n = plot.categories.size();
  if (n == 0) return no_data(out, f);
  auto val = [&](size_t s, size_t c) {
    if (s >= plot.values.size() || c >= plot.values[s].size()) return 0.0;
    const double v = plot.values[s][c];
    return std::isfinite(v) && v > 0 ? v : 0.0;
  };
  double ymax = 0;
  for (size_t c = 0; c < n; ++c) {
    double total = 0;
    for (size_t s = 0; s < plot.values.size(); ++s) total += val(s, c);
    ymax = std::max(ymax, total);
    if (c < plot.markers.size() && std::isfinite(plot.markers[c]))
      ymax = std::max(ymax, plot.markers[c]);
  }
  const Ticks yt = nice_ticks(0, ymax > 0 ? ymax : 1, 6);
  auto py = [&](double v) { return f.y0() - (v - yt.lo) / (yt.hi - yt.lo) * (f.y0() - f.y1()); };
  axes(out, f, yt, nullptr, plot.x_label, plot.y_label);

  const double slot = (f.x1() - f.x0()) / static_cast<double>(n);
  const double bar = std::max(1.0, slot * 0.7);
  // Label every k-th category so that labels do not overlap (about 44 px per label).
  size_t longest = 1;
  for (const std::string& c : plot.categories) longest = std::max(longest, c.size());
  const double label_px = std::max(30.0, text_width(std::string(longest, 'x')) + 10);
  const size_t every = std::max<size_t>(1, static_cast<size_t>(std::ceil(label_px / slot)));
  for (size_t c = 0; c < n; ++c) {
    const double x = f.x0() + slot * static_cast<double>(c) + (slot - bar) / 2;
    double base = 0;
    for (size_t s = 0; s < plot.values.size(); ++s) {
      const double v = val(s, c);
      const std::string& label = s < plot.segment_labels.size() ? plot.segment_labels[s] : "";
      if (v <= 0) continue;
      const std::string& color =
          s < plot.segment_colors.size() ? plot.segment_colors[s] : palette(s);
      out += fmt::format(
          R"(<rect x="{:.2f}" y="{:.2f}" width="{:.2f}" height="{:.2f}" fill="{}"><title>{}: {} {:.4g}</title></rect>)",
          x, py(base + v), bar, py(base) - py(base + v), color, xml_escape(plot.categories[c]),
          xml_escape(label), v);
      base += v;
    }
    if (c < plot.markers.size() && std::isfinite(plot.markers[c])) {
      const double y = py(plot.markers[c]);
      out += fmt::format(
          R"(<line x1="{:.2f}" y1="{:.2f}" x2="{:.2f}" y2="{:.2f}" stroke="#000" stroke-width="3"><title>{}: {} {:.4g}</title></line>)",
          x - 2, y, x + bar + 2, y, xml_escape(plot.categories[c]), xml_escape(plot.marker_label),
          plot.markers[c]);
    }
    if (c % every == 0) {
      const double cx = x + bar / 2;
      out += fmt::format(
          R"(<line x1="{0:.1f}" y1="{1:.1f}" x2="{0:.1f}" y2="{2:.1f}" stroke="#000"/>)", cx,
          f.y0(), f.y0() + 5);
      out +=
          fmt::format(R"(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" class="tick">{}</text>)",
                      cx, f.y0() + 18, xml_escape(plot.categories[c]));
    }
  }
  return out + "</svg>";
}

}  // namespace meshproof::reports::svg
