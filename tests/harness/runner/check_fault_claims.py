#!/usr/bin/env python3
"""Every check the fault catalog claims for a fault catches it (issue #17.12).

`meshproof faults` prints, per fault, the checks that catch it ("caught by: a, b"). For every
(fault, check) pair it claims, CLAIMS below names a scenario where that check alone is enabled:
the fault's library scenario (scenarios/faults/<fault>.yaml) with its `checks` replaced. Running
it must catch the fault with exactly that check:

  * the claimed check (kind `resume` for resume_cross_mesh) fails,
  * the scenario's verdict is pass (expect: caught met) with caught_by naming that kind,
  * resume_cross_mesh: the failing resume ran on another mesh ("run resumed on ...").

Modes:
  coverage MESHPROOF PAIR...   the claimed pairs (this text output) equal CLAIMS and the CTest
                               list (PAIR..., listed from `meshproof faults --json`)
  run MESHPROOF SCENARIOS GOLDEN OUT FAULT CHECK   one pair
  together MESHPROOF SCENARIOS GOLDEN OUT FAULT    every pair of FAULT, the checks enabled at once
"""
import json
import os
import re
import subprocess
import sys

# (fault, check) -> (the check's key, its YAML value): the check enabled alone (every other
# check is switched off, since --set merges mappings). Cross-mesh and reference bounds are the
# scenario defaults where the recipe has one (fp32 1e-5, bf16 1e-2, docs/scenarios.md); FP8
# recipes have none, so each states its measured bound (meshproof run on this machine,
# 2026-11-23, the fault's scenario with faults=[] for the fault-free noise).
CLAIMS = {
    ("amax_not_reduced", "allgather_parity"): ("allgather_parity", "true"),
    # current recipe, FSDP 4 vs FSDP 2: fault-free max rel diff 3.2e-16 (the reduced amax gives
    # the same FP8 bytes on both meshes), with the fault 3.0e-4; 1e-5 sits 30x below the fault.
    ("amax_not_reduced", "reference"): ("reference", "{mesh: {dp_shard: 2}, rtol: 1.0e-5}"),
    ("tp_fsdp_left_to_right", "resume_cross_mesh"):
        ("resume", "{at_step: 3, mesh: {dp_shard: 4}}"),
    ("fp8_state_dropped_from_checkpoint", "resume"): ("resume", "{at_step: 3}"),
    ("scale_inv_saved_bf16", "resume"): ("resume", "{at_step: 3}"),
    # delayed + fp8_params, resumed on FSDP 2: fault-free max rel diff 1.6e-9, with the fault
    # 1.6e-3; 1e-5 sits 160x below the fault.
    ("scale_inv_saved_bf16", "resume_cross_mesh"):
        ("resume", "{at_step: 3, mesh: {dp_shard: 2}, rtol: 1.0e-5}"),
    ("stale_columnwise_copy", "golden"): ("golden", "{mode: exact}"),
    ("data_cursor_not_restored", "resume"): ("resume", "{at_step: 3}"),
    ("data_cursor_not_restored", "resume_cross_mesh"):
        ("resume", "{at_step: 3, mesh: {dp_shard: 2, tp: 2}}"),
    ("optimizer_state_not_restored", "resume"): ("resume", "{at_step: 3}"),
    ("optimizer_state_not_restored", "resume_cross_mesh"):
        ("resume", "{at_step: 3, mesh: {dp_shard: 4}}"),
    ("hsdp_replicas_not_reduced", "golden"): ("golden", "{mode: exact}"),
    ("hsdp_replicas_not_reduced", "reference"): ("reference", "{mesh: {dp_shard: 4}}"),
    ("uneven_shard_padding_leak", "golden"): ("golden", "{mode: exact}"),
    ("uneven_shard_padding_leak", "reference"): ("reference", "{mesh: {dp_shard: 1}}"),
    # Generic (user-defined) faults, each with its library scenario's parameters.
    ("drop_checkpoint_key", "resume"): ("resume", "{at_step: 3}"),
    # bf16 default rtol 1e-2: without exp_avg_sq the first resumed update divides by eps (loss
    # 6.33 vs 5.42 on the same mesh, 2026-11-24).
    ("drop_checkpoint_key", "resume_cross_mesh"): ("resume", "{at_step: 3, mesh: {dp_shard: 4}}"),
    ("checkpoint_key_dtype", "resume"): ("resume", "{at_step: 3}"),
    ("freeze_state", "resume"): ("resume", "{at_step: 3}"),
    # fp32 default rtol 1e-5; the perturbation moves loss by 6.0e-5 relative (2026-11-24).
    ("perturb", "reference"): ("reference", "{mesh: {dp_shard: 1}}"),
    ("amax_group", "allgather_parity"): ("allgather_parity", "true"),
    # current recipe, FSDP 4 vs FSDP 2, as amax_not_reduced's claim: fault-free the FP8 bytes
    # agree across meshes (3.2e-16), the unreduced qkv weight amax moves the loss past 1e-5.
    ("amax_group", "reference"): ("reference", "{mesh: {dp_shard: 2}, rtol: 1.0e-5}"),
    # Built-in faults added with issue #20.
    ("stale_fp8_weight_after_update", "resume"): ("resume", "{at_step: 3}"),
    ("rope_positions_local_under_sp", "golden"): ("golden", "{mode: exact}"),
    ("rope_positions_local_under_sp", "reference"):
        ("reference", "{mesh: {tp: 1, sequence_parallel: false}}"),
    ("swiglu_gate_up_swizzled_in_checkpoint", "resume"): ("resume", "{at_step: 3}"),
    ("nvfp4_rht_on_one_operand", "golden"): ("golden", "{mode: exact}"),
    # nvfp4, FSDP 2 x TP 2 vs 1 rank: fault-free max rel diff 1.8e-4, with the fault 1.2e-2
    # (2026-11-24); 2e-3 sits 11x above the clean run and 6x below the fault.
    ("nvfp4_rht_on_one_operand", "reference"):
        ("reference", "{mesh: {dp_shard: 1, tp: 1}, rtol: 2.0e-3}"),
    ("nvfp4_block_scale_pow2", "golden"): ("golden", "{mode: exact}"),
    # The state check (bitwise, no tolerance): each checkpoint fault names its key. The FP8
    # state one on a cross-mesh FP8 resume (delayed, FSDP 2 x TP 2 -> FSDP 4), where the
    # cross-mesh resume's measured rtol misses it; tp_fsdp_left_to_right on the same mesh (the
    # saved masters against the run's own gathered ones).
    ("fp8_state_dropped_from_checkpoint", "state"): ("state", "{at_step: 3, mesh: {dp_shard: 4}}"),
    ("scale_inv_saved_bf16", "state"): ("state", "{at_step: 3}"),
    ("data_cursor_not_restored", "state"): ("state", "{at_step: 3, mesh: {dp_shard: 2, tp: 2}}"),
    ("optimizer_state_not_restored", "state"): ("state", "{at_step: 3}"),
    ("tp_fsdp_left_to_right", "state"): ("state", "{at_step: 3}"),
    ("amax_history_restored_from_init", "state"): ("state", "{at_step: 3}"),
    ("optimizer_step_advanced_before_load", "state"):
        ("state", "{at_step: 3, mesh: {dp_shard: 4}}"),
    # fp32, 4 micro-batches against 1: fault-free max rel diff 1.0e-9 (summation order only),
    # with the fault 7.5e-3 at step 2; the fp32 default 1e-5 sits 750x below the fault.
    ("grad_accum_last_micro_batch_only", "reference"):
        ("reference", "{train: {micro_batches: 1}, rtol: 1.0e-5}"),
    # Catalog entries (issue #20): the parity check compares the gathered scale_inv bytes
    # exactly; the state check loads on FSDP 3, where 256 vocabulary rows do not divide.
    ("scale_inv_gathered_bf16", "allgather_parity"): ("allgather_parity", "true"),
    ("vocab_uneven_resume_rows", "state"): ("state", "{at_step: 3, mesh: {dp_shard: 3}}"),
    # Save-side faults (issue #46): the checkpoint under test lacks a key, or holds rounded or
    # permuted values, against the saving run's live state; bitwise, no tolerance.
    ("drop_checkpoint_key", "state"): ("state", "{at_step: 3}"),
    ("checkpoint_key_dtype", "state"): ("state", "{at_step: 3}"),
    ("swiglu_gate_up_swizzled_in_checkpoint", "state"): ("state", "{at_step: 3}"),
    ("block_scale_padding_reshard", "allgather_parity"): ("allgather_parity", "true"),
    # MoE (docs/design.md section 27).
    ("router_not_fp32", "golden"): ("golden", "{mode: exact}"),
    # NVFP4 all-gather (issue #22): bitwise, no tolerance.
    ("nvfp4_global_amax_not_reduced", "allgather_parity"): ("allgather_parity", "true"),
    # The collectives check (exact, no tolerance): each collective fault's first difference
    # names the parameter the collective serves.
    ("tp_weight_amax_all_reduced", "collectives"): ("collectives", "true"),
    ("fp8_all_gather_in_bf16", "collectives"): ("collectives", "true"),
    ("skip_collective", "collectives"): ("collectives", "true"),
    # fp32 default rtol 1e-5: layer 0's gradients unreduced over 4 shards move the loss by
    # 8.3e-4 relative at step 2 (2026-11-24); fault-free FSDP 4 vs 1 rank stays within 1e-5.
    ("skip_collective", "reference"): ("reference", "{mesh: {dp_shard: 1}}"),
    ("collective_dtype", "collectives"): ("collectives", "true"),
    # Expert parallelism (docs/design.md "Expert parallelism"), fp32 rtol 1e-5 against one rank
    # with ep 1 (fault-free deviations within 5.3e-8: tests/engine/moe/moe_ep_test.cc); skipping the
    # expert reductions moves the loss by 3.7e-4 at step 2.
    # The loss alone moves by 1.0e-6 (AdamW is nearly scale-invariant); grad_norm by 0.22.
    ("expert_grad_scaled_by_ep", "reference"):
        ("reference", "{mesh: {dp_shard: 1}, rtol: {loss: 1.0e-5, grad_norm: 1.0e-5}}"),
    ("moe_final_backward_skips_experts", "reference"):
        ("reference", "{mesh: {dp_shard: 1}, train: {micro_batches: 1}}"),
    ("moe_final_backward_skips_experts", "golden"): ("golden", "{mode: exact}"),
    # Grouped expert quantization (docs/design.md section 27): golden exact against the
    # fault-free run (the 1-rank reference carries the same fault).
    ("expert_split_padding_too_small", "golden"): ("golden", "{mode: exact}"),
    # One stage is bitwise the pipelined step (docs/design.md section 33): rtol 0.
    ("pp_last_backward_sync_skipped", "reference"):
        ("reference", "{mesh: {dp_shard: 2}, rtol: 0}"),
    ("pp_last_backward_sync_skipped", "golden"): ("golden", "{mode: exact}"),
    ("pp_microbatch_grads_overwritten", "reference"):
        ("reference", "{mesh: {dp_shard: 2}, rtol: 0}"),
    ("pp_microbatch_grads_overwritten", "golden"): ("golden", "{mode: exact}"),
    ("pp_tied_embedding_grad_not_synced", "reference"):
        ("reference", "{mesh: {dp_shard: 2}, rtol: 0}"),
    ("pp_tied_embedding_grad_not_synced", "golden"): ("golden", "{mode: exact}"),
}
ALL_CHECKS = ("golden", "resume", "reference", "allgather_parity", "determinism", "state",
              "collectives")
# The key a failing state check must name for each fault (its evidence's tensor): the first key
# in the comparison's order (scalars, then the saved masters against the run's, then keys by
# name) that the fault corrupts.
STATE_KEYS = {
    "fp8_state_dropped_from_checkpoint": r"fp8/layers\.0\.[a-z_.]+/(input|weight|grad_output)/"
                                         r"(amax_history|scale)",
    "scale_inv_saved_bf16": r"fp8/layers\.0\.[a-z_.]+/(input|weight|grad_output)/scale",
    "data_cursor_not_restored": r"data/cursor",
    "optimizer_state_not_restored": r"optim/step",
    "tp_fsdp_left_to_right": r"model/layers\.0\.attn\.qkv\.weight",
    "amax_history_restored_from_init": r"fp8/layers\.0\.[a-z_.]+/(input|weight|grad_output)/"
                                       r"amax_history",
    "optimizer_step_advanced_before_load": r"optim/step",
    # The first vocabulary-row key in name order: the embedding's master.
    "vocab_uneven_resume_rows": r"model/embed\.tok",
    # The first dropped key in name order ("not in the checkpoint").
    "drop_checkpoint_key": r"optim/[a-z0-9_.]+/exp_avg_sq",
    # The first scale that bf16 rounds (delayed scaling: fp8_max / amax).
    "checkpoint_key_dtype": r"fp8/layers\.0\.[a-z_.]+/(input|weight|grad_output)/scale",
    "swiglu_gate_up_swizzled_in_checkpoint": r"model/layers\.0\.mlp\.fc1_(gate|up)\.weight",
}


# The parameter a failing collectives check must name for each fault: one the fault's collectives
# serve (the first difference in (group, kind, tensor) order).
COLLECTIVE_TENSORS = {
    "tp_weight_amax_all_reduced": r"layers\.\d+\.(attn|mlp)\.[a-z0-9_]+\.weight",
    "fp8_all_gather_in_bf16": r"layers\.\d+\.(attn|mlp)\.[a-z0-9_]+\.weight",
    "skip_collective": r"layers\.0\.[a-z0-9_.]+",
    "collective_dtype": r"layers\.\d+\.mlp\.fc1\.weight",
}


def checks_mapping(key, value):
    return checks_mapping_of({key: value})


def checks_mapping_of(values):
    return "{" + ", ".join("%s: %s" % (c, values.get(c, "false")) for c in ALL_CHECKS) + "}"


def claimed(meshproof):
    out = subprocess.run([meshproof, "faults"], check=True, capture_output=True, text=True).stdout
    pairs = set()
    fault = None
    for line in out.splitlines():
        if line and not line.startswith(" "):
            fault = line.strip()
        m = re.match(r"\s+caught by:\s*(.*)$", line)
        if m and fault:
            for c in m.group(1).split(","):
                if c.strip():
                    pairs.add((fault, c.strip()))
    return pairs


def coverage(meshproof, listed):
    claims = claimed(meshproof)
    ctest = set(tuple(p.split(":", 1)) for p in listed)
    problems = []
    for p in sorted(claims - set(CLAIMS)):
        problems.append("claimed but no scenario in CLAIMS: %s caught by %s" % p)
    for p in sorted(set(CLAIMS) - claims):
        problems.append("in CLAIMS but not claimed by the catalog: %s / %s" % p)
    for p in sorted(claims ^ ctest):
        problems.append("the CTest list and the catalog differ on %s / %s" % p)
    for p in problems:
        print(p)
    print("%d claims, %d problems" % (len(claims), len(problems)))
    return 1 if problems else 0


def run_scenario(meshproof, scenarios, golden, out, fault, checks):
    cmd = [meshproof, "run", os.path.join(scenarios, "faults", fault + ".yaml"), "--golden-dir",
           golden, "--backend", "cpu", "--out", out, "--quiet", "--set", "checks=" + checks]
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(p.stdout + p.stderr)
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    (s,) = report["scenarios"]
    return p, s


def kind_of(check):
    return "resume" if check == "resume_cross_mesh" else check


def together(meshproof, scenarios, golden, out, fault):
    """Every check the catalog claims for FAULT enabled in one run (as few runs as the checks'
    keys allow: resume and resume_cross_mesh are one key), each of them failing and the verdict
    listing them all: no claimed check is masked by another's run or its skip rules."""
    claims = sorted(c for (f, c) in CLAIMS if f == fault)
    runs = []
    for c in claims:
        key, value = CLAIMS[(fault, c)]
        for r in runs:
            if key not in r:
                r[key] = (c, value)
                break
        else:
            runs.append({key: (c, value)})
    problems = []
    for i, r in enumerate(runs):
        p, s = run_scenario(meshproof, scenarios, golden, "%s_%d" % (out, i), fault,
                            checks_mapping_of({k: v for k, (_, v) in r.items()}))
        for key, (c, _) in sorted(r.items()):
            failing = [x for x in s["checks"] if x["verdict"] == "fail" and x["kind"] == key]
            if not failing:
                problems.append("run %d: %s did not catch %s among %s: %s" %
                                (i, c, fault, sorted(r), [(x["name"], x["verdict"], x["message"])
                                                          for x in s["checks"]]))
            elif c == "resume_cross_mesh" and "run resumed on" not in failing[0]["message"]:
                problems.append("run %d: the failing resume was not cross-mesh" % i)
        if s["verdict"] != "pass" or s["caught_by"] != sorted(r):
            problems.append("run %d: verdict %s, caught_by %s (expected pass, %s)" %
                            (i, s["verdict"], s["caught_by"], sorted(r)))
        if p.returncode != 0:
            problems.append("run %d: exit %d (expected 0: expect caught met)" % (i, p.returncode))
    for m in problems:
        print("FAIL: " + m)
    if not problems:
        print("caught: %s by each of %s together (%d runs)" % (fault, ", ".join(claims),
                                                               len(runs)))
    return 1 if problems else 0


def run(meshproof, scenarios, golden, out, fault, check):
    p, s = run_scenario(meshproof, scenarios, golden, out, fault,
                        checks_mapping(*CLAIMS[(fault, check)]))
    kind = kind_of(check)
    problems = []
    failing = [c for c in s["checks"] if c["verdict"] == "fail" and c["kind"] == kind]
    if not failing:
        problems.append("%s did not catch %s: %s" % (check, fault, [(c["name"], c["verdict"],
                                                                     c["message"])
                                                                    for c in s["checks"]]))
    if check == "resume_cross_mesh" and failing and "run resumed on" not in failing[0]["message"]:
        problems.append("the failing resume was not cross-mesh: " + failing[0]["message"])
    if check == "state" and failing:
        named = (failing[0].get("evidence") or {}).get("tensor", "")
        if not re.fullmatch(STATE_KEYS[fault], named) or named not in failing[0]["message"]:
            problems.append("the state check names %r, expected a key matching %s: %s" %
                            (named, STATE_KEYS[fault], failing[0]["message"]))
    if check == "collectives" and failing:
        named = (failing[0].get("evidence") or {}).get("tensor", "")
        if not re.fullmatch(COLLECTIVE_TENSORS[fault], named) or named not in failing[0]["message"]:
            problems.append("the collectives check names %r, expected a parameter matching %s: %s"
                            % (named, COLLECTIVE_TENSORS[fault], failing[0]["message"]))
    if s["verdict"] != "pass" or s["caught_by"] != [kind]:
        problems.append("verdict %s, caught_by %s (expected pass, [%s])" %
                        (s["verdict"], s["caught_by"], kind))
    if p.returncode != 0:
        problems.append("exit %d (expected 0: expect caught met)" % p.returncode)
    for m in problems:
        print("FAIL: " + m)
    if not problems:
        print("caught: %s by %s: %s" % (fault, check, failing[0]["message"]))
    return 1 if problems else 0


def main(argv):
    if len(argv) >= 2 and argv[1] == "coverage":
        return coverage(argv[2], argv[3:])
    if len(argv) == 8 and argv[1] == "run":
        return run(*argv[2:])
    if len(argv) == 7 and argv[1] == "together":
        return together(*argv[2:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
