#!/usr/bin/env python3
"""`report compare` on two real bench recipes runs judges changes against the measured noise.

Usage: check_compare_noise.py MESHPROOF RUN_A_DIR RUN_B_DIR WORK_DIR ITERS

RUN_A and RUN_B are two CPU runs of the same command (a rerun) measuring bf16. Checks:
  1. every timed figure keeps its ITERS raw repetitions (`samples`), inside its [min, max];
  2. A vs a copy of A with the bf16 layer step made 2x slower (every repetition doubled, so its
     noise range doubles too): compare flags that row "worse";
  3. A vs B (the rerun): compare does not flag that row.
Exit status 0 when all hold, 1 otherwise (the reason on stderr).
"""
import copy
import json
import os
import re
import subprocess
import sys

ROW = "recipes.bf16", "layer step step_time_ms"


def fail(msg):
    print("check_compare_noise: " + msg, file=sys.stderr)
    sys.exit(1)


def compare_row(meshproof, a, b):
    out = subprocess.run([meshproof, "report", "compare", a, b], capture_output=True, text=True)
    if out.returncode not in (0, 1):
        fail(f"report compare {a} {b} exited {out.returncode}: {out.stderr}")
    for line in out.stdout.splitlines():
        if line.startswith(ROW[0] + " ") and re.search(r"\s" + re.escape(ROW[1]) + r"\s", line):
            return line
    fail(f"no row '{ROW[0]} {ROW[1]}' in:\n{out.stdout}")


def main():
    meshproof, dir_a, dir_b, work, iters = sys.argv[1:6]
    iters = int(iters)
    path_a = os.path.join(dir_a, "report.json")
    with open(path_a) as f:
        a = json.load(f)
    timed = 0
    for s in a["scenarios"]:
        for b in s["benchmarks"]:
            if b["unit"] != "ms":
                continue
            timed += 1
            samples = b.get("samples")
            if samples is None or len(samples) != iters:
                fail(f"{s['name']} {b['name']} {b['metric']}: {iters} samples expected, got {samples}")
            # 1e-9 relative: min/max and samples are the same doubles, printed by the same writer.
            if not all(b["min"] * (1 - 1e-9) <= v <= b["max"] * (1 + 1e-9) for v in samples):
                fail(f"{s['name']} {b['name']} {b['metric']}: samples outside [min, max]")
    if timed == 0:
        fail("no timed figures in " + path_a)

    slowed = copy.deepcopy(a)
    hit = False
    for s in slowed["scenarios"]:
        if s["name"] != ROW[0]:
            continue
        for b in s["benchmarks"]:
            if b["name"] == "layer step" and b["metric"] == "step_time_ms":
                for k in ("value", "min", "max"):
                    b[k] *= 2
                b["samples"] = [v * 2 for v in b["samples"]]
                hit = True
    if not hit:
        fail("no bf16 layer step time to slow down")
    os.makedirs(work, exist_ok=True)
    path_slow = os.path.join(work, "slowed.json")
    with open(path_slow, "w") as f:
        json.dump(slowed, f)

    line = compare_row(meshproof, path_a, path_slow)
    if not line.rstrip().endswith("worse"):
        fail("an injected 2x slowdown was not flagged worse: " + line)
    line = compare_row(meshproof, path_a, os.path.join(dir_b, "report.json"))
    if not line.rstrip().endswith("within noise"):
        fail("a rerun was flagged: " + line)
    print(f"ok: {timed} timed figures keep {iters} samples; 2x slowdown flagged; rerun within noise")


if __name__ == "__main__":
    main()
