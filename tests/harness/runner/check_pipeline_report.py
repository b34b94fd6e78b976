#!/usr/bin/env python3
"""The per-stage pipeline report (docs/design.md section 38) as `meshproof run` writes it.

Runs scenarios/pp_fsdp.yaml (pp 2 x dp_shard 2, 4 layers, 4 micro-batches; its four entries)
and scenarios/quickstart.yaml (one stage) and requires:
- every pp_fsdp scenario's report.json has `pipeline`: stages 0 and 1, ranks [0, 1] and [2, 3],
  layers 0-1 and 2-3, non-negative times whose parts do not exceed the step, the bubble equal to
  p2p wait / step, the predicted bubble the schedule's in unit time (0.2 for 2 stages, 4
  micro-batches, forward 1, backward 2), one peak per rank equal to that rank's `memory` peak; the
  report validates against reports/schema/report.schema.json;
- report.md has the per-stage table with one row per stage, junit.xml the pp_stage properties;
- quickstart's report.json has no `pipeline`, its report.md and junit.xml no stage table or
  properties.
No wall-clock value is asserted beyond that structure and consistency.

  check_pipeline_report.py MESHPROOF SCENARIOS GOLDEN_DIR SCHEMA OUT
"""
import json
import os
import shutil
import subprocess
import sys

import jsonschema

FAILURES = []


def expect(cond, what):
    if not cond:
        FAILURES.append(what)


def run(meshproof, scenario, golden, out, extra):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [meshproof, "run", scenario, "--golden-dir", golden, "--backend", "cpu", "--out", out,
           "--quiet"] + extra
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit("%s: exit %d\n%s" % (" ".join(cmd), r.returncode, r.stdout))
    files = {}
    for name in ("report.json", "report.md", "junit.xml"):
        with open(os.path.join(out, name), encoding="utf-8") as f:
            files[name] = f.read()
    return files


def main():
    meshproof, scenarios, golden, schema_path, out = sys.argv[1:6]
    with open(schema_path, encoding="utf-8") as f:
        schema = json.load(f)

    pp = run(meshproof, os.path.join(scenarios, "pp_fsdp.yaml"), golden, os.path.join(out, "pp"),
             [])
    rep = json.loads(pp["report.json"])
    jsonschema.validate(rep, schema)
    n = len(rep["scenarios"])
    expect(n == 4, "pp_fsdp: %d scenarios, expected 4 (2 schedules x 2 recipes)" % n)
    for s in rep["scenarios"]:
        name = s["name"]
        stages = s.get("pipeline")
        expect(stages is not None and len(stages) == 2, "%s: pipeline %r" % (name, stages))
        if not stages:
            continue
        peaks = {m["rank"]: m["peak_bytes"] for m in s["memory"]}
        for i, st in enumerate(stages):
            where = "%s stage %d" % (name, i)
            expect(st["stage"] == i, "%s: stage %r" % (where, st["stage"]))
            expect(st["ranks"] == [2 * i, 2 * i + 1], "%s: ranks %r" % (where, st["ranks"]))
            expect(st["first_layer"] == 2 * i and st["layers"] == 2,
                   "%s: layers %r+%r" % (where, st["first_layer"], st["layers"]))
            expect(st["warmup_steps"] == 1 and st["steady_steps"] == 3,
                   "%s: steps %r/%r" % (where, st["warmup_steps"], st["steady_steps"]))
            parts = ["forward_s", "backward_s", "p2p_wait_s", "reduction_s", "optimizer_s"]
            expect(all(st[k] >= 0 for k in parts + ["step_s"]), "%s: negative time %r" % (where, st))
            # Relative 1e-9: the means are sums of nanosecond counts scaled to double seconds
            # (rounding ~1e-16 per term), not a timing margin.
            expect(sum(st[k] for k in parts) <= st["step_s"] * (1 + 1e-9),
                   "%s: parts exceed the step %r" % (where, st))
            expect(abs(st["bubble_fraction"] - st["p2p_wait_s"] / st["step_s"]) <= 1e-12,
                   "%s: bubble %r" % (where, st))
            expect(st["predicted_bubble_fraction"] == 0.2, "%s: predicted %r" % (where, st))
            expect(st["peak_bytes"] == [peaks[r] for r in st["ranks"]],
                   "%s: peaks %r vs memory %r" % (where, st["peak_bytes"], peaks))
    md = pp["report.md"]
    header = "| stage | ranks | layers | forward (ms) | backward (ms) | p2p wait (ms) |"
    expect(md.count(header) == n, "pp report.md: %d stage tables" % md.count(header))
    expect(md.count("\n| 0 | 0, 1 | 0-1 | ") == n and md.count("\n| 1 | 2, 3 | 2-3 | ") == n,
           "pp report.md: stage rows")
    expect(pp["junit.xml"].count('name="pp_stage1_bubble"') == n, "pp junit.xml: pp_stage1_bubble")

    flat = run(meshproof, os.path.join(scenarios, "quickstart.yaml"), golden,
               os.path.join(out, "flat"), [])
    for s in json.loads(flat["report.json"])["scenarios"]:
        expect("pipeline" not in s, "quickstart %s: has a pipeline section" % s["name"])
    expect("| stage | ranks |" not in flat["report.md"], "quickstart report.md: a stage table")
    expect("pp_stage" not in flat["junit.xml"], "quickstart junit.xml: pp_stage properties")

    for f in FAILURES:
        print("FAIL:", f)
    if FAILURES:
        sys.exit(1)
    print("pipeline report: ok")


if __name__ == "__main__":
    main()
