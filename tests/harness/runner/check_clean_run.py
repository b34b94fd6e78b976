#!/usr/bin/python3
"""Negative control of a fault scenario: runs it with its faults removed and requires a clean pass.

usage: check_clean_run.py OUT_DIR -- MESHPROOF run FAULT.yaml ... --set faults=[] --set expect=pass

Requires exit 0 and, in OUT_DIR/report.json, a run verdict `pass` with every scenario `pass`
(not `skipped`: a skipped run would pass vacuously) and every check `pass`. Exits 1 naming what
differed.
"""
import json
import shutil
import subprocess
import sys


def main():
    out = sys.argv[1]
    assert sys.argv[2] == "--", "usage: see the docstring"
    shutil.rmtree(out, ignore_errors=True)
    rc = subprocess.run(sys.argv[3:]).returncode
    if rc != 0:
        print("the fault-free run exited %d, expected 0" % rc)
        return 1
    with open(out + "/report.json", encoding="utf-8") as f:
        report = json.load(f)
    problems = []
    if report["verdict"] != "pass":
        problems.append("run verdict %s" % report["verdict"])
    for s in report["scenarios"]:
        if s["verdict"] != "pass" or s["expectation"] != "pass" or s["caught_by"]:
            problems.append("%s: verdict %s, expectation %s, caught_by %s" %
                            (s["name"], s["verdict"], s["expectation"], s["caught_by"]))
        if not s["checks"]:
            problems.append("%s: no checks ran" % s["name"])
        for c in s["checks"]:
            if c["verdict"] != "pass":
                problems.append("%s: check %s %s: %s" % (s["name"], c["name"], c["verdict"], c["message"]))
    if problems:
        print("\n".join(problems))
        return 1
    print("clean run passes: %s" % ", ".join(
        "%s (%s)" % (s["name"], ", ".join(c["name"] for c in s["checks"])) for s in report["scenarios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
