// The SVG plotting helpers: tick selection, labels and the structure of rendered plots.
// Well-formedness of whole pages is checked by check_reports.py with a real XML parser.
#include "reports/writers/svg.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "reports/writers/xml_text.h"
#include "sample_record.h"

namespace meshproof::reports {
namespace {

using testing::occurrences;

TEST(SvgTest, NiceTicksUseOneTwoFiveSteps) {
  const svg::Ticks t = svg::nice_ticks(0.0, 9.3, 6);
  // raw step 9.3/6 = 1.55 -> 2; range [0, 10].
  EXPECT_DOUBLE_EQ(t.step, 2.0);
  EXPECT_DOUBLE_EQ(t.lo, 0.0);
  EXPECT_DOUBLE_EQ(t.hi, 10.0);
  EXPECT_EQ(t.values.size(), 6u);

  const svg::Ticks r = svg::nice_ticks(-0.0123, 0.0123, 6);
  // raw 0.0041 -> 0.005; range [-0.015, 0.015].
  EXPECT_NEAR(r.step, 0.005, 1e-15);
  EXPECT_NEAR(r.lo, -0.015, 1e-15);
  EXPECT_NEAR(r.hi, 0.015, 1e-15);

  const svg::Ticks big = svg::nice_ticks(1.0, 20.0, 8);  // raw 2.375 -> 5
  EXPECT_DOUBLE_EQ(big.step, 5.0);
  EXPECT_DOUBLE_EQ(big.lo, 0.0);
  EXPECT_DOUBLE_EQ(big.hi, 20.0);
}

TEST(SvgTest, NiceTicksHandleDegenerateRanges) {
  const svg::Ticks same = svg::nice_ticks(5.0, 5.0);
  EXPECT_LT(same.lo, 5.0);
  EXPECT_GT(same.hi, 5.0);
  const svg::Ticks zero = svg::nice_ticks(0.0, 0.0);
  EXPECT_LT(zero.lo, 0.0);
  EXPECT_GT(zero.hi, 0.0);
  const svg::Ticks nan = svg::nice_ticks(std::nan(""), 1.0);
  EXPECT_TRUE(std::isfinite(nan.lo) && std::isfinite(nan.hi));
}

TEST(SvgTest, TickLabelsAreShortAndExact) {
  EXPECT_EQ(svg::format_tick(0.30000000000000004, 0.1), "0.3");
  EXPECT_EQ(svg::format_tick(2e-6, 1e-6), "2e-06");
  EXPECT_EQ(svg::format_tick(1500, 500), "1500");
  EXPECT_EQ(svg::format_tick(1e-17, 0.1), "0");
  EXPECT_EQ(svg::format_tick(-0.25, 0.05), "-0.25");
}

TEST(SvgTest, LinePlotHasAxesTicksLegendAndBrokenLines) {
  svg::LinePlot p;
  p.title = "Loss <A&B>";
  p.x_label = "step";
  p.y_label = "loss";
  p.series.push_back({"run", {1, 2, 3, 4}, {3, 2, std::nan(""), 1}, "#123456", false, true});
  p.series.push_back({"golden", {1, 2, 3, 4}, {3, 2.1, 1.5, 1.1}, "#654321", true, false});
  p.bands.push_back({"band", {1, 2, 3, 4}, {-1, -1, -1, -1}, {4, 4, 4, 4}, "#00ff00"});
  const std::string s = svg::render_line_plot(p);
  EXPECT_EQ(s.rfind("<svg ", 0), 0u);
  EXPECT_EQ(occurrences(s, "<svg"), 1u);
  EXPECT_EQ(occurrences(s, "</svg>"), 1u);
  EXPECT_NE(s.find("Loss &lt;A&amp;B&gt;"), std::string::npos);  // title escaped
  // The NaN at step 3 splits "run" into two polylines; "golden" is one.
  EXPECT_EQ(occurrences(s, "stroke=\"#123456\" stroke-width=\"2\""), 2u + 1u);  // 2 lines + legend
  EXPECT_EQ(occurrences(s, "<polyline"), 3u);
  EXPECT_EQ(occurrences(s, "<circle"), 3u);  // markers on the 3 finite points
  EXPECT_EQ(occurrences(s, "<polygon"), 1u);
  EXPECT_NE(s.find("stroke-dasharray"), std::string::npos);
  EXPECT_NE(s.find(">step</text>"), std::string::npos);
  EXPECT_NE(s.find(">loss</text>"), std::string::npos);
  EXPECT_NE(s.find(">golden</text>"), std::string::npos);  // legend entry
  EXPECT_NE(s.find(">band</text>"), std::string::npos);
  // y range covers the band [-1, 4]: ticks at -1 .. 4 in steps of 1.
  EXPECT_NE(s.find(">-1</text>"), std::string::npos);
  EXPECT_NE(s.find(">4</text>"), std::string::npos);
  EXPECT_EQ(s.find("http://x"), std::string::npos);
}

TEST(SvgTest, LinePlotWithoutDataSaysSo) {
  svg::LinePlot p;
  p.title = "empty";
  p.series.push_back({"s", {1}, {std::nan("")}, "#000", false, false});
  const std::string s = svg::render_line_plot(p);
  EXPECT_NE(s.find("no data"), std::string::npos);
  EXPECT_EQ(occurrences(s, "<polyline"), 0u);
}

TEST(SvgTest, StackedBarsStackSegmentsAndDrawMarkers) {
  svg::StackedBars b;
  b.title = "mem";
  b.categories = {"0", "1"};
  b.segment_labels = {"a", "b"};
  b.segment_colors = {"#aa0000", "#00aa00"};
  b.values = {{1, 2}, {3, 0}};  // bar 0: 1 + 3, bar 1: 2 (+0 draws nothing)
  b.markers = {5, std::nan("")};
  b.marker_label = "peak";
  const std::string s = svg::render_stacked_bars(b);
  EXPECT_EQ(occurrences(s, "fill=\"#aa0000\"><title>"), 2u);
  EXPECT_EQ(occurrences(s, "fill=\"#00aa00\"><title>"), 1u);
  EXPECT_EQ(occurrences(s, "stroke-width=\"3\"><title>"), 1u);  // one marker
  EXPECT_NE(s.find(">peak</text>"), std::string::npos);
  // Axis max covers the marker (5): ticks 0..5.
  EXPECT_NE(s.find(">5</text>"), std::string::npos);
}

TEST(XmlTextTest, EscapesMarkupControlsAndInvalidUtf8) {
  EXPECT_EQ(xml_escape("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&#39;");
  EXPECT_EQ(xml_escape("x\x01y"), "x\xEF\xBF\xBDy");
  EXPECT_EQ(xml_escape("x\xffy"), "x\xEF\xBF\xBDy");
  EXPECT_EQ(xml_escape("\xC3\xA9"), "\xC3\xA9");  // valid UTF-8 (e-acute) passes through
  EXPECT_EQ(xml_escape("\xC3"), "\xEF\xBF\xBD");  // truncated sequence
  EXPECT_EQ(xml_escape("a\nb"), "a\nb");
  EXPECT_EQ(xml_escape_attr("a\nb\tc"), "a&#10;b&#9;c");
  EXPECT_EQ(sanitize_text("a<b\x02\xfe"), "a<b\xEF\xBF\xBD\xEF\xBF\xBD");
}

}  // namespace
}  // namespace meshproof::reports
