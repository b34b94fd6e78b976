#include "reports/record/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "reports/record/report_error.h"
#include "reports/record/run_record.h"
#include "reports/writers/xml_text.h"

namespace meshproof::reports {
namespace {

// A number at `key` of object `o` (path for messages); null -> nullopt; wrong type -> error.
std::optional<double> number(const nlohmann::json& o, const char* key, const std::string& path) {
  if (!o.is_object() || !o.contains(key))
    input_error(fmt::format("{}: missing key '{}'", path, key));
  const nlohmann::json& v = o.at(key);
  if (v.is_null()) return std::nullopt;
  if (!v.is_number())
    input_error(fmt::format("{}.{}: expected a number, got {}", path, key, v.type_name()));
  return v.get<double>();
}

const nlohmann::json& field(const nlohmann::json& o, const char* key, const std::string& path) {
  if (!o.is_object() || !o.contains(key))
    input_error(fmt::format("{}: missing key '{}'", path, key));
  return o.at(key);
}

std::string string_field(const nlohmann::json& o, const char* key, const std::string& path) {
  const nlohmann::json& v = field(o, key, path);
  if (!v.is_string())
    input_error(fmt::format("{}.{}: expected a string, got {}", path, key, v.type_name()));
  return v.get<std::string>();
}

// One figure of one scenario as compare sees it.
struct Figure {
  std::string name;
  std::optional<double> value;
  std::optional<NoiseRange> range;
  bool higher_is_better = true;
};

// `range` of a figure that is inversely proportional to a time measured as `time` (median) within
// `time_range` (throughput, TFLOP/s, MFU): value * median / slowest .. value * median / fastest.
std::optional<NoiseRange> inverse_range(const std::optional<double>& value, double time,
                                        const std::optional<NoiseRange>& time_range) {
  if (!value || !time_range || time_range->min <= 0 || time <= 0) return std::nullopt;
  return NoiseRange{*value * time / time_range->max, *value * time / time_range->min};
}

// The steady-state steps' fastest and slowest step time of a run scenario (ms, checkpoint saves
// left out), the noise of its median step time; nullopt without per-step times.
std::optional<NoiseRange> step_time_range(const nlohmann::json& s, int64_t warmup,
                                          const std::string& path) {
  if (!s.contains("steps") || !s.at("steps").is_array()) return std::nullopt;
  const nlohmann::json& steps = s.at("steps");
  std::optional<NoiseRange> r;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(0, warmup)); i < steps.size(); ++i) {
    const std::string sp = fmt::format("{}.steps[{}]", path, i);
    const nlohmann::json& time = field(steps[i], "time", sp);
    const std::optional<double> t = number(time, "total_s", sp + ".time");
    if (!t) continue;
    // A checkpoint save is scheduled work, not noise: the steps that save are measured without it.
    const double ms = (*t - number(time, "checkpoint_s", sp + ".time").value_or(0)) * 1e3;
    if (!r) r = NoiseRange{ms, ms};
    r->min = std::min(r->min, ms);
    r->max = std::max(r->max, ms);
  }
  return r;
}

// The figures of one scenario, each name once, in display order: performance (runs), bus
// bandwidth per collective, benchmark figures (bench reports). A bench scenario's layer figures
// (step time, tokens/s, TFLOP/s) are its benchmark figures, with their measured range; its
// performance block repeats them and only contributes the MFU.
// The range of a figure's "samples" (every timed repetition) without the fastest and the slowest
// fifth (at least one each), when there are at least kTrimmedMinSamples; nullopt otherwise (the
// min/max rule).
constexpr size_t kTrimmedMinSamples = 5;
std::optional<NoiseRange> trimmed_range(const nlohmann::json& f, const std::string& path) {
  if (!f.contains("samples")) return std::nullopt;
  const nlohmann::json& a = f.at("samples");
  if (!a.is_array()) input_error(fmt::format("{}.samples: expected an array", path));
  std::vector<double> v;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].is_number()) {
      input_error(
          fmt::format("{}.samples[{}]: expected a number, got {}", path, i, a[i].type_name()));
    }
    v.push_back(a[i].get<double>());
  }
  if (v.size() < kTrimmedMinSamples) return std::nullopt;
  std::sort(v.begin(), v.end());
  const size_t trim = std::max<size_t>(1, v.size() / 5);
  return NoiseRange{v[trim], v[v.size() - 1 - trim]};
}

std::vector<Figure> figures(const nlohmann::json& s, const std::string& path) {
  std::vector<Figure> out;
  auto add = [&out](Figure f) {
    for (const Figure& g : out) {
      if (g.name == f.name) return;  // each metric once per scenario
    }
    out.push_back(std::move(f));
  };
  const bool bench = s.is_object() && s.contains("benchmarks") && s.at("benchmarks").is_array() &&
                     !s.at("benchmarks").empty();
  std::optional<NoiseRange> layer_time_range;  // bench: the layer step's, for the MFU
  std::vector<Figure> bench_figures;
  if (bench) {
    const nlohmann::json& list = s.at("benchmarks");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string bp = fmt::format("{}.benchmarks[{}]", path, i);
      Figure f;
      const std::string name = string_field(list[i], "name", bp);
      const std::string metric = string_field(list[i], "metric", bp);
      f.name = fmt::format("{} {}", name, metric);
      f.value = number(list[i], "value", bp);
      // Reports written before min/max existed have no keys: no measured noise.
      const std::optional<double> lo =
          list[i].contains("min") ? number(list[i], "min", bp) : std::nullopt;
      const std::optional<double> hi =
          list[i].contains("max") ? number(list[i], "max", bp) : std::nullopt;
      if (lo && hi) f.range = NoiseRange{*lo, *hi};
      // With the raw repetitions kept (bench recipes), the noise is their range without the
      // fastest and slowest fifth: repetitions another process delayed must not hide a 2x change
      // (measured on the shared 2-core machine: 2 of 7 layer steps at 4.9 and 15 ms among
      // 0.78 ms ones).
      if (const std::optional<NoiseRange> t = trimmed_range(list[i], bp)) f.range = t;
      const nlohmann::json& hib = field(list[i], "higher_is_better", bp);
      if (!hib.is_boolean()) {
        input_error(
            fmt::format("{}.higher_is_better: expected a boolean, got {}", bp, hib.type_name()));
      }
      f.higher_is_better = hib.get<bool>();
      if (name == "layer step" && metric == "step_time_ms" && f.range) {
        layer_time_range = f.range;
      }
      bench_figures.push_back(std::move(f));
    }
  }
  const nlohmann::json& perf = field(s, "performance", path);
  const std::string pp = path + ".performance";
  if (perf.is_object()) {
    const std::optional<double> t = number(perf, "median_step_time_s", pp);
    const std::optional<double> ms = t ? std::optional<double>(*t * 1e3) : std::nullopt;
    const std::optional<NoiseRange> tr =
        bench ? layer_time_range
              : step_time_range(s, number(perf, "warmup_steps", pp).value_or(0), path);
    const double median_ms = ms.value_or(0);
    if (!bench) {
      add({"step_time_ms", ms, ms ? tr : std::nullopt, false});
      const std::optional<double> tok = number(perf, "tokens_per_s", pp);
      add({"tokens_per_s", tok, inverse_range(tok, median_ms, tr), true});
      const std::optional<double> tf = number(perf, "tflops_per_device", pp);
      add({"tflops_per_device", tf, inverse_range(tf, median_ms, tr), true});
    }
    const std::optional<double> mfu = number(perf, "mfu", pp);
    add({"mfu", mfu, inverse_range(mfu, median_ms, tr), true});
  } else if (!perf.is_null()) {
    input_error(fmt::format("{}: expected an object or null, got {}", pp, perf.type_name()));
  }
  const nlohmann::json& colls = field(s, "collectives", path);
  if (!colls.is_array()) input_error(fmt::format("{}.collectives: expected an array", path));
  for (size_t i = 0; i < colls.size(); ++i) {
    const std::string cp = fmt::format("{}.collectives[{}]", path, i);
    // One total per (kind, group) over the run: no repetitions, so no measured noise.
    add({fmt::format("busbw_gbps {} {}", string_field(colls[i], "kind", cp),
                     string_field(colls[i], "group", cp)),
         number(colls[i], "busbw_gbps", cp), std::nullopt, true});
  }
  for (Figure& f : bench_figures) add(std::move(f));
  return out;
}

// B against A beyond the noise: B's range wholly above or below A's, and B at least
// `min_change` away from A (compare.h says why).
Change judge(const CompareRow& r, double min_change) {
  if (!r.a || !r.b || !r.a_range || !r.b_range) return Change::kUnmeasured;
  const bool up = r.b_range->min > r.a_range->max;
  const bool down = r.b_range->max < r.a_range->min;
  if (!up && !down) return Change::kNone;
  if (r.ratio && std::abs(*r.ratio - 1.0) < min_change) return Change::kNone;
  return up == r.higher_is_better ? Change::kBetter : Change::kWorse;
}

const nlohmann::json& scenarios(const nlohmann::json& r, const char* which) {
  const nlohmann::json& s = field(r, "scenarios", which);
  if (!s.is_array()) input_error(fmt::format("{}.scenarios: expected an array", which));
  return s;
}

std::string num(const std::optional<double>& v) {
  return v ? fmt::format("{:.4g}", *v) : std::string("n/a");
}

}  // namespace

nlohmann::json load_report(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    input_error(fmt::format("{} is a folder, not a report.json", path.string()));
  }
  std::ifstream in(path);
  if (!in) input_error(fmt::format("cannot open report {}", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::parse_error& e) {
    // The position, not the parser's text: that quotes the bytes it last read, which for a
    // binary file (an HDF5 checkpoint given by mistake) are not printable.
    input_error(fmt::format("{} is not valid JSON: parse error at byte {} of {}", path.string(),
                            e.byte, ss.str().size()));
  }
  if (!j.is_object() || j.value("schema", "") != "meshproof.report") {
    input_error(fmt::format("{} is not a meshproof report (no \"schema\": \"meshproof.report\")",
                            path.string()));
  }
  const nlohmann::json& v = j["schema_version"];
  if (!v.is_number_integer() || v.get<int>() != kReportSchemaVersion) {
    input_error(fmt::format("{}: schema_version {} is not supported (this meshproof reads {})",
                            path.string(), v.dump(), kReportSchemaVersion));
  }
  return j;
}

ReportKind report_kind(const nlohmann::json& report, const std::string& which) {
  const nlohmann::json& list = field(report, "scenarios", which);
  if (!list.is_array()) input_error(fmt::format("{}.scenarios: expected an array", which));
  size_t bench = 0;
  for (const nlohmann::json& s : list) {
    if (s.is_object() && s.contains("benchmarks") && s.at("benchmarks").is_array() &&
        !s.at("benchmarks").empty()) {
      ++bench;
    }
  }
  if (bench == 0) return ReportKind::kRun;
  if (bench == list.size()) return ReportKind::kBench;
  input_error(fmt::format(
      "{} mixes {} benchmark scenarios with {} training scenarios: not a report of one verb", which,
      bench, list.size() - bench));
}

CompareTable compare_reports(const nlohmann::json& a, const nlohmann::json& b, double min_change) {
  const ReportKind ka = report_kind(a, "A");
  const ReportKind kb = report_kind(b, "B");
  auto kind_name = [](ReportKind k) {
    return k == ReportKind::kBench ? "a benchmark report (meshproof bench)"
                                   : "a run report (meshproof run)";
  };
  if (ka != kb) {
    input_error(fmt::format(
        "A is {} and B is {}: they share no figure; compare two reports of the same kind",
        kind_name(ka), kind_name(kb)));
  }
  const nlohmann::json& sa = scenarios(a, "A");
  const nlohmann::json& sb = scenarios(b, "B");
  CompareTable t;
  t.min_change = min_change;
  t.kind = ka;
  std::set<std::string> names_a;
  for (size_t i = 0; i < sa.size(); ++i) {
    names_a.insert(string_field(sa[i], "name", fmt::format("A.scenarios[{}]", i)));
  }
  for (size_t i = 0; i < sb.size(); ++i) {
    const std::string name = string_field(sb[i], "name", fmt::format("B.scenarios[{}]", i));
    if (!names_a.count(name)) t.only_in_b.push_back(name);
  }
  for (size_t i = 0; i < sa.size(); ++i) {
    const std::string name = sa[i]["name"].get<std::string>();
    size_t j = 0;
    while (j < sb.size() && sb[j]["name"].get<std::string>() != name) ++j;
    if (j == sb.size()) {
      t.only_in_a.push_back(name);
      continue;
    }
    const std::vector<Figure> fa = figures(sa[i], fmt::format("A.scenarios[{}]", i));
    const std::vector<Figure> fb = figures(sb[j], fmt::format("B.scenarios[{}]", j));
    // Union of metric names in A's order, then B-only ones (a collective present in one run);
    // each name is unique within fa and fb, so each row appears once.
    std::vector<const Figure*> order;
    for (const Figure& f : fa) order.push_back(&f);
    for (const Figure& f : fb) {
      if (std::none_of(fa.begin(), fa.end(), [&](const Figure& g) { return g.name == f.name; }))
        order.push_back(&f);
    }
    auto lookup = [](const std::vector<Figure>& m, const std::string& n) -> const Figure* {
      for (const Figure& f : m) {
        if (f.name == n) return &f;
      }
      return nullptr;
    };
    for (const Figure* f : order) {
      CompareRow row;
      row.scenario = name;
      row.metric = f->name;
      row.higher_is_better = f->higher_is_better;
      if (const Figure* x = lookup(fa, f->name)) {
        row.a = x->value;
        row.a_range = x->range;
      }
      if (const Figure* y = lookup(fb, f->name)) {
        row.b = y->value;
        row.b_range = y->range;
      }
      if (row.a && row.b && *row.a != 0) row.ratio = *row.b / *row.a;
      row.change = judge(row, min_change);
      t.rows.push_back(row);
    }
  }
  return t;
}

std::string format_compare_table(const CompareTable& t, const std::string& a_name,
                                 const std::string& b_name) {
  size_t ws = 8, wm = 6;
  for (const CompareRow& r : t.rows) {
    ws = std::max(ws, r.scenario.size());
    wm = std::max(wm, r.metric.size());
  }
  auto range = [](const std::optional<NoiseRange>& r) {
    return r ? fmt::format("{:.4g}..{:.4g}", r->min, r->max) : std::string("-");
  };
  size_t wr = 5;
  for (const CompareRow& r : t.rows) {
    wr = std::max({wr, range(r.a_range).size(), range(r.b_range).size()});
  }
  std::string out = fmt::format("A = {}\nB = {}\n\n", a_name, b_name);
  out += fmt::format("{:<{}}  {:<{}}  {:>12}  {:>{}}  {:>12}  {:>{}}  {:>8}  {}\n", "scenario", ws,
                     "metric", wm, "A", "A noise", wr, "B", "B noise", wr, "B/A", "change");
  for (const CompareRow& r : t.rows) {
    const std::string ratio = r.ratio ? fmt::format("{:.3f}", *r.ratio) : "n/a";
    const char* change = r.change == Change::kBetter  ? "better"
                         : r.change == Change::kWorse ? "worse"
                         : r.change == Change::kNone  ? "within noise"
                                                      : "no noise measured";
    out += fmt::format("{:<{}}  {:<{}}  {:>12}  {:>{}}  {:>12}  {:>{}}  {:>8}  {}\n", r.scenario,
                       ws, r.metric, wm, num(r.a), range(r.a_range), wr, num(r.b), range(r.b_range),
                       wr, ratio, change);
  }
  out += fmt::format(
      "\nchange: better/worse only when the two noise ranges (min..max over the "
      "repetitions; a run's steady-state steps) do not overlap and B/A is at least "
      "{:g}% away from 1\n",
      t.min_change * 100);
  for (const std::string& n : t.only_in_a) out += fmt::format("only in A: {}\n", n);
  for (const std::string& n : t.only_in_b) out += fmt::format("only in B: {}\n", n);
  // Names come from files: no control characters (terminal escapes) reach the terminal.
  return sanitize_text(out);
}

}  // namespace meshproof::reports
