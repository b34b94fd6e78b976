#!/usr/bin/python3
"""A fault under pipeline stages is caught by the check that catches it on one stage.

usage: check_pp_fault.py MESHPROOF FAULT.yaml GOLDEN_DIR OUT_DIR [--golden-by-numbers] -- SET...

Runs the fault scenario as written (OUT_DIR/pp1) and again with the --set overrides SET... that
put it on pipeline stages (OUT_DIR/pp; e.g. mesh.pp=2 mesh.dp_shard=2), and requires of both
runs: exit 0, the scenario expected `caught` and caught (scenario verdict `pass`: the expectation
met), the same non-empty set of checks catching it (report.json caught_by), and of the staged run: a `pipeline` report with 2 or
more stages (so the fault really ran on stages) and no check failing on the golden's scenario
hash (the staged scenario has its own hash). Exits 1 naming what differed.

--golden-by-numbers: for a fault that only the golden shows. A golden recorded for one stage
cannot judge the staged scenario (another hash), so the catch is carried over by the numbers:
the one-stage run must be caught by its golden; the one-stage scenario without faults must pass
its golden exact (so its loss and grad norm of every step are the golden's); and the staged run
with the fault and the staged run without it (golden check off) must equal the one-stage runs
with and without the fault step for step, bit for bit. Then the staged faulty run leaves the
numbers of the fault-free staged run exactly where the one-stage faulty run leaves the golden's.
The other checks must catch or pass on stages as on one stage.
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
    args = sys.argv[5:]
    by_numbers = args[:1] == ["--golden-by-numbers"]
    if by_numbers:
        args = args[1:]
    assert args[:1] == ["--"], "usage: see the docstring"
    sets = args[1:]
    one = run(meshproof, scenario, golden, out + "/pp1", [])
    staged = run(meshproof, scenario, golden, out + "/pp", sets)
    if by_numbers:
        return judge_by_numbers(meshproof, scenario, golden, out, sets, one, staged)
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


def steps_of(s):
    return [(st["step"], st["loss"], st["grad_norm"]) for st in s["steps"]]


def judge_by_numbers(meshproof, scenario, golden, out, sets, one, staged):
    clean = ["faults=[]", "expect=pass"]
    one_clean = run(meshproof, scenario, golden, out + "/pp1_clean", clean)
    staged_clean = run(meshproof, scenario, golden, out + "/pp_clean",
                       sets + clean + ["checks.golden=false"])
    problems = []
    if one["verdict"] != "pass" or "golden" not in one["caught_by"]:
        problems.append("one stage: not caught by its golden (verdict %s, caught_by %s)" %
                        (one["verdict"], one["caught_by"]))
    for what, s in (("one stage without the fault", one_clean),
                    ("stages without the fault", staged_clean)):
        failing = [c["name"] for c in s["checks"] if c["verdict"] != "pass"]
        # With its golden off, a staged scenario whose only check is the golden runs no check:
        # verdict skipped; its numbers are judged below.
        if s["verdict"] not in ("pass", "skipped") or failing:
            problems.append("%s: verdict %s, failing checks %s" % (what, s["verdict"], failing))
    if not any(c["name"] == "golden" and c["verdict"] == "pass" for c in one_clean["checks"]):
        problems.append("one stage without the fault: no passing golden check")
    for what, a, b in (("with the fault", one, staged), ("without it", one_clean, staged_clean)):
        if not steps_of(a) or steps_of(a) != steps_of(b):
            problems.append("%s, the staged steps are not the one-stage steps bit for bit:\n  %s\n  %s"
                            % (what, steps_of(a), steps_of(b)))
    if steps_of(one) == steps_of(one_clean):
        problems.append("the fault changes no step's loss or grad norm on one stage")
    others_one = {c["name"]: c["verdict"] for c in one["checks"] if c["name"] != "golden"}
    others_staged = {c["name"]: c["verdict"] for c in staged["checks"] if c["name"] != "golden"}
    if others_one != others_staged:
        problems.append("checks besides the golden differ: one stage %s, stages %s" %
                        (others_one, others_staged))
    stages = {st["stage"] for st in staged.get("pipeline") or []}
    if len(stages) < 2:
        problems.append("the staged run reports no pipeline of 2 or more stages")
    if problems:
        print("\n".join(problems))
        return 1
    print("caught by golden on one stage; on %d stages the faulty and the fault-free runs are "
          "the one-stage runs bit for bit (%d steps)" % (len(stages), len(steps_of(staged))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
