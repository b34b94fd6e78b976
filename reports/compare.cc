#include "reports/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "reports/report_error.h"
#include "reports/run_record.h"
#include "reports/xml_text.h"

namespace meshproof::reports {
namespace {

[[noreturn]] void input_error(const std::string& m) {
  throw ReportError(ReportError::Kind::kInput, m);
}

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

// Metric name -> value of one scenario, in display order.
std::vector<std::pair<std::string, std::optional<double>>> metrics(const nlohmann::json& s,
                                                                   const std::string& path,
                                                                   std::vector<bool>& better) {
  std::vector<std::pair<std::string, std::optional<double>>> out;
  const nlohmann::json& perf = field(s, "performance", path);
  const std::string pp = path + ".performance";
  if (perf.is_object()) {
    std::optional<double> t = number(perf, "median_step_time_s", pp);
    out.emplace_back("step_time_ms", t ? std::optional<double>(*t * 1e3) : std::nullopt);
    better.push_back(false);
    out.emplace_back("tokens_per_s", number(perf, "tokens_per_s", pp));
    better.push_back(true);
    out.emplace_back("tflops_per_device", number(perf, "tflops_per_device", pp));
    better.push_back(true);
    out.emplace_back("mfu", number(perf, "mfu", pp));
    better.push_back(true);
  } else if (!perf.is_null()) {
    input_error(fmt::format("{}: expected an object or null, got {}", pp, perf.type_name()));
  }
  const nlohmann::json& colls = field(s, "collectives", path);
  if (!colls.is_array()) input_error(fmt::format("{}.collectives: expected an array", path));
  for (size_t i = 0; i < colls.size(); ++i) {
    const std::string cp = fmt::format("{}.collectives[{}]", path, i);
    out.emplace_back(fmt::format("busbw_gbps {} {}", string_field(colls[i], "kind", cp),
                                 string_field(colls[i], "group", cp)),
                     number(colls[i], "busbw_gbps", cp));
    better.push_back(true);
  }
  // Benchmark figures (bench verbs); reports written before the table existed have no key.
  if (s.is_object() && s.contains("benchmarks")) {
    const nlohmann::json& bench = s.at("benchmarks");
    if (!bench.is_array()) input_error(fmt::format("{}.benchmarks: expected an array", path));
    for (size_t i = 0; i < bench.size(); ++i) {
      const std::string bp = fmt::format("{}.benchmarks[{}]", path, i);
      out.emplace_back(fmt::format("{} {}", string_field(bench[i], "name", bp),
                                   string_field(bench[i], "metric", bp)),
                       number(bench[i], "value", bp));
      const nlohmann::json& hib = field(bench[i], "higher_is_better", bp);
      if (!hib.is_boolean()) {
        input_error(
            fmt::format("{}.higher_is_better: expected a boolean, got {}", bp, hib.type_name()));
      }
      better.push_back(hib.get<bool>());
    }
  }
  return out;
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
  std::ifstream in(path);
  if (!in) input_error(fmt::format("cannot open report {}", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::parse_error& e) {
    input_error(fmt::format("{} is not valid JSON: {}", path.string(), e.what()));
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

CompareTable compare_reports(const nlohmann::json& a, const nlohmann::json& b) {
  const nlohmann::json& sa = scenarios(a, "A");
  const nlohmann::json& sb = scenarios(b, "B");
  CompareTable t;
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
    std::vector<bool> better_a, better_b;
    const auto ma = metrics(sa[i], fmt::format("A.scenarios[{}]", i), better_a);
    const auto mb = metrics(sb[j], fmt::format("B.scenarios[{}]", j), better_b);
    // Union of metric names in A's order, then B-only ones (a collective present in one run).
    std::vector<std::string> names;
    std::vector<bool> better;
    for (size_t k = 0; k < ma.size(); ++k) {
      names.push_back(ma[k].first);
      better.push_back(better_a[k]);
    }
    for (size_t k = 0; k < mb.size(); ++k) {
      if (std::find(names.begin(), names.end(), mb[k].first) == names.end()) {
        names.push_back(mb[k].first);
        better.push_back(better_b[k]);
      }
    }
    auto lookup = [](const auto& m, const std::string& n) -> std::optional<double> {
      for (const auto& [k, v] : m) {
        if (k == n) return v;
      }
      return std::nullopt;
    };
    for (size_t k = 0; k < names.size(); ++k) {
      CompareRow row;
      row.scenario = name;
      row.metric = names[k];
      row.a = lookup(ma, names[k]);
      row.b = lookup(mb, names[k]);
      row.higher_is_better = better[k];
      if (row.a && row.b && *row.a != 0) row.ratio = *row.b / *row.a;
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
  std::string out = fmt::format("A = {}\nB = {}\n\n", a_name, b_name);
  out += fmt::format("{:<{}}  {:<{}}  {:>12}  {:>12}  {:>8}\n", "scenario", ws, "metric", wm, "A",
                     "B", "B/A");
  for (const CompareRow& r : t.rows) {
    std::string ratio = r.ratio ? fmt::format("{:.3f}", *r.ratio) : "n/a";
    // Mark changes beyond 5% as better (+) or worse (-) for the metric's direction.
    if (r.ratio && (*r.ratio > 1.05 || *r.ratio < 0.95)) {
      ratio += (*r.ratio > 1) == r.higher_is_better ? " +" : " -";
    }
    out += fmt::format("{:<{}}  {:<{}}  {:>12}  {:>12}  {:>8}\n", r.scenario, ws, r.metric, wm,
                       num(r.a), num(r.b), ratio);
  }
  for (const std::string& n : t.only_in_a) out += fmt::format("only in A: {}\n", n);
  for (const std::string& n : t.only_in_b) out += fmt::format("only in B: {}\n", n);
  // Names come from files: no control characters (terminal escapes) reach the terminal.
  return sanitize_text(out);
}

}  // namespace meshproof::reports
