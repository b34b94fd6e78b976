#!/usr/bin/python3
"""Checks a report written by `meshproof bench recipes` (tests/harness/bench/CMakeLists.txt).

usage: check_bench_report.py OUT_DIR SCHEMA_JSON SHAPES

- report.json validates against reports/schema/report.schema.json;
- scenario recipes.ceilings has the copy bandwidth and one bf16 GEMM per shape;
- every recipe (fp32, bf16, delayed, current, mxfp8, block, nvfp4) has a scenario with the GEMM
  figures of every role (fprop, dgrad, wgrad) and shape, quantize (cast for bf16) figures of the
  activation and weight operands (none for fp32), the layer step and a performance section;
- every figure is positive, ratio == value / ceiling, and quantize ceilings are the copy
  bandwidth;
- report.md lists every figure.
Exits 1 with a list of problems.
"""
import json
import math
import sys

import jsonschema

problems = []


def expect(cond, what):
    if not cond:
        problems.append(what)


def main():
    out_dir, schema_path, shapes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    with open(schema_path, encoding="utf-8") as f:
        schema = json.load(f)
    with open(out_dir + "/report.json", encoding="utf-8") as f:
        report = json.load(f)
    for e in jsonschema.Draft202012Validator(schema).iter_errors(report):
        problems.append("schema: %s at %s" % (e.message, "/".join(map(str, e.path))))
    by_name = {s["name"]: s for s in report["scenarios"]}
    with open(out_dir + "/report.md", encoding="utf-8") as f:
        md = f.read()

    ceil = by_name.get("recipes.ceilings")
    expect(ceil is not None, "no recipes.ceilings scenario")
    copy = None
    if ceil:
        figs = {(b["name"], b["metric"]): b for b in ceil["benchmarks"]}
        copy = figs.get(("copy host memcpy", "gbps"))
        expect(copy is not None and copy["value"] > 0, "no positive copy bandwidth")
        for s in shapes:
            g = figs.get(("bf16 gemm fprop " + s, "tflops"))
            expect(g is not None and g["value"] > 0, "no bf16 ceiling GEMM for " + s)

    for recipe in ("fp32", "bf16", "delayed", "current", "mxfp8", "block", "nvfp4"):
        s = by_name.get("recipes." + recipe)
        expect(s is not None, "no scenario for recipe " + recipe)
        if s is None:
            continue
        expect(s["recipe"] == recipe and s["verdict"] == "pass", "%s: recipe/verdict" % recipe)
        figs = {(b["name"], b["metric"]): b for b in s["benchmarks"]}
        want = []
        for shape in shapes:
            m, n, k = shape.split("x")
            for role in ("fprop", "dgrad", "wgrad"):
                want.append(("gemm %s %s" % (role, shape), "tflops"))
            if recipe != "fp32":
                verb = "cast" if recipe == "bf16" else "quantize"
                want.append(("%s activation %sx%s" % (verb, m, k), "gbps"))
                want.append(("%s weight %sx%s" % (verb, n, k), "gbps"))
        want += [("layer step", "step_time_ms"), ("layer step", "tokens_per_s"),
                 ("layer step", "tflops")]
        for key in want:
            b = figs.get(key)
            expect(b is not None, "%s: missing figure %s" % (recipe, key))
            if b is None:
                continue
            expect(b["value"] > 0, "%s %s: value %r" % (recipe, key, b["value"]))
            # The median lies within the measured range of the timed iterations.
            expect(b["min"] is not None and b["max"] is not None
                   and b["min"] <= b["value"] * (1 + 1e-12) and b["value"] <= b["max"] * (1 + 1e-12),
                   "%s %s: value %r outside its range %r..%r" % (recipe, key, b["value"], b["min"],
                                                                b["max"]))
            expect(("| %s | %s |" % key) in md, "report.md lacks %s %s" % (recipe, key))
            if b["ceiling"] is not None:
                expect(math.isclose(b["ratio"], b["value"] / b["ceiling"], rel_tol=1e-9),
                       "%s %s: ratio %r != value/ceiling" % (recipe, key, b["ratio"]))
            if key[1] == "gbps" and copy is not None:
                expect(b["ceiling"] == copy["value"] and b["ceiling_source"] == "measured:copy",
                       "%s %s: quantize ceiling is not the copy bandwidth" % (recipe, key))
            if key[1] == "tflops":
                # CPU: no table entry, so the measured bf16 GEMM is the calibration peak.
                expect(b["ceiling_source"] == "calibration:measured bf16 gemm",
                       "%s %s: ceiling source %r" % (recipe, key, b["ceiling_source"]))
        expect(len(figs) == len(want), "%s: %d figures, expected %d" % (recipe, len(figs), len(want)))
        p = s["performance"]
        expect(p is not None and p["median_step_time_s"] > 0 and p["mfu"] is not None,
               "%s: performance section" % recipe)
        if p is not None and ("layer step", "step_time_ms") in figs:
            expect(math.isclose(p["median_step_time_s"] * 1e3,
                                figs[("layer step", "step_time_ms")]["value"], rel_tol=1e-12),
                   "%s: performance step time != layer step figure" % recipe)

    if problems:
        print("\n".join(problems))
        return 1
    print("bench report in %s: OK (%d scenarios)" % (out_dir, len(report["scenarios"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
