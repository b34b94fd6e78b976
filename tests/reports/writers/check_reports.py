#!/usr/bin/python3
"""Structural checks of the four reports written by write_reports (tests/reports/writers/CMakeLists.txt).

usage: check_reports.py OUT_DIR SCHEMA_JSON JUNIT_XSD [--checks-timed]

- report.json validates against reports/schema/report.schema.json (python3-jsonschema);
- junit.xml is valid against the Apache Ant JUnit schema (junit-ant.xsd, python3-xmlschema),
  parses with xml.etree; testsuite/testcase/failure/error/skipped counts equal the
  counts derived from report.json by the rules in docs/report-schema.md;
- report.html is well-formed (xml.etree and html.parser), has one <svg> per plot (rules in
  docs/report-schema.md), no scripts, no src attributes, no external href;
- the summary table of report.md has the JSON's scenarios, meshes, recipes, verdicts, step
  times and MFU, row by row;
- every failing check's evidence summary appears in report.md, junit.xml and report.html;
- the data's entropy floor, where the record has one, is in report.md; in the scenario's loss
  plot it is a labelled dashed line when inside the curves' range, else named in the title;
- every check's JUnit testcase time is its duration_s (--checks-timed, real runs: > 0 for
  checks that passed or failed);
- each scenario's verdict is the one the rules of docs/report-schema.md give (a fault caught
  only by a check outside caught_by is a fail).
Exits 1 with a list of problems when any check fails.
"""
import html.parser
import json
import re
import sys
import xml.etree.ElementTree as ET

import jsonschema
import xmlschema

problems = []


def expect(cond, what):
    if not cond:
        problems.append(what)


def clean(s):
    """What the text writers do to record strings: C0 controls other than tab/newline -> U+FFFD."""
    return re.sub(r"[\x00-\x08\x0b-\x1f]", "\ufffd", s)


def evidence_summary(e):
    """Mirror of reports/writers/report_text.cc evidence_summary (numbers as %.6g)."""
    parts = []
    if e["first_diverging_step"] is not None:
        parts.append("first diverging step %d" % e["first_diverging_step"])
    if e["metric"]:
        parts.append("metric " + e["metric"])
    if e["tensor"]:
        parts.append("tensor " + e["tensor"])
    for key, label in (("expected", "expected"), ("actual", "actual"),
                       ("max_abs_err", "max abs err"), ("max_rel_err", "max rel err")):
        if e[key] is not None:
            parts.append("%s %.6g" % (label, e[key]))
    if e["ulp_distance"] is not None:
        parts.append("ULP distance %d" % e["ulp_distance"])
    if e["failing_steps"] > 0:
        parts.append("%d failing steps" % e["failing_steps"])
    return ", ".join(parts)


def expected_junit(s):
    """(tests, failures, errors, skipped) of one scenario's testsuite."""
    caught = s["expectation"] == "caught"
    tests = len(s["checks"]) + (1 if caught else 0) + (1 if s["error"] else 0)
    fails = sum(1 for c in s["checks"] if c["verdict"] == "fail")
    failures = 0 if caught else fails
    errors = sum(1 for c in s["checks"] if c["verdict"] == "error") + (1 if s["error"] else 0)
    skipped = sum(1 for c in s["checks"] if c["verdict"] == "skipped")
    if caught:
        # The synthetic expectation:caught testcase: skipped with the scenario, else failed unless
        # a check of an intended kind (caught_by) failed.
        if s["checks"] and skipped == len(s["checks"]):
            skipped += 1
        elif not fault_caught(s):
            failures += 1
    return tests, failures, errors, skipped


def fault_caught(s):
    return any(c["verdict"] == "fail" and c["kind"] in s["caught_by"] for c in s["checks"])


def scenario_verdict(s):
    """docs/report-schema.md "Verdict rules", re-derived from the record's parts."""
    if s["error"] or any(c["verdict"] == "error" for c in s["checks"]):
        return "error"
    all_skipped = all(c["verdict"] == "skipped" for c in s["checks"])
    if s["expectation"] == "caught":
        if s["checks"] and all_skipped:
            return "skipped"
        return "pass" if fault_caught(s) else "fail"
    if any(c["verdict"] == "fail" for c in s["checks"]):
        return "fail"
    return "skipped" if all_skipped else "pass"


def fmt_g4(v):
    """C++ fmt's {:.4g}: %.4g (no trailing zeros)."""
    return "%.4g" % v


def expected_plots(s):
    n = 0
    if s["steps"]:
        n += 3  # loss (vs golden), grad_norm (vs golden), step-time breakdown
        if s["golden"] is not None:
            n += 1  # relative difference with the tolerance band
    if s["memory"]:
        n += 1
    # bench recipes (docs/design.md section 26): speedup bars when there are non-sweep speedups,
    # the M-sweep lines when there are sweep ones, loss differences when config has convergence.
    speedups = [b["name"] for b in s.get("benchmarks", []) if b["metric"] == "speedup_autocast"]
    if any(not name.startswith("sweep ") for name in speedups):
        n += 1
    if any(name.startswith("sweep ") for name in speedups):
        n += 1
    if isinstance(s.get("config"), dict) and "convergence" in s["config"]:
        n += 1
    return n


def step_time_ms(s):
    p = s["performance"]
    if p is None or p["median_step_time_s"] is None:
        return "n/a"
    return "%.3f" % (p["median_step_time_s"] * 1e3)


def mfu(s):
    p = s["performance"]
    if p is None or p["mfu"] is None:
        return "n/a"
    return "%.1f%%" % (p["mfu"] * 100)


def tally(s):
    n = {v: 0 for v in ("pass", "fail", "error", "skipped")}
    for c in s["checks"]:
        n[c["verdict"]] += 1
    out = ", ".join("%d %s" % (n[v], v) for v in ("pass", "fail", "error", "skipped") if n[v])
    return out or "none"


def md_cell(s):
    return clean(s).replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def split_md_row(line):
    # Split on pipes not escaped with a backslash; drop the empty first/last pieces.
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip() for c in cells]


def main():
    out_dir, schema_path, xsd_path = sys.argv[1], sys.argv[2], sys.argv[3]
    checks_timed = "--checks-timed" in sys.argv[4:]
    with open(schema_path, encoding="utf-8") as f:
        schema = json.load(f)
    with open(out_dir + "/report.json", encoding="utf-8") as f:
        report = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(report),
                    key=lambda e: list(e.path))
    for e in errors:
        problems.append("schema: %s at %s" % (e.message, "/".join(map(str, e.path))))
    scenarios = report["scenarios"]
    for s in scenarios:
        expect(s["verdict"] == scenario_verdict(s),
               "json %s: verdict %s, the rules give %s" % (s["name"], s["verdict"], scenario_verdict(s)))
        expect(s["expectation"] == "caught" or not s["caught_by"],
               "json %s: caught_by on an expectation-pass scenario" % s["name"])

    # ---- junit.xml
    for e in xmlschema.XMLSchema(xsd_path).iter_errors(out_dir + "/junit.xml"):
        problems.append("junit xsd: %s" % str(e).splitlines()[0])
    root = ET.parse(out_dir + "/junit.xml").getroot()
    expect(root.tag == "testsuites", "junit root is <%s>" % root.tag)
    suites = root.findall("testsuite")
    expect(len(suites) == len(scenarios), "junit: %d suites for %d scenarios" % (len(suites), len(scenarios)))
    totals = [0, 0, 0, 0]
    for suite, s in zip(suites, scenarios):
        exp = expected_junit(s)
        cases = suite.findall("testcase")
        got_attr = tuple(int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped"))
        got_elem = (len(cases), sum(len(c.findall("failure")) for c in cases),
                    sum(len(c.findall("error")) for c in cases),
                    sum(len(c.findall("skipped")) for c in cases))
        expect(suite.get("name") == clean(s["name"]),
               "junit suite name %r != %r" % (suite.get("name"), s["name"]))
        expect(got_attr == exp, "junit %s: attributes %s, expected %s" % (s["name"], got_attr, exp))
        expect(got_elem == exp, "junit %s: elements %s, expected %s" % (s["name"], got_elem, exp))
        for k in ("timestamp", "hostname", "id", "package", "time"):
            expect(suite.get(k), "junit %s: testsuite lacks %s" % (s["name"], k))
        expect(suite.find("properties") is not None and suite.find("system-out") is not None
               and suite.find("system-err") is not None, "junit %s: properties/system-out/err" % s["name"])
        for case in cases:
            expect(case.get("classname") and case.get("time") is not None, "junit testcase attributes")
        # Ant's schema: <properties> first, then testcases, then system-out, system-err.
        order = [child.tag for child in suite]
        expect(order[0] == "properties" and order[-2:] == ["system-out", "system-err"],
               "junit %s: child order %s" % (s["name"], order))
        for i, k in enumerate(exp):
            totals[i] += k
        by_name = {c.get("name"): c for c in cases}
        for c in s["checks"]:
            case = by_name.get(clean(c["name"]))
            expect(case is not None, "junit: no testcase for check %r" % c["name"])
            if case is not None:
                # Each check's time is its JSON duration_s; a check that ran in a real run
                # (--checks-timed) took time: it includes the training it judged.
                expect(case.get("time") == "%.3f" % c["duration_s"],
                       "junit: check %r time %s, duration_s %r" % (c["name"], case.get("time"),
                                                                 c["duration_s"]))
                if checks_timed and c["verdict"] in ("pass", "fail"):
                    expect(float(case.get("time")) > 0,
                           "junit: check %r of %s has time 0" % (c["name"], s["name"]))
            if case is None or c["verdict"] != "fail" or s["expectation"] == "caught":
                continue
            failure = case.find("failure")
            expect(failure is not None, "junit: check %r has no <failure>" % c["name"])
            if failure is not None and c["evidence"] is not None:
                ev = clean(evidence_summary(c["evidence"]))
                expect(ev in failure.get("message"), "junit failure message lacks %r" % ev)
                expect(ev in failure.text, "junit failure text lacks %r" % ev)
    with open(out_dir + "/junit.xml", encoding="utf-8") as f:
        m = re.search(r"<!-- meshproof: (\d+) tests, (\d+) failures, (\d+) errors, (\d+) skipped", f.read())
    expect(m is not None, "junit: no totals comment")
    if m:
        got_totals = tuple(int(g) for g in m.groups())
        expect(got_totals == tuple(totals), "junit totals %s != %s" % (got_totals, totals))

    # ---- report.html
    with open(out_dir + "/report.html", encoding="utf-8") as f:
        page = f.read()
    html_root = ET.fromstring(page)  # well-formed XML (XHTML-compatible)
    ns = {"h": "http://www.w3.org/1999/xhtml", "s": "http://www.w3.org/2000/svg"}

    class Checker(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack = []
            self.svgs = 0

        def handle_starttag(self, tag, attrs):
            void = tag in ("meta", "br", "hr", "img", "link", "input")
            if not void:
                self.stack.append(tag)
            if tag == "svg":
                self.svgs += 1
            expect(tag not in ("script", "link", "img", "iframe", "object"), "html: <%s>" % tag)
            for k, v in attrs:
                expect(k != "src", "html: src attribute on <%s>" % tag)
                if k in ("href", "xlink:href"):
                    expect(v.startswith("#"), "html: external href %r" % v)
                expect("url(" not in (v or ""), "html: url() in attribute")

        def handle_startendtag(self, tag, attrs):
            self.handle_starttag(tag, attrs)
            if self.stack and self.stack[-1] == tag:
                self.stack.pop()

        def handle_endtag(self, tag):
            expect(self.stack and self.stack[-1] == tag,
                   "html: </%s> closes <%s>" % (tag, self.stack[-1] if self.stack else None))
            if self.stack and self.stack[-1] == tag:
                self.stack.pop()

    checker = Checker()
    checker.feed(page)
    checker.close()
    expect(not checker.stack, "html: unclosed %s" % checker.stack)
    expect("@import" not in page and "url(" not in page, "html: external style reference")
    sections = html_root.findall(".//h:section", ns)
    expect(len(sections) == len(scenarios), "html: %d sections" % len(sections))
    total_plots = 0
    for sec, s in zip(sections, scenarios):
        n = len(sec.findall(".//s:svg", ns))
        total_plots += expected_plots(s)
        expect(n == expected_plots(s), "html %s: %d svgs, expected %d" % (s["name"], n, expected_plots(s)))
        for svg in sec.findall(".//s:svg", ns):
            texts = svg.findall(".//s:text", ns)
            expect(len(texts) >= 6, "html: an svg has only %d text elements (axes/ticks/legend)" % len(texts))
            expect(svg.find("s:title", ns) is not None, "html: svg without title")
        text = "".join(sec.itertext())
        for c in s["checks"]:
            if c["verdict"] == "fail" and c["evidence"] is not None:
                ev = clean(evidence_summary(c["evidence"]))
                expect(ev in text, "html %s lacks evidence %r" % (s["name"], ev))
    expect(checker.svgs == total_plots, "html: %d svgs in all, expected %d" % (checker.svgs, total_plots))
    rows = html_root.findall(".//h:table[@id='summary']/h:tbody/h:tr", ns)
    expect(len(rows) == len(scenarios), "html summary rows %d" % len(rows))
    for row, s in zip(rows, scenarios):
        cells = ["".join(td.itertext()) for td in row.findall("h:td", ns)]
        expect(cells == [clean(s["name"]), clean(s["mesh"]), clean(s["recipe"]), tally(s), s["verdict"],
                         step_time_ms(s), mfu(s)], "html summary row %s" % cells)

    # ---- report.md
    with open(out_dir + "/report.md", encoding="utf-8") as f:
        md = f.read()
    lines = md.splitlines()
    header = lines.index("| scenario | mesh | recipe | checks | verdict | step time (ms) | MFU |")
    md_rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        md_rows.append(split_md_row(line))
    expect(len(md_rows) == len(scenarios), "md: %d summary rows" % len(md_rows))
    for cells, s in zip(md_rows, scenarios):
        want = [md_cell(s["name"]), md_cell(s["mesh"]), md_cell(s["recipe"]), tally(s), s["verdict"],
                step_time_ms(s), mfu(s)]
        expect(cells == want, "md row %s != %s" % (cells, want))
    for s in scenarios:
        for c in s["checks"]:
            if c["verdict"] == "fail" and c["evidence"] is not None:
                ev = md_cell(evidence_summary(c["evidence"]))
                expect(ev in md, "md lacks evidence %r" % ev)

    # ---- the data's entropy floor: report.md and the loss plot of report.html
    md_sections = re.split(r"\n## ", md)[1:]
    for sec, md_sec, s in zip(sections, md_sections, scenarios):
        if s["entropy_floor"] is None:
            continue
        floor = "%.6f nats/token" % s["entropy_floor"]
        expect("- data entropy floor: " + floor in md_sec, "md %s lacks the entropy floor %s" % (s["name"], floor))
        if not s["steps"]:
            continue
        loss_svg = sec.findall(".//s:svg", ns)[0]
        texts = [t.text or "" for t in loss_svg.findall(".//s:text", ns)]
        label = "entropy floor %s" % fmt_g4(s["entropy_floor"])
        losses = [m["loss"] for m in s["steps"] if m["loss"] is not None]
        if s["golden"] is not None:
            losses += [g["loss"] for g in s["golden"]["steps"]]
        lo, hi = min(losses), max(losses)
        if label in texts:
            # Drawn: inside the curves' axis range (at most one span of the curves below them,
            # so it never squashes them), as a dashed horizontal polyline.
            expect(s["entropy_floor"] >= lo - (hi - lo),
                   "html %s: entropy floor %g drawn far below the curves (%g..%g)" %
                   (s["name"], s["entropy_floor"], lo, hi))
            dashed = [p for p in loss_svg.iter("{http://www.w3.org/2000/svg}polyline")
                      if p.get("stroke-dasharray")
                      and len({pt.split(",")[1] for pt in p.get("points").split()}) == 1]
            expect(dashed, "html %s: loss plot has no dashed horizontal line" % s["name"])
        else:
            # Left out: the title says where it is, and it lies outside the curves.
            note = "(%s, below the range)" % label
            expect(any(note in t for t in texts) or any("(%s, outside the range)" % label in t
                                                         for t in texts),
                   "html %s: loss plot neither draws nor names the entropy floor" % s["name"])
            expect(s["entropy_floor"] < lo or s["entropy_floor"] > hi,
                   "html %s: entropy floor %g inside the curves (%g..%g) but not drawn" %
                   (s["name"], s["entropy_floor"], lo, hi))

    if problems:
        print("\n".join(problems))
        return 1
    print("reports in %s: OK (%d scenarios, %d junit testcases, %d plots)" % (
        out_dir, len(scenarios), totals[0], total_plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
