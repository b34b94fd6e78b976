"""One library scenario run with a chosen set of checks: the part check_library_state.py and
check_library_collectives.py share (each then judges its own check in the report)."""
import json
import os
import subprocess


def run_with_checks(meshproof, scenario, dest, checks, problems):
    """Runs `scenario` on the CPU into `dest` with `--set checks={...}` (`checks`: the mapping's
    entries as YAML text); prints the command and its output; returns report.json, or None with
    the reason appended to `problems`. A non-zero exit is appended to `problems` too."""
    name = os.path.basename(scenario)
    cmd = [meshproof, "run", scenario, "--backend", "cpu", "--out", dest, "--quiet", "--set",
           "checks={" + ", ".join(checks) + "}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(" ".join(cmd))
    print(p.stdout + p.stderr)
    if p.returncode != 0:
        problems.append("%s: exit %d" % (name, p.returncode))
    try:
        with open(os.path.join(dest, "report.json")) as f:
            return json.load(f)
    except OSError as e:
        problems.append("%s: no report (%s), exit %d" % (name, e, p.returncode))
        return None


def judge_check(report, kind, problems):
    """The scenarios of `report` and their `kind` check: returns (ran, passed) where ran counts
    every scenario and passed lists (scenario, check) of those whose check passed. A scenario
    skipped for requires_gpu without a GPU is counted, not judged; a failing check, or a scenario
    whose verdict is not pass, is appended to `problems`."""
    ran, passed = 0, []
    for s in report["scenarios"]:
        ran += 1
        if s["verdict"] == "skipped" and s.get("config", {}).get("requires_gpu"):
            continue
        c = {c["kind"]: c for c in s["checks"]}.get(kind)
        if c is None or c["verdict"] != "pass":
            problems.append("%s: %s %s" % (s["name"], kind, c and (c["verdict"], c["message"])))
            continue
        if s["verdict"] != "pass":
            problems.append("%s: verdict %s" % (s["name"], s["verdict"]))
        passed.append((s, c))
    return ran, passed
