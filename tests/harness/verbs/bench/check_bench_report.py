#!/usr/bin/python3
"""Checks a report written by `meshproof bench recipes` on the CPU (tests/harness/verbs/bench/CMakeLists.txt).

usage: check_bench_report.py OUT_DIR SCHEMA_JSON SHAPES MODEL M_SWEEP

MODEL is hidden,ffn,heads,kv_heads,seq,micro_batch (GELU); SHAPES the extra MxNxK GEMMs
("custom"); M_SWEEP the swept token counts.
- report.json validates against reports/schema/report.schema.json;
- the GEMM shapes are derived here independently of the C++: per linear (qkv 3H x H, proj H x H,
  fc1 F x H, fc2 H x F, then the custom shapes) and role, fprop (T, out, in), dgrad (T, in, out),
  wgrad (out, in, T) with T = seq * micro_batch; recipes.ceilings has a bf16 GEMM for each;
- every recipe (fp32, bf16, delayed, current, mxfp8, block) has per GEMM bf16_ms, gemm_ms,
  gemm_tflops, speedup_autocast, speedup_prequantized (and quantize_ms for the FP8 recipes), with
  autocast == bf16 / (gemm + quantize) and pre-quantized == bf16 / gemm; the sweep's fprop
  figures for every M the recipe can take (MXFP8: M % 32 == 0); the grouped expert GEMM's
  figures over the uneven split T/2, 3T/8, 0, T/8 and its padded blocks; the layer step figures;
- every figure is positive, within its range, labelled "CPU emulation" (JSON and report.md),
  and there is no MFU and no table or calibration peak (CPU backend).
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


def gemms(h, f, t, custom):
    linears = [("qkv", 3 * h, h), ("proj", h, h), ("fc1", f, h), ("fc2", h, f)]
    out = []
    for name, n, k in linears:
        out.append((name, t, n, k))
    for s in custom:
        m, n, k = map(int, s.split("x"))
        out.append(("custom", m, n, k))
    names = []
    for name, m, n, k in out:
        for role, dims in (("fprop", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (n, k, m))):
            names.append("%s %s %dx%dx%d" % ((name, role) + dims))
    return names


def main():
    out_dir, schema_path = sys.argv[1], sys.argv[2]
    custom = sys.argv[3].split(",")
    h, f, _, _, seq, mb = map(int, sys.argv[4].split(","))
    sweep = [int(m) for m in sys.argv[5].split(",")]
    with open(schema_path, encoding="utf-8") as fh:
        schema = json.load(fh)
    with open(out_dir + "/report.json", encoding="utf-8") as fh:
        report = json.load(fh)
    for e in jsonschema.Draft202012Validator(schema).iter_errors(report):
        problems.append("schema: %s at %s" % (e.message, "/".join(map(str, e.path))))
    by_name = {s["name"]: s for s in report["scenarios"]}
    with open(out_dir + "/report.md", encoding="utf-8") as fh:
        md = fh.read()
    names = gemms(h, f, seq * mb, custom)

    ceil = by_name.get("recipes.ceilings")
    expect(ceil is not None, "no recipes.ceilings scenario")
    if ceil:
        figs = {(b["name"], b["metric"]): b for b in ceil["benchmarks"]}
        copy = figs.get(("copy host memcpy", "gbps"))
        expect(copy is not None and copy["value"] > 0, "no positive copy bandwidth")
        for n in names:
            g = figs.get(("bf16 gemm " + n, "tflops"))
            expect(g is not None and g["value"] > 0, "no bf16 ceiling GEMM for " + n)
        expect(len(figs) == len(names) + 1, "ceilings: %d figures, want %d" % (len(figs), len(names) + 1))

    for recipe in ("fp32", "bf16", "delayed", "current", "mxfp8", "block", "nvfp4"):
        s = by_name.get("recipes." + recipe)
        expect(s is not None, "no scenario for recipe " + recipe)
        if s is None:
            continue
        expect(s["recipe"] == recipe and s["verdict"] == "pass", "%s: recipe/verdict" % recipe)
        fp8 = recipe not in ("fp32", "bf16")
        figs = {(b["name"], b["metric"]): b for b in s["benchmarks"]}
        want = []
        role_names = list(names)
        for m in sweep:
            if recipe == "mxfp8" and m % 32:
                continue
            for name, n, k in (("qkv", 3 * h, h), ("proj", h, h), ("fc1", f, h), ("fc2", h, f)):
                role_names.append("sweep %s fprop %dx%dx%d" % (name, m, n, k))
        # The grouped expert GEMM: fc1 as 4 experts over T tokens split T/2, 3T/8, 0, T/8, each
        # expert padded to the recipe's alignment (an empty one to one block when quantized).
        t = seq * mb
        rows = [t // 2, 3 * t // 8, 0, t // 8]
        align = {"fp32": 1, "bf16": 1, "delayed": 16, "current": 16, "nvfp4": 16, "mxfp8": 32,
                 "block": 128}[recipe]
        padded = [-(-max(r, 1 if fp8 else 0) // align) * align for r in rows]
        split = s["config"].get("grouped_split", {})
        expect(split.get("rows") == rows and split.get("padded_rows") == padded
               and split.get("alignment") == align,
               "%s: grouped_split %r, want rows %r padded %r" % (recipe, split, rows, padded))
        label = "grouped experts fc1 rows %s" % "/".join(map(str, rows))
        for role, dims in (("fprop", (t, f, h)), ("dgrad", (t, h, f)), ("wgrad", (f, h, t))):
            role_names.append("%s %s %dx%dx%d" % ((label, role) + dims))
        for n in role_names:
            metrics = ["bf16_ms", "gemm_ms", "gemm_tflops", "speedup_autocast", "speedup_prequantized"]
            if fp8:
                metrics.append("quantize_ms")
            want += [(n, x) for x in metrics]
            if all((n, x) in figs for x in metrics):
                b, g = figs[(n, "bf16_ms")]["value"], figs[(n, "gemm_ms")]["value"]
                q = figs[(n, "quantize_ms")]["value"] if fp8 else 0.0
                # The printed figures round-trip as doubles; the C++ divides the same medians.
                expect(math.isclose(figs[(n, "speedup_autocast")]["value"], b / (g + q), rel_tol=1e-9),
                       "%s %s: autocast speedup != bf16 / (gemm + quantize)" % (recipe, n))
                expect(math.isclose(figs[(n, "speedup_prequantized")]["value"], b / g, rel_tol=1e-9),
                       "%s %s: pre-quantized speedup != bf16 / gemm" % (recipe, n))
        want += [("layer step", m) for m in ("step_time_ms", "tokens_per_s", "tflops",
                                             "speedup_vs_bf16", "peak_memory_mib")]
        for key in want:
            b = figs.get(key)
            expect(b is not None, "%s: missing figure %s" % (recipe, key))
        for key, b in figs.items():
            expect(b["value"] > 0, "%s %s: value %r" % (recipe, key, b["value"]))
            if b["min"] is not None:
                expect(b["min"] <= b["value"] * (1 + 1e-12) and b["value"] <= b["max"] * (1 + 1e-12),
                       "%s %s: value outside its range" % (recipe, key))
            expect(b.get("emulated") == "CPU emulation", "%s %s: not labelled CPU emulation" % (recipe, key))
            expect(("| %s (emulated: CPU emulation) | %s |" % key) in md,
                   "report.md lacks the labelled row %s %s" % (recipe, key))
            expect(b["ceiling_source"] in ("", "measured:copy"),
                   "%s %s: ceiling source %r on the CPU" % (recipe, key, b["ceiling_source"]))
        p = s["performance"]
        expect(p is not None and p["median_step_time_s"] > 0 and p["mfu"] is None
               and p["peak_tflops"] is None, "%s: performance section (no MFU on the CPU)" % recipe)

    if problems:
        print("\n".join(problems))
        return 1
    print("bench report in %s: OK (%d scenarios)" % (out_dir, len(report["scenarios"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
