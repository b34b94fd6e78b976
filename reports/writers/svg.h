// A small SVG plotting library for report.html: line plots (with an optional shaded band) and
// stacked bar charts, each with axes, 1-2-5 ticks, grid lines, axis labels, a title and a
// legend. Output is one self-contained <svg> element (XHTML-compatible, no scripts, no external
// references); hovering a point or bar shows its value through SVG <title> tooltips.
#pragma once

#include <string>
#include <vector>

namespace meshproof::reports::svg {

// Axis ticks: multiples of step (1, 2 or 5 times a power of ten) covering [lo, hi].
struct Ticks {
  double lo = 0;    // first tick (<= the data minimum)
  double hi = 1;    // last tick (>= the data maximum)
  double step = 1;  // tick spacing
  std::vector<double> values;
};
// About `target` ticks spanning [lo, hi]. Degenerate or non-finite ranges get a unit range
// around the value (or [0, 1]).
Ticks nice_ticks(double lo, double hi, int target = 6);
// A tick label: the value rounded to a multiple of step, shortest %g form ("0.25", "2e-06").
std::string format_tick(double value, double step);

struct Series {
  std::string label;
  std::vector<double> x;  // same length as y; non-finite y values break the line
  std::vector<double> y;
  std::string color = "#1f77b4";
  bool dashed = false;
  bool markers = false;  // draw a dot per point (with a value tooltip)
};

// A shaded region between lo and hi (e.g. a tolerance band), drawn under the series.
struct Band {
  std::string label;
  std::vector<double> x;
  std::vector<double> lo;
  std::vector<double> hi;
  std::string color = "#2ca02c";
};

struct LinePlot {
  std::string title;
  std::string x_label;
  std::string y_label;
  std::vector<Series> series;
  std::vector<Band> bands;
  int width = 660;  // two plots side by side in a 1400 px window
  int height = 320;
};
std::string render_line_plot(const LinePlot& plot);

// Bars of stacked segments: values[segment][category] >= 0 (negative/non-finite count as 0).
// markers[category], when given, draws a horizontal tick (e.g. the peak) over each bar.
struct StackedBars {
  std::string title;
  std::string x_label;
  std::string y_label;
  std::vector<std::string> categories;
  std::vector<std::string> segment_labels;
  std::vector<std::string> segment_colors;
  std::vector<std::vector<double>> values;
  std::vector<double> markers;  // empty or one per category; non-finite = no marker
  std::string marker_label;
  int width = 660;  // two plots side by side in a 1400 px window
  int height = 320;
};
std::string render_stacked_bars(const StackedBars& plot);

// A categorical palette (10 colours) for series and segments.
const std::string& palette(size_t i);

}  // namespace meshproof::reports::svg
