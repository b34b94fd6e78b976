#!/usr/bin/python3
"""A fault under pipeline stages is caught by the check that catches it on one stage.

usage: check_pp_fault.py MESHPROOF FAULT.yaml GOLDEN_DIR OUT_DIR -- SET...

Runs the fault scenario as written (OUT_DIR/pp1) and again with the --set overrides SET... that
put it on pipeline stages (OUT_DIR/pp; e.g. mesh.pp=2 mesh.dp_shard=2), and requires of both
runs: exit 0, the scenario expected `caught` and caught (scenario verdict `pass`: the expectation
met), the same non-empty set of checks catching it (report.json caught_by), and of the staged run: a `pipeline` report with 2 or
more stages (so the fault really ran on stages) and no check failing on the golden's scenario
hash (the staged scenario has its own hash). Exits 1 naming what differed.
"""
import json
import shutil
import subprocess
import sys


def run(meshproof, scenario, golden, out, sets):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [meshproof, "run", scenario, "--golden-dir", golden, "--backend", "cpu", "--out", out,
           "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit("%s: exit %d, expected 0\n%s" % (" ".join(cmd), r.returncode, r.stdout))
    with open(out + "/report.json", encoding="utf-8") as f:
        report = json.load(f)
    if len(report["scenarios"]) != 1:
        sys.exit("%s: %d scenarios, expected 1" % (out, len(report["scenarios"])))
    return report["scenarios"][0]


def main():
    meshproof, scenario, golden, out = sys.argv[1:5]
    assert sys.argv[5] == "--", "usage: see the docstring"
    sets = sys.argv[6:]
    one = run(meshproof, scenario, golden, out + "/pp1", [])
    staged = run(meshproof, scenario, golden, out + "/pp", sets)
    problems = []
    for what, s in (("one stage", one), ("stages", staged)):
        if s["expectation"] != "caught" or s["verdict"] != "pass" or not s["caught_by"]:
            problems.append("%s: expectation %s, verdict %s, caught_by %s" %
                            (what, s["expectation"], s["verdict"], s["caught_by"]))
    if sorted(one["caught_by"]) != sorted(staged["caught_by"]):
        problems.append("caught by %s on one stage but by %s on stages" %
                        (sorted(one["caught_by"]), sorted(staged["caught_by"])))
    # The staged scenario has another scenario hash, so a golden of the one-stage scenario fails
    # on the hash, whatever the numbers: such a catch would prove nothing.
    for c in staged["checks"]:
        if c["verdict"] != "pass" and "golden recorded for scenario hash" in c["message"]:
            problems.append("the staged run's %s check failed on the golden's scenario hash, not "
                            "on the numbers: stage a scenario without a golden check" % c["name"])
    stages = {st["stage"] for st in staged.get("pipeline") or []}
    if len(stages) < 2:
        problems.append("the staged run reports no pipeline of 2 or more stages: %s" %
                        staged.get("pipeline"))
    if problems:
        print("\n".join(problems))
        return 1
    messages = {c["name"]: c["message"] for c in staged["checks"] if c["verdict"] == "fail"}
    print("caught on one stage and on %d stages by %s; staged: %s" %
          (len(stages), ", ".join(sorted(staged["caught_by"])), messages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
