#!/usr/bin/env python3
"""The whole fault catalog in one test (issue #20): every fault `meshproof faults` lists, built-in
and generic, is caught by one of its intended checks in its scenario (scenarios/faults/NAME.yaml),
and the same scenario without the fault (its negative control) passes every check.

usage: check_fault_catalog.py MESHPROOF SCENARIOS GOLDEN OUT

The rows come from `meshproof faults`, so a new row of harness/faults/scenario_faults.cc is covered
without an edit here. Per fault:
  * caught: exit 0, the scenario's verdict pass (expect: caught met), caught_by non-empty and
    every entry one of the row's claims (kind `resume` for resume_cross_mesh), and a failing check
    of that kind;
  * control: `--set faults=[] --set expect=pass`: exit 0, every scenario and every check pass
    (check_clean_run.py's rules: a skipped run would pass vacuously).
Prints one line per fault and a summary; exits 1 naming every fault that broke a rule.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time


def catalog(meshproof):
    out = subprocess.run([meshproof, "faults"], check=True, capture_output=True, text=True).stdout
    rows, fault = {}, None
    for line in out.splitlines():
        if line and not line.startswith(" "):
            fault = line.strip()
            rows[fault] = set()
        m = re.match(r"\s+caught by:\s*(.*)$", line)
        if m and fault:
            rows[fault] = {("resume" if c.strip() == "resume_cross_mesh" else c.strip())
                           for c in m.group(1).split(",") if c.strip()}
    return rows


def run(cmd, out):
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    report = None
    if os.path.exists(os.path.join(out, "report.json")):
        with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
            report = json.load(f)
    return p.returncode, report, p.stdout + p.stderr


def main():
    meshproof, scenarios, golden, out = sys.argv[1:5]
    rows = catalog(meshproof)
    if not rows:
        print("meshproof faults listed no fault")
        return 1
    problems = []
    for fault, kinds in rows.items():
        path = os.path.join(scenarios, "faults", fault + ".yaml")
        base = [meshproof, "run", path, "--golden-dir", golden, "--backend", "cpu", "--quiet"]
        t0 = time.time()
        rc, rep, log = run(base + ["--out", os.path.join(out, fault)], os.path.join(out, fault))
        bad = []
        if rc != 0 or rep is None:
            bad.append("fault run exited %d: %s" % (rc, log.strip()[-400:]))
        else:
            for s in rep["scenarios"]:
                failing = {c["kind"] for c in s["checks"] if c["verdict"] == "fail"}
                if s["verdict"] != "pass" or not s["caught_by"]:
                    bad.append("%s: verdict %s, caught_by %s" % (s["name"], s["verdict"],
                                                                 s["caught_by"]))
                for k in s["caught_by"]:
                    if k not in kinds or k not in failing:
                        bad.append("%s: caught by %s, not an intended failing check (%s)" %
                                   (s["name"], k, sorted(kinds)))
        clean = os.path.join(out, fault + ".clean")
        rc, rep, log = run(base + ["--set", "faults=[]", "--set", "expect=pass", "--out", clean],
                           clean)
        if rc != 0 or rep is None:
            bad.append("negative control exited %d: %s" % (rc, log.strip()[-400:]))
        else:
            for s in rep["scenarios"]:
                if s["verdict"] != "pass" or s["caught_by"] or not s["checks"]:
                    bad.append("control %s: verdict %s, caught_by %s, %d checks" %
                               (s["name"], s["verdict"], s["caught_by"], len(s["checks"])))
                for c in s["checks"]:
                    if c["verdict"] != "pass":
                        bad.append("control %s: check %s %s: %s" % (s["name"], c["name"],
                                                                    c["verdict"], c["message"]))
        print("%-36s %s (%.1f s)" % (fault, "ok" if not bad else "FAIL", time.time() - t0))
        for b in bad:
            print("    " + b)
        problems += [(fault, b) for b in bad]
    print("%d faults, %d caught with a clean negative control, %d problems" %
          (len(rows), len(rows) - len({f for f, _ in problems}), len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
