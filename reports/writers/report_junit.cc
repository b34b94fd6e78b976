// junit.xml: one <testsuite> per scenario, one <testcase> per check. The layout is valid against
// the Apache Ant JUnit schema (Windy Road's JUnit.xsd, the strictest common one: required
// id/package/hostname/timestamp, <properties>, <system-out> and <system-err> per suite, at most
// one of <skipped>/<error>/<failure> per testcase and nothing else in it, no attributes on
// <testsuites>), which Jenkins, GitLab and GitHub reporters all read.
#include <fmt/format.h>

#include "reports/writers/report_text.h"
#include "reports/writers/report_writers.h"
#include "reports/writers/xml_text.h"

namespace meshproof::reports {
namespace {

struct Counts {
  int tests = 0, failures = 0, errors = 0, skipped = 0;
};

// Testcases of one scenario, with their counts.
// `caught` collects the "caught as expected" lines for the suite's <system-out> (the Ant schema
// allows no <system-out> inside a testcase).
std::string testcases(const ScenarioRecord& s, Counts& n, std::string& caught) {
  const std::string classname = xml_escape_attr("meshproof." + s.name);
  std::string out;
  const bool caught_scenario = s.expectation == Expectation::kCaught;
  for (const CheckResult& c : s.checks) {
    ++n.tests;
    out += fmt::format(R"(    <testcase name="{}" classname="{}" time="{:.3f}">)",
                       xml_escape_attr(c.name), classname, c.duration_s);
    out += "\n";
    const std::string detail = c.evidence
                                   ? xml_escape(c.message + "\n" + evidence_summary(*c.evidence))
                                   : xml_escape(c.message);
    switch (c.verdict) {
      case Verdict::kPass:
        break;
      case Verdict::kSkipped:
        ++n.skipped;
        out += fmt::format("      <skipped message=\"{}\"/>\n", xml_escape_attr(c.message));
        break;
      case Verdict::kError:
        ++n.errors;
        out += fmt::format("      <error message=\"{}\" type=\"{}\">{}</error>\n",
                           xml_escape_attr(check_headline(c)), xml_escape_attr(c.kind), detail);
        break;
      case Verdict::kFail:
        if (caught_scenario) {
          // In a fault scenario failing checks are the fault's doing; whether the right check
          // caught it is the expectation:caught testcase's verdict.
          caught += catches_fault(s, c)
                        ? fmt::format("caught as expected by {}: {}\n", c.name, check_headline(c))
                        : fmt::format("failed, but is not an intended check ({}): {}: {}\n",
                                      join_names(s.caught_by), c.name, check_headline(c));
        } else {
          ++n.failures;
          out += fmt::format("      <failure message=\"{}\" type=\"{}\">{}</failure>\n",
                             xml_escape_attr(check_headline(c)), xml_escape_attr(c.kind), detail);
        }
        break;
    }
    out += "    </testcase>\n";
  }
  if (caught_scenario) {
    ++n.tests;
    out += fmt::format(R"(    <testcase name="expectation:caught" classname="{}" time="0.000">)",
                       classname);
    out += "\n";
    // The same rule as scenario_verdict: skipped with the scenario, failed unless a check in
    // caught_by failed.
    bool fault_caught = false, all_skipped = !s.checks.empty();
    for (const CheckResult& c : s.checks) {
      fault_caught = fault_caught || catches_fault(s, c);
      all_skipped = all_skipped && c.verdict == Verdict::kSkipped;
    }
    if (all_skipped) {
      ++n.skipped;
      out += "      <skipped message=\"every check was skipped\"/>\n";
    } else if (!fault_caught) {
      ++n.failures;
      std::string why = verdict_reason(s);
      if (why.empty() || why.rfind("fault not caught", 0) != 0) {
        // An errored check or run makes the verdict error; the expectation is still unmet.
        why = fmt::format("fault not caught: none of the intended checks ({}) failed",
                          join_names(s.caught_by));
      }
      out += fmt::format("      <failure message=\"{}\" type=\"expectation\"/>\n",
                         xml_escape_attr(why));
    }
    out += "    </testcase>\n";
  }
  if (!s.error.empty()) {
    ++n.tests;
    ++n.errors;
    out +=
        fmt::format(R"(    <testcase name="run" classname="{}" time="{:.3f}">)"
                    "\n      <error message=\"{}\" type=\"runtime\">{}</error>\n    </testcase>\n",
                    classname, s.duration_s, xml_escape_attr(s.error), xml_escape(s.error));
  }
  return out;
}

}  // namespace

std::string render_junit(const RunRecord& r) {
  std::string suites;
  Counts total;
  // Ant's schema wants a timestamp without a zone designator; start_time is UTC.
  std::string timestamp = r.start_time;
  if (!timestamp.empty() && timestamp.back() == 'Z') timestamp.pop_back();
  if (timestamp.empty()) timestamp = "1970-01-01T00:00:00";
  const std::string host = r.environment.host.empty() ? "localhost" : r.environment.host;
  int id = 0;
  for (const ScenarioRecord& s : r.scenarios) {
    Counts n;
    std::string caught;
    const std::string cases = testcases(s, n, caught);
    suites += fmt::format(
        R"(  <testsuite name="{}" package="meshproof" id="{}" tests="{}" failures="{}" errors="{}" )"
        R"(skipped="{}" time="{:.3f}" timestamp="{}" hostname="{}">)"
        "\n",
        xml_escape_attr(s.name), id++, n.tests, n.failures, n.errors, n.skipped, s.duration_s,
        xml_escape_attr(timestamp), xml_escape_attr(host));
    suites += "    <properties>\n";
    for (const auto& [k, v] : {std::pair<std::string, std::string>{"mesh", s.mesh},
                               {"recipe", s.recipe},
                               {"backend", s.backend},
                               {"expectation", std::string(expectation_name(s.expectation))},
                               {"verdict", std::string(verdict_name(scenario_verdict(s)))},
                               {"step_time_ms", step_time_ms(s)},
                               {"mfu", mfu_percent(s)}}) {
      suites += fmt::format("      <property name=\"{}\" value=\"{}\"/>\n", k, xml_escape_attr(v));
    }
    // Pipeline stages (pp > 1 only): each stage's mean step time and its measured and
    // predicted bubble, beside the scenario's step time.
    for (const PipelineStageRecord& p : s.pipeline) {
      for (const auto& [k, v] : {std::pair<std::string, std::string>{
                                     "step_ms", fmt::format("{:.3f}", p.mean.step_s * 1e3)},
                                 {"p2p_wait_ms", fmt::format("{:.3f}", p.mean.p2p_wait_s * 1e3)},
                                 {"bubble", fraction_text(p.bubble_fraction)},
                                 {"predicted_bubble", fraction_text(p.predicted_bubble_fraction)},
                                 {"peak_memory", stage_peaks_text(p)}}) {
        suites += fmt::format("      <property name=\"pp_stage{}_{}\" value=\"{}\"/>\n", p.stage, k,
                              xml_escape_attr(v));
      }
    }
    // Benchmark figures that are an emulation (bench recipes): their reasons, once each.
    std::string emulated;
    for (const BenchmarkFigure& b : s.benchmarks) {
      if (!b.emulated.empty() && emulated.find(b.emulated) == std::string::npos)
        emulated += (emulated.empty() ? "" : "; ") + b.emulated;
    }
    if (!emulated.empty()) {
      suites += fmt::format("      <property name=\"emulated\" value=\"{}\"/>\n",
                            xml_escape_attr(emulated));
    }
    suites += "    </properties>\n";
    suites += cases;
    std::string notes = caught;
    for (const std::string& note : s.notes) notes += note + "\n";
    suites += fmt::format("    <system-out>{}</system-out>\n    <system-err/>\n  </testsuite>\n",
                          xml_escape(notes));
    total.tests += n.tests;
    total.failures += n.failures;
    total.errors += n.errors;
    total.skipped += n.skipped;
  }
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<!-- meshproof: {} tests, {} failures, {} errors, {} skipped in {:.3f} s -->\n"
      "<testsuites>\n{}</testsuites>\n",
      total.tests, total.failures, total.errors, total.skipped, r.duration_s, suites);
}

}  // namespace meshproof::reports
