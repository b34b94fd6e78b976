#!/usr/bin/env python3
"""`report compare` on two real bench recipes runs judges changes against the measured noise.

Usage: check_compare_noise.py MESHPROOF RUN_A_DIR WORK_DIR ITERS

RUN_A is a real CPU run measuring bf16. Checks:
  1. every timed figure keeps its ITERS raw repetitions (`samples`), inside its [min, max];
  2. A vs a copy of A with the bf16 layer step made slower (every repetition times 2, or times
     twice A's max/min spread when that is more, so the ranges cannot overlap): compare flags
     that row "worse";
  3. A vs a synthetic rerun of A (the same repetitions in another order, each 3% slower: a
     drift under the default 5% floor whose range is disjoint from A's whenever A's spread is
     under 3%): compare does not flag that row.
The rerun is synthetic on purpose: a real second run on a shared CI machine can be slower by
any amount (an earlier version compared two real runs and failed in CI when other jobs
loaded the 2 cores during one of them), so whether a real rerun is "within noise" is a
property of the machine, not of `report compare`, and is not asserted here.
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
    meshproof, dir_a, work, iters = sys.argv[1:5]
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

    os.makedirs(work, exist_ok=True)

    def variant(name, factor, reorder):
        """A copy of A with the bf16 layer step's repetitions scaled by `factor` (and reversed
        when `reorder`); value, min and max recomputed from them as the writer does."""
        out = copy.deepcopy(a)
        hit = False
        for s in out["scenarios"]:
            if s["name"] != ROW[0]:
                continue
            for b in s["benchmarks"]:
                if b["name"] == "layer step" and b["metric"] == "step_time_ms":
                    for k in ("value", "min", "max"):
                        b[k] *= factor
                    b["samples"] = [v * factor for v in b["samples"]]
                    if reorder:
                        b["samples"].reverse()
                    hit = True
        if not hit:
            fail("no bf16 layer step time in " + path_a)
        path = os.path.join(work, name + ".json")
        with open(path, "w") as f:
            json.dump(out, f)
        return path

    # The slowdown: 2x, or more when this run's spread is wider (a loaded machine measured
    # 9..81 ms for this step): twice the ratio of its slowest to fastest repetition puts every
    # slowed repetition above every measured one, so the ranges are disjoint by construction.
    step = next(b for s in a["scenarios"] if s["name"] == ROW[0] for b in s["benchmarks"]
                if b["name"] == "layer step" and b["metric"] == "step_time_ms")
    factor = max(2.0, 2.0 * max(step["samples"]) / min(step["samples"]))
    line = compare_row(meshproof, path_a, variant("slowed", factor, False))
    if not line.rstrip().endswith("worse"):
        fail(f"an injected {factor:.3g}x slowdown was not flagged worse: " + line)
    line = compare_row(meshproof, path_a, variant("rerun", 1.03, True))
    if not line.rstrip().endswith("within noise"):
        fail("a 3% drift (under the 5% floor) was flagged: " + line)
    print(f"ok: {timed} timed figures keep {iters} samples; 2x slowdown flagged; "
          "3% drift within noise")


if __name__ == "__main__":
    main()
