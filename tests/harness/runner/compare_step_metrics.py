#!/usr/bin/env python3
"""compare_step_metrics.py A/report.json B/report.json

Requires the two reports to hold the same scenarios, each with the same number of steps and
bitwise-equal per-step loss and grad_norm (report.json writes doubles in round-trip form), and
every scenario's verdict "pass". Used to show that the mpi launcher reproduces the local one.
"""
import json
import sys


def load(path):
    with open(path) as f:
        return {s["name"]: s for s in json.load(f)["scenarios"]}


def main():
    a, b = load(sys.argv[1]), load(sys.argv[2])
    if sorted(a) != sorted(b):
        sys.exit(f"scenarios differ: {sorted(a)} vs {sorted(b)}")
    for name in sorted(a):
        sa, sb = a[name], b[name]
        for s, path in ((sa, sys.argv[1]), (sb, sys.argv[2])):
            if s["verdict"] != "pass":
                sys.exit(f"{path}: {name}: verdict {s['verdict']}")
        if len(sa["steps"]) != len(sb["steps"]) or not sa["steps"]:
            sys.exit(f"{name}: {len(sa['steps'])} vs {len(sb['steps'])} steps")
        for x, y in zip(sa["steps"], sb["steps"]):
            for key in ("loss", "grad_norm"):
                if float(x[key]).hex() != float(y[key]).hex():
                    sys.exit(f"{name}: step {x['step']}: {key} {x[key]!r} vs {y[key]!r}")
        print(f"{name}: {len(sa['steps'])} steps of loss and grad_norm bitwise equal")


if __name__ == "__main__":
    main()
