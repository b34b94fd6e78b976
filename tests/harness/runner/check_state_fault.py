#!/usr/bin/python3
"""A save-side fault's state scenario (scenarios/faults/state/, issue #46) is caught by the state
check alone, naming the first failing key.

usage: check_state_fault.py OUT_DIR KEY_REGEX missing|value -- MESHPROOF run SCENARIO.yaml ...

Requires exit 0 (expect: caught met), one scenario with verdict pass and caught_by ["state"], and
its failing state check naming a key that matches KEY_REGEX in its evidence and its message:
`missing` as "not in the checkpoint", `value` with the first element and its ULP distance
(evidence.ulp_distance >= 1, "ULP apart" in the message). Exits 1 naming what differed.
"""
import json
import re
import shutil
import subprocess
import sys


def main(argv):
    out, key_regex, kind = argv[1], argv[2], argv[3]
    assert argv[4] == "--" and kind in ("missing", "value"), __doc__
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run(argv[5:], capture_output=True, text=True)
    print(p.stdout + p.stderr)
    problems = []
    if p.returncode != 0:
        problems.append("exit %d, expected 0 (expect: caught met)" % p.returncode)
    with open(out + "/report.json", encoding="utf-8") as f:
        (s,) = json.load(f)["scenarios"]
    if s["verdict"] != "pass" or s["caught_by"] != ["state"]:
        problems.append("verdict %s, caught_by %s (expected pass, [state])" %
                        (s["verdict"], s["caught_by"]))
    failing = [c for c in s["checks"] if c["kind"] == "state" and c["verdict"] == "fail"]
    if not failing:
        problems.append("no failing state check: %s" % s["checks"])
    else:
        c = failing[0]
        ev = c.get("evidence") or {}
        named = ev.get("tensor", "")
        if not re.fullmatch(key_regex, named) or named not in c["message"]:
            problems.append("names %r, expected a key matching %s: %s" %
                            (named, key_regex, c["message"]))
        if kind == "missing" and "not in the checkpoint" not in c["message"]:
            problems.append("a dropped key must read 'not in the checkpoint': " + c["message"])
        if kind == "value" and (ev.get("ulp_distance", 0) < 1 or "ULP apart" not in c["message"]):
            problems.append("a value difference must carry its ULP distance: %s %s" %
                            (ev, c["message"]))
    for m in problems:
        print("FAIL: " + m)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
