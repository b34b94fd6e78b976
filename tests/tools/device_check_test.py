"""tools/device-check, as a session with a GPU will use it, on a machine without one:
pack a bundle (two GPU test binaries, the fastest xz level), run its rehearsal (the whole flow on the
CPU backend) and the real run (which must stop at `env` without a usable GPU), and check what comes
back against the device tool's limits (at most 8 files, 16 MiB each, plain names). Then the
script's judgements on synthetic inputs: GoogleTest XML counts, the scenario rows (a device check
failing is "not met", a golden miss alone is data, a fault must be caught), and the torch ratios.

  device_check_test.py SOURCE_DIR BUILD_DIR WORK_DIR
"""
import importlib.machinery
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

src, build, work = map(Path, sys.argv[1:4])
tool = src / "tools" / "device-check"
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(*args, **kw):
    p = subprocess.run([sys.executable, str(tool), *map(str, args)], capture_output=True,
                       text=True, **kw)
    print(p.stdout[-3000:] + p.stderr[-3000:])
    return p


def out_within_limits(out):
    files = sorted(out.iterdir())
    check(0 < len(files) <= 8, f"{out}: {len(files)} files, at most 8")
    for f in files:
        check(f.is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", f.name) is not None,
              f"{f.name}: a plain file with a plain name")
        check(f.stat().st_size <= 16 << 20, f"{f.name}: at most 16 MiB")


shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)
bundle = work / "bundle.tar.xz"

# 1. pack: a bundle that fits the carry; a missing build is bad usage. Two small binaries with
# "gpu" in their names, as far as this build has them (the sanitizer build leaves out the
# gpu-labelled suites such as kernels_formats_gpu_test; kernels_gpu_policy_test is a cpu suite).
bins = [n for n in ["kernels_formats_gpu_test", "kernels_gpu_policy_test"]
        if any(build.glob(f"tests/**/{n}"))]
check("kernels_gpu_policy_test" in bins, "the build has kernels_gpu_policy_test")
p = run("pack", "--build", build, "--out", bundle, *[x for n in bins for x in ("--bin", n)],
        "--rehearse", "--xz-level", "0")
check(p.returncode == 0 and bundle.is_file(), "pack writes the bundle")
check("carry=[" in p.stdout, "pack prints the device call")
p = run("pack", "--build", work / "no-build", "--out", work / "x.tar.xz")
check(p.returncode == 2 and "not built" in p.stderr, "pack without a build: exit 2")

# 2. the rehearsal: every step it can run passes, the outputs fit.
out = work / "out"
p = run("run", "--bundle", bundle, "--out", out, "--work", work / "work", "--rehearse",
        "--scenarios", "quickstart", "--steps", "gtest,scenarios,bench,model", "--budget", "300")
check(p.returncode == 0, "rehearsal exits 0")
summary = json.loads((out / "summary.json").read_text())
steps = summary["steps"]
check(list(steps) == ["env", "gtest", "scenarios", "bench", "model"],
      "env runs first, then the steps asked")
check(all(steps[s]["status"] == "pass" for s in steps), "every rehearsed step passes")
check([b["binary"] for b in steps["gtest"]["binaries"]] == bins, "every bundled binary ran")
check(steps["gtest"]["tests"] > 0 and steps["gtest"]["failures"] == 0, "their tests counted")
rows = [r for r in steps["scenarios"]["scenarios"] if "met" in r]
check([r["name"] for r in rows] == ["quickstart"] and rows[0]["met"], "quickstart met")
check(rows[0]["golden_rel"] == {"loss": 0.0, "grad_norm": 0.0},
      "on the CPU the golden distance is zero")
ratios = steps["bench"]["vs_torch"]
check(len(ratios) == 2 and all(r["meshproof_ms"] for r in ratios),
      "bench recipes' times found for the torch comparison")
check((out / "rehearsal-cpu.json").is_file(), "the bench results file comes back")
model = steps["model"]
check(set(model["meshproof_1rank"]) == {"bf16", "current"} and
      set(model["meshproof_8ranks"]) == {"bf16"}, "the model ran on 1 rank (2 recipes), 8 ranks")
check(model["bf16_over_current"] is not None and model["8ranks_over_1rank"] is not None,
      "the model's ratios computed")
md = (out / "summary.md").read_text()
check("| quickstart.yaml | quickstart |" in md, "summary.md tables the scenario")
out_within_limits(out)

# 3. the real run without a GPU: stops at env with the reason, says what did not run.
env = json.loads(subprocess.run([str(build / "harness" / "meshproof"), "env", "--json"],
                                capture_output=True, text=True, check=True).stdout)
if not env.get("cuda", {}).get("usable"):
    out2 = work / "out2"
    p = run("run", "--bundle", bundle, "--out", out2, "--work", work / "work2", "--budget", "60")
    check(p.returncode == 1, "without a GPU the real run exits 1")
    s2 = json.loads((out2 / "summary.json").read_text())["steps"]
    check(s2["env"]["status"] == "fail" and "no usable GPU" in s2["env"]["detail"],
          "env names the missing GPU")
    check(all(s2[k]["status"] == "not run" and "no usable GPU" in s2[k]["detail"]
              for k in s2 if k != "env"), "nothing else ran, each saying why")
    out_within_limits(out2)
else:
    print("skip 3: this machine has a usable GPU (the real run is device-check's job there)")

# 4. bad usage.
p = run("run", "--bundle", bundle, "--out", work / "o3", "--steps", "env,bogus")
check(p.returncode == 2 and "unknown bogus" in p.stderr, "an unknown step: exit 2")
p = run("run", "--bundle", bundle, "--out", work / "o4", "--budget", "5")
check(p.returncode == 2 and "--budget" in p.stderr, "a budget under 30 s: exit 2")
check(not (work / "o3").exists() and not (work / "o4").exists(), "bad usage writes nothing")

# 5. the judgements, on synthetic inputs.
loader = importlib.machinery.SourceFileLoader("device_check", str(tool))
spec = importlib.util.spec_from_loader("device_check", loader)
dc = importlib.util.module_from_spec(spec)
loader.exec_module(dc)

xml = work / "g.xml"
xml.write_text('<testsuites><testsuite name="S"><testcase classname="S" name="a"/>'
               '<testcase classname="S" name="b"><failure message="x"/></testcase>'
               '<testcase classname="S" name="c"><skipped/></testcase></testsuite></testsuites>')
c = dc.parse_gtest_xml(xml)
check((c["tests"], c["failures"], c["skipped"], c["failed"]) == (3, 1, 1, ["S.b"]),
      "gtest XML: 3 tests, S.b failed, one skipped")


def report(**scenario):
    base = {"name": "s", "expectation": "pass", "verdict": "pass", "checks": [],
            "caught_by": [], "error": "", "steps": [], "golden": None}
    base.update(scenario)
    d = work / "rep"
    d.mkdir(exist_ok=True)
    (d / "report.json").write_text(json.dumps({"scenarios": [base]}))
    return dc.read_report(d / "report.json")[0]


r = report(checks=[{"name": "resume", "verdict": "fail"}, {"name": "golden", "verdict": "pass"}])
check(not r["met"], "a device check that fails: not met")
r = report(verdict="fail", checks=[{"name": "resume", "verdict": "pass"},
                                   {"name": "golden", "verdict": "fail"}],
           steps=[{"step": 1, "loss": 2.2, "grad_norm": 1.0}],
           golden={"steps": [{"step": 1, "loss": 2.0, "grad_norm": 1.0}]})
check(r["met"] and abs(r["golden_rel"]["loss"] - 0.1) < 1e-12 and r["golden_rel"]["grad_norm"] == 0,
      "a golden miss alone is met, with the relative distance 0.1")
r = report(expectation="caught", verdict="fail", checks=[{"name": "state", "verdict": "pass"}])
check(not r["met"], "a fault nothing caught: not met")
r = report(expectation="caught", verdict="pass", caught_by=["state"],
           checks=[{"name": "state", "verdict": "fail"}])
check(r["met"], "a caught fault: met")
r = report(error="CUDA error: an illegal memory access")
check(not r["met"], "a scenario that errored: not met")

# The platform the goldens are linked under is the one meshproof reads (harness/checks/golden.cc).
for names, want in [(["NVIDIA H200"], "h200"), (["NVIDIA H100 80GB HBM3"], "h100"),
                    (["NVIDIA GB200"], "gb200"), (["NVIDIA L40S"], "l40s"),
                    (["NVIDIA RTX 6000 Ada"], "nvidia_rtx_6000_ada"), ([], "gpu")]:
    check(dc.Runner.golden_platform(names) == want, f"platform of {names}: {want}")

bench = work / "bench.json"
bench.write_text(json.dumps({"scenarios": [
    {"name": "recipes.bf16", "benchmarks": [
        {"name": "custom fprop 8x16x32", "metric": "gemm_ms", "value": 2.0},
        {"name": "custom dgrad 8x32x16", "metric": "gemm_ms", "value": 9.0}]},
    {"name": "recipes.current", "benchmarks": [
        {"name": "custom fprop 8x16x32", "metric": "gemm_ms", "value": 1.0}]}]}))
peer = work / "peer.json"
peer.write_text(json.dumps({"results": [
    {"shape": "8x16x32", "kind": "bf16", "median_ms": 1.9},
    {"shape": "8x16x32", "kind": "fp8_per_tensor", "median_ms": None}]}))
rows = dc.compare_with_torch(bench, peer)
check(rows[0]["meshproof_ms"] == 2.0 and abs(rows[0]["ratio"] - 0.95) < 1e-12,
      "bf16 ratio torch / meshproof at the fprop shape")
check(rows[1]["meshproof_ms"] == 1.0 and rows[1]["ratio"] is None,
      "no torch time, no ratio")

# The device run's model scenarios at issue 16's sizes validate (the rules a run applies first).
files = [dc.write_model_scenario(work / "model16", "model_1rank", dc.MODEL_SIZES, {"dp_shard": 1},
                                 ["bf16", "current"]),
         dc.write_model_scenario(work / "model16", "model_8ranks", dc.MODEL_SIZES,
                                 {"dp_shard": 4, "tp": 2}, ["bf16"])]
p = subprocess.run([str(build / "harness" / "meshproof"), "validate", *map(str, files)],
                   capture_output=True, text=True)
check(p.returncode == 0 and "3 scenario(s) from 2 file(s) valid" in p.stdout + p.stderr,
      "issue 16's model scenarios validate: " + (p.stdout + p.stderr).strip()[-300:])

print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
