"""Every training key of the scenario key table changes what a run does (no option parsed and
ignored; docs/scenarios.md "Keys that only apply with others", docs/design.md section 11).

The keys come from the binary itself: for each section, an unknown key's error lists the keys the
section accepts (the key table's). Each key must have a case below (a context where it applies and
a non-default value) or an exemption with its reason, so a key added to the table without either
fails this test. Per case, the real `meshproof run` trains a small scenario (2 ranks, 3 steps,
no checks) with the context alone and with the key added, and the two reports must differ in
what the run did: per-step loss, grad_norm, lr and tokens, the memory figures, the collectives'
kinds, groups, counts and bytes, the mesh, and the pipeline table's non-timing fields. Wall
times are left out (they differ between any two runs).

  check_keys_act.py MESHPROOF WORK_DIR
"""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

meshproof, work = sys.argv[1], Path(sys.argv[2])
shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)

BASE = """name: keys_act
model: {vocab: 256, hidden: 64, heads: 4, layers: 2, ffn: 256, seq_len: 32}
mesh: {dp_shard: 2}
recipe: fp32
train: {steps: 3, global_batch: 8}
"""
base_yaml = work / "base.yaml"
base_yaml.write_text(BASE)

# Sections whose keys configure the training run. The top level, `checks` and `faults` configure
# what is checked or injected: the loader tests, the check tests and the fault catalog's claims
# cover them.
SECTIONS = ["model", "model.moe", "mesh", "recipe", "fsdp", "train", "data", "checkpoint"]

# key -> (context --set values, the key's --set value). Block scaling needs 128-multiples.
BLOCK = ["recipe.name=block", "model.hidden=128", "model.ffn=256"]
MOE = ["model.moe.experts=4"]
CASES = {
    "model.preset": ([], "llama3_debug"),
    "model.vocab": ([], "128"),
    "model.hidden": ([], "128"),
    "model.heads": ([], "2"),
    "model.layers": ([], "3"),
    "model.ffn": ([], "128"),
    "model.seq_len": ([], "16"),
    "model.norm": ([], "rmsnorm"),
    "model.activation": ([], "swiglu"),
    "model.tied_embeddings": ([], "true"),
    "model.dropout": ([], "0.1"),
    "model.kv_heads": ([], "2"),
    "model.position": ([], "rope"),
    "model.rope_theta": (["model.position=rope"], "500"),
    "model.bias": ([], "false"),
    "model.vocab_parallel": (["mesh.tp=2"], "true"),
    "model.pp_layers": (["mesh.pp=2", "model.layers=3"], "[1,2]"),
    "model.moe.experts": ([], "2"),
    "model.moe.top_k": (MOE, "2"),
    "model.moe.every": (MOE, "2"),
    # With top_k 1 the combine weight is 1 whatever the router (docs/design.md section 27): the
    # aux loss is where softmax and sigmoid probabilities differ.
    "model.moe.router": (MOE + ["model.moe.aux_loss_coef=0.01"], "sigmoid"),
    "model.moe.shared_expert": (MOE, "true"),
    "model.moe.aux_loss_coef": (MOE, "0.01"),
    "mesh.dp_replicate": ([], "2"),
    "mesh.dp_shard": ([], "4"),
    "mesh.tp": ([], "2"),
    "mesh.sequence_parallel": (["mesh.tp=2"], "true"),
    "mesh.ep": (MOE, "2"),
    "mesh.pp": ([], "2"),
    "recipe.name": ([], "bf16"),
    "recipe.fp8_format": (["recipe.name=delayed"], "e4m3"),
    "recipe.margin": (["recipe.name=delayed"], "2"),
    "recipe.amax_history_len": (["recipe.name=delayed"], "1"),
    "recipe.amax_compute_algo": (["recipe.name=delayed"], "most_recent"),
    "recipe.eps": (["recipe.name=current"], "0.5"),
    "recipe.power_2_scale": (BLOCK, "false"),
    "fsdp.reshard_after_forward": ([], "false"),
    "fsdp.fp8_all_gather": (["recipe.name=current"], "true"),
    "fsdp.sync_each_micro_batch": (["train.micro_batches=2"], "true"),
    "fsdp.fp8_params": (["recipe.name=current"], "true"),
    "train.steps": ([], "4"),
    "train.global_batch": ([], "16"),
    "train.micro_batches": ([], "2"),
    "train.lr": ([], "0.01"),
    "train.schedule": ([], "warmup_cosine"),
    "train.warmup_steps": (["train.schedule=warmup_cosine"], "1"),
    "train.min_lr": (["train.schedule=warmup_cosine"], "0.0005"),
    "train.weight_decay": ([], "0.1"),
    "train.beta1": ([], "0.5"),
    "train.beta2": ([], "0.9"),
    "train.adam_eps": ([], "0.001"),
    "train.max_grad_norm": ([], "0.5"),
    "train.recompute": ([], "true"),
    "train.pp_schedule": (["mesh.pp=2", "train.micro_batches=2"], "1f1b"),
    "train.seed": ([], "7"),
    "data.order": ([], "2"),
    "data.seed": ([], "7"),
    "checkpoint.every": ([], "1"),
    "checkpoint.keep_last": (["checkpoint.every=1"], "1"),
}
EXEMPT = {
    "model.moe": "the section of the model.moe keys, each checked here",
    "mesh.world_size": "a cross-check of the product of the mesh dims, sets nothing",
    "data.kind": "markov is its only value",
    "checkpoint.dir": "where the checkpoints go, not what the run does: tests/harness/runner "
                      "lifecycle tests write and read it",
}

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def section_keys(section):
    """The keys `section` accepts, from the unknown-key error of the real binary."""
    probe = f"{section}.not_a_key=1"
    p = subprocess.run([meshproof, "validate", str(base_yaml), "--set", probe],
                       capture_output=True, text=True)
    m = re.search(re.escape(f"{section}.not_a_key") + r": unknown key[^(]*\(allowed: ([^)]*)\)",
                  p.stderr)
    check(p.returncode == 2 and m is not None, f"{section}: the unknown-key error lists its keys")
    return [f"{section}.{k.strip()}" for k in m.group(1).split(",")] if m else []


def observed(out):
    """What a run did, from its report.json: everything but wall times."""
    s = json.loads((out / "report.json").read_text())["scenarios"][0]
    check(s.get("error") in (None, ""), f"{out.name}: ran without error ({s.get('error')})")
    steps = [{k: st.get(k) for k in ("step", "loss", "grad_norm", "lr", "tokens")}
             for st in s["steps"]]
    coll = sorted((c["kind"], c["group"], c["group_size"], c["count"], c["bytes"])
                  for c in s.get("collectives", []))
    pipe = s.get("pipeline")
    if isinstance(pipe, dict):
        pipe = {k: v for k, v in pipe.items() if k != "stages"} | {
            "stages": [{k: v for k, v in st.items() if not k.endswith("_s") and "bubble" not in k}
                       for st in pipe.get("stages", [])]}
    ckpts = sorted(p.name for p in out.rglob("step_*") if p.is_dir())
    return {"steps": steps, "memory": s.get("memory"), "collectives": coll, "mesh": s.get("mesh"),
            "pipeline": pipe, "checkpoints": ckpts}


runs = {}


def run(sets):
    key = tuple(sets)
    if key not in runs:
        out = work / f"out{len(runs)}"
        cmd = [meshproof, "run", str(base_yaml), "--out", str(out), "--quiet"]
        for s in sets:
            cmd += ["--set", s]
        p = subprocess.run(cmd, capture_output=True, text=True)
        check(p.returncode == 0, f"run {' '.join(sets) or '(base)'}: exit {p.returncode} "
                                 f"{p.stderr.strip()[-300:]}")
        runs[key] = observed(out) if p.returncode == 0 else None
    return runs[key]


keys = [k for s in SECTIONS for k in section_keys(s)]
check(len(keys) >= 50, f"{len(keys)} training keys found in the key table")
for k in keys:
    if k in EXEMPT:
        print(f"skip {k}: {EXEMPT[k]}")
        continue
    if k not in CASES:
        check(False, f"{k}: no case in check_keys_act.py (a context where it applies and a "
                     f"value) and no exemption")
        continue
    ctx, value = CASES[k]
    a, b = run(ctx), run(ctx + [f"{k}={value}"])
    if a is None or b is None:
        continue
    differs = [f for f in a if a[f] != b[f]]
    check(bool(differs), f"{k}={value} (with {' '.join(ctx) or 'the base'}) changes the run: "
                         f"{', '.join(differs) or 'nothing'}")
for k in list(CASES) + list(EXEMPT):
    check(k in keys, f"{k}: a case or exemption for a key the table has")

print(f"{len(keys)} keys, {len(runs)} runs, {len(failures)} failures")
sys.exit(1 if failures else 0)
