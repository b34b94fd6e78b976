#include "harness/checks/golden_import.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/core/error.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Megatron's metric names and the golden's.
constexpr std::pair<const char*, const char*> kMegatronMetrics[] = {
    {"lm loss", "loss"}, {"grad norm", "grad_norm"}, {"learning-rate", "lr"}};

std::string read_all(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  MP_CHECK_INPUT(f.good(), "golden import: cannot read {}", path.string());
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

double finite_number(const json& v, const std::string& what) {
  MP_CHECK_INPUT(v.is_number(), "{}: expected a number, found {}", what, v.dump());
  const double x = v.get<double>();
  MP_CHECK_INPUT(std::isfinite(x), "{}: {} is not finite", what, v.dump());
  return x;
}

int64_t step_number(const json& v, const std::string& what) {
  MP_CHECK_INPUT(v.is_number_integer(), "{}: expected an integer step, found {}", what, v.dump());
  const int64_t s = v.get<int64_t>();
  MP_CHECK_INPUT(s >= 1, "{}: step {} (meshproof counts steps from 1)", what, s);
  return s;
}

// step -> value of one Megatron metric.
std::map<int64_t, double> megatron_series(const json& m, const std::string& where) {
  MP_CHECK_INPUT(m.is_object() && m.contains("values"), "{}: expected an object with \"values\"",
                 where);
  const json& values = m["values"];
  std::map<int64_t, double> out;
  if (values.is_object()) {
    for (const auto& [k, v] : values.items()) {
      const std::string what = fmt::format("{} step \"{}\"", where, k);
      int64_t s = 0;
      try {
        size_t used = 0;
        s = std::stoll(k, &used);
        MP_CHECK_INPUT(used == k.size(), "{}: not an integer step", what);
      } catch (const std::logic_error&) {
        MP_FAIL_INPUT("{}: not an integer step", what);
      }
      MP_CHECK_INPUT(s >= 1, "{}: step {} (meshproof counts steps from 1)", what, s);
      MP_CHECK_INPUT(out.emplace(s, finite_number(v, what)).second, "{}: step {} twice", what, s);
    }
  } else {
    // The older format: a list taken from the logged iterations, indexed from 0 (start_step 0 is
    // the first iteration, which Megatron and meshproof both number 1).
    MP_CHECK_INPUT(values.is_array(), "{} \"values\": expected an object or a list", where);
    const json start = m.value("start_step", json(0));
    const json interval = m.value("step_interval", json(1));
    MP_CHECK_INPUT(start.is_number_integer() && start.get<int64_t>() >= 0,
                   "{} start_step: expected an integer >= 0, found {}", where, start.dump());
    MP_CHECK_INPUT(interval.is_number_integer() && interval.get<int64_t>() >= 1,
                   "{} step_interval: expected an integer >= 1, found {}", where, interval.dump());
    for (size_t i = 0; i < values.size(); ++i) {
      out.emplace(start.get<int64_t>() + static_cast<int64_t>(i) * interval.get<int64_t>() + 1,
                  finite_number(values[i], fmt::format("{} values[{}]", where, i)));
    }
  }
  MP_CHECK_INPUT(!out.empty(), "{}: no values", where);
  return out;
}

ImportedGolden read_megatron(const fs::path& path, const std::string& text) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    MP_FAIL_INPUT("golden import {}: not JSON ({})", path.string(), e.what());
  }
  MP_CHECK_INPUT(doc.is_object() && doc.contains("lm loss"),
                 "golden import {}: a Megatron golden needs an \"lm loss\" metric", path.string());
  ImportedGolden g;
  g.format = GoldenSourceFormat::kMegatron;
  std::vector<int64_t> steps;
  for (const auto& [key, value] : doc.items()) {
    const char* name = nullptr;
    for (const auto& [mk, gk] : kMegatronMetrics) {
      if (key == mk) name = gk;
    }
    if (name == nullptr) {
      g.ignored.push_back(key);
      continue;
    }
    const std::string where = fmt::format("golden import {}: \"{}\"", path.string(), key);
    const std::map<int64_t, double> series = megatron_series(value, where);
    std::vector<int64_t> s;
    std::vector<double> v;
    for (const auto& [step, x] : series) {
      s.push_back(step);
      v.push_back(x);
    }
    if (steps.empty()) steps = s;
    MP_CHECK_INPUT(s == steps, "{}: its steps differ from the other metrics' ({} vs {} steps)",
                   where, s.size(), steps.size());
    g.data.metrics[name] = std::move(v);
  }
  g.data.steps = std::move(steps);
  return g;
}

ImportedGolden read_json_lines(const fs::path& path, const std::string& text) {
  ImportedGolden g;
  g.format = GoldenSourceFormat::kJsonLines;
  std::istringstream in(text);
  std::string line;
  int64_t line_no = 0;
  std::map<std::string, std::vector<double>> metrics;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("golden import {}:{}", path.string(), line_no);
    json row;
    try {
      row = json::parse(line);
    } catch (const json::exception& e) {
      MP_FAIL_INPUT("{}: not a JSON object ({})", where, e.what());
    }
    MP_CHECK_INPUT(row.is_object() && row.contains("step") && row.contains("loss"),
                   "{}: expected {{\"step\": n, \"loss\": x, ...}}", where);
    const int64_t step = step_number(row["step"], where + " \"step\"");
    MP_CHECK_INPUT(g.data.steps.empty() || step > g.data.steps.back(),
                   "{}: step {} after step {} (steps must increase)", where, step,
                   g.data.steps.empty() ? 0 : g.data.steps.back());
    g.data.steps.push_back(step);
    const bool first = g.data.steps.size() == 1;
    for (const char* key : {"loss", "grad_norm", "lr"}) {
      const bool has = row.contains(key);
      // The first line decides which metrics the log has; every later line has the same.
      MP_CHECK_INPUT(first || has == metrics.contains(key),
                     "{}: \"{}\" is on some lines and not on others", where, key);
      if (has)
        metrics[key].push_back(finite_number(row[key], fmt::format("{} \"{}\"", where, key)));
    }
  }
  MP_CHECK_INPUT(!g.data.steps.empty(), "golden import {}: no lines", path.string());
  g.data.metrics = std::move(metrics);
  return g;
}

}  // namespace

ImportedGolden read_golden_source(const fs::path& path, const std::string& format) {
  MP_CHECK_INPUT(format == "auto" || format == "megatron" || format == "jsonl",
                 "golden import: --format {} (expected auto, megatron or jsonl)", format);
  const std::string text = read_all(path);
  bool megatron = format == "megatron";
  if (format == "auto") {
    // The whole file one JSON object that is not a log line (no "step"): Megatron. A one-line
    // JSON-lines log is one object too, but holds "step".
    const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
    megatron = doc.is_object() && !doc.contains("step");
  }
  ImportedGolden g = megatron ? read_megatron(path, text) : read_json_lines(path, text);
  std::error_code ec;
  g.data.provenance = {{"origin", "imported"},
                       {"source_format", megatron ? "megatron" : "jsonl"},
                       {"imported_from", fs::absolute(path, ec).string()},
                       {"source_bytes", std::to_string(text.size())}};
  return g;
}

std::string golden_as_megatron_json(const GoldenData& golden) {
  std::vector<int64_t> steps = golden.steps;
  if (steps.empty()) {
    const size_t n = golden.metrics.at("loss").size();
    for (size_t i = 0; i < n; ++i) steps.push_back(static_cast<int64_t>(i) + 1);
  }
  int64_t interval = steps.size() >= 2 ? steps[1] - steps[0] : 1;
  for (size_t i = 1; i < steps.size(); ++i) {
    if (steps[i] - steps[i - 1] != interval) interval = 1;
  }
  json doc = json::object();
  for (const auto& [mk, gk] : kMegatronMetrics) {
    const auto it = golden.metrics.find(gk);
    if (it == golden.metrics.end()) continue;
    json values = json::object();
    for (size_t i = 0; i < steps.size() && i < it->second.size(); ++i) {
      values[std::to_string(steps[i])] = it->second[i];
    }
    doc[mk] = {{"start_step", steps.front()},
               {"end_step", steps.back()},
               {"step_interval", interval},
               {"values", values}};
  }
  return doc.dump(1) + "\n";
}

}  // namespace meshproof::harness
