#!/usr/bin/python3
"""Misuse of every verb, table-driven (issue #46): what a new user types by mistake.

usage: check_misuse.py MESHPROOF WORK_DIR VERB     run the cases of one verb
       check_misuse.py list                        the verbs and their case counts

Each case runs `meshproof ARGS` in a work folder holding the fixtures below and asserts
  * the exit code (2 for bad input or usage, 1 for a stored file that fails its integrity check),
  * stderr names the path, option or key at fault (each pattern, a plain substring),
  * nothing was written or changed: the work folder's files (names, link targets and SHA-256)
    are the same after the case as before it, temporaries and empty folders included.
The fixtures are made once per verb: a float32 dataset x.h5 (/x [64, 64]) with a symlink
link.h5 and a hard link hard.h5 to it, an empty file, binary garbage, a rank-3 and an int32
dataset, a folder, a one-rank scenario tiny.yaml (with symlink and hard link), a two-rank
scenario, a checkpoint (ckpt/tiny/checkpoints/step_0000002, written by `meshproof run`) and a
report (rep/report.json). As root, a folder that cannot be written is /proc/1 (root writes
anywhere else); otherwise a chmod 555 folder.
Prints one line per case and "N passed, M failed".
"""
import hashlib
import os
import shutil
import subprocess
import sys

CKPT = "ckpt/tiny/checkpoints/step_0000002"
TINY = """name: tiny
model: {vocab: 64, hidden: 32, heads: 2, layers: 1, ffn: 64, seq_len: 16}
mesh: {dp_shard: 1}
recipe: fp32
train: {steps: 2, global_batch: 4}
"""
TWO_RANKS = TINY.replace("name: tiny", "name: two").replace("dp_shard: 1", "dp_shard: 2")
RO = "/proc/1" if os.geteuid() == 0 else "ro"

SAME = "is the same file as the input"
Q = ["quantize", "--recipe", "mxfp8"]
# (name, args, exit code, stderr substrings)
CASES = {
    "quantize": [
        ("same_name", Q + ["--in", "x.h5", "--out", "x.h5"], 2, [SAME, "--out x.h5", "--in x.h5"]),
        ("dot_relative", Q + ["--in", "x.h5", "--out", "./x.h5"], 2, [SAME, "./x.h5"]),
        ("symlink", Q + ["--in", "x.h5", "--out", "link.h5"], 2, [SAME, "link.h5"]),
        ("hard_link", Q + ["--in", "x.h5", "--out", "hard.h5"], 2, [SAME, "hard.h5"]),
        ("dataset_spelling", Q + ["--in", "./x.h5:/x", "--out", "x.h5"], 2, [SAME]),
        ("out_is_a_checkpoint", Q + ["--in", "x.h5", "--out", CKPT], 2, ["is a folder", CKPT]),
        ("empty_input", Q + ["--in", "empty.h5", "--out", "q.h5"], 2, ["empty.h5", "empty"]),
        ("garbage_input", Q + ["--in", "garbage.h5", "--out", "q.h5"], 2, ["garbage.h5"]),
        ("wrong_rank", Q + ["--in", "rank3.h5", "--out", "q.h5"], 2, ["rank3.h5", "rank 3"]),
        ("wrong_dtype", Q + ["--in", "int32.h5", "--out", "q.h5"], 2,
         ["int32.h5", "not float32"]),
        ("missing_dataset", Q + ["--in", "x.h5:/nope", "--out", "q.h5"], 2, ["/nope", "x.h5"]),
        ("input_is_a_folder", Q + ["--in", "folder", "--out", "q.h5"], 2, ["folder", "is a folder"]),
        ("unwritable_folder", Q + ["--in", "x.h5", "--out", RO + "/q.h5"], 2,
         [RO, "not writable"]),
        ("missing_folder", Q + ["--in", "x.h5", "--out", "nowhere/q.h5"], 2,
         ["nowhere", "does not exist"]),
        ("conflicting_options", ["quantize", "--recipe", "current", "--pow2-scales",
                                 "--no-pow2-scales", "--in", "x.h5", "--out", "q.h5"], 2,
         ["contradict"]),
        ("option_of_another_recipe", Q + ["--block", "128x128", "--in", "x.h5", "--out", "q.h5"],
         2, ["--block"]),
    ],
    "export": [
        ("same_name", ["export", "tiny.yaml", "--out", "tiny.yaml"], 2, [SAME, "tiny.yaml"]),
        ("dot_relative", ["export", "tiny.yaml", "--out", "./tiny.yaml"], 2, [SAME, "./tiny.yaml"]),
        ("symlink", ["export", "tiny.yaml", "--out", "tiny_link.yaml"], 2, [SAME, "tiny_link"]),
        ("hard_link", ["export", "tiny.yaml", "--out", "tiny_hard.yaml"], 2, [SAME, "tiny_hard"]),
        ("out_is_a_checkpoint", ["export", "tiny.yaml", "--out", CKPT], 2, ["is a folder", CKPT]),
        ("empty_scenario", ["export", "empty.h5", "--out", "t.h5"], 2, ["empty.h5"]),
        ("garbage_scenario", ["export", "garbage.h5", "--out", "t.h5"], 2, ["garbage.h5"]),
        ("scenario_is_a_folder", ["export", "folder", "--out", "t.h5"], 2, ["folder"]),
        ("two_rank_scenario", ["export", "two.yaml", "--out", "t.h5"], 2, ["two.yaml", "1-rank"]),
        ("unwritable_folder", ["export", "tiny.yaml", "--out", RO + "/t.h5"], 2,
         [RO, "not writable"]),
        ("missing_folder", ["export", "tiny.yaml", "--out", "nowhere/t.h5"], 2,
         ["nowhere", "does not exist"]),
        ("conflicting_options", ["export", "tiny.yaml", "--vocab", "128", "--out", "t.h5"], 2,
         ["--vocab", "cannot be combined"]),
        ("filter_without_scenario", ["export", "--filter", "x", "--out", "t.h5"], 2,
         ["--filter"]),
        ("bad_model_flag", ["export", "--heads", "3", "--hidden", "32", "--out", "t.h5"], 2,
         ["heads"]),
    ],
    "run": [
        ("same_name", ["run", "tiny.yaml", "--out", "tiny.yaml"], 2, [SAME, "tiny.yaml"]),
        ("dot_relative", ["run", "tiny.yaml", "--out", "./tiny.yaml"], 2, [SAME, "./tiny.yaml"]),
        ("symlink", ["run", "tiny.yaml", "--out", "tiny_link.yaml"], 2, [SAME, "tiny_link"]),
        ("hard_link", ["run", "tiny.yaml", "--out", "tiny_hard.yaml"], 2, [SAME, "tiny_hard"]),
        ("out_is_the_start_checkpoint", ["run", "tiny.yaml", "--set", "train.steps=4",
                                         "--from-checkpoint", CKPT, "--out", CKPT], 2,
         [SAME, "--from-checkpoint", CKPT]),
        ("out_inside_the_start_checkpoint", ["run", "tiny.yaml", "--set", "train.steps=4",
                                             "--from-checkpoint", CKPT, "--out", CKPT + "/out"], 2,
         ["lies inside the input", CKPT]),
        # Periodic checkpoints would prune the folder that holds the checkpoint it starts from.
        ("checkpoint_folder_holds_the_start", ["run", "tiny.yaml", "--set", "checkpoint.every=1",
                                               "--set", "train.steps=3", "--from-checkpoint",
                                               "./" + CKPT, "--out", "ckpt"], 2,
         ["holds the input", "checkpoint folder of scenario tiny"]),
        ("out_is_a_file", ["run", "tiny.yaml", "--out", "x.h5"], 2,
         ["x.h5", "not a directory"]),
        ("empty_scenario", ["run", "empty.h5", "--out", "o"], 2, ["empty.h5"]),
        ("garbage_scenario", ["run", "garbage.h5", "--out", "o"], 2, ["garbage.h5"]),
        ("scenario_is_a_folder", ["run", "folder", "--out", "o"], 2, ["folder"]),
        ("missing_scenario", ["run", "nope.yaml", "--out", "o"], 2, ["nope.yaml"]),
        ("unwritable_out", ["run", "tiny.yaml", "--out", RO], 2, [RO, "not writable"]),
        ("start_is_not_a_checkpoint", ["run", "tiny.yaml", "--from-checkpoint", "folder",
                                       "--out", "o"], 2, ["folder"]),
        ("unknown_key", ["run", "tiny.yaml", "--set", "train.stepz=3", "--out", "o"], 2,
         ["train.stepz"]),
        ("bad_backend", ["run", "tiny.yaml", "--backend", "tpu", "--out", "o"], 2, ["tpu"]),
    ],
    "golden_update": [
        # golden/<scenario>/<platform>.h5 of the scenario file itself, spelled four ways.
        ("same_name", ["golden", "update", "g/tiny/cpu.h5", "--golden-dir", "g"], 2,
         [SAME, "g/tiny/cpu.h5"]),
        ("dot_relative", ["golden", "update", "g/tiny/cpu.h5", "--golden-dir", "./g"], 2,
         [SAME, "./g"]),
        ("symlinked_store", ["golden", "update", "g/tiny/cpu.h5", "--golden-dir", "g_link"], 2,
         [SAME, "g_link"]),
        ("hard_link", ["golden", "update", "tiny.yaml", "--golden-dir", "ghard"], 2,
         [SAME, "ghard/tiny/cpu.h5"]),
        ("store_is_a_file", ["golden", "update", "tiny.yaml", "--golden-dir", "x.h5"], 2,
         ["x.h5", "is not a folder"]),
        ("store_unwritable", ["golden", "update", "tiny.yaml", "--golden-dir", RO], 2,
         [RO, "not writable"]),
        ("golden_is_a_folder", ["golden", "update", "tiny.yaml", "--golden-dir", "gdir"], 2,
         ["gdir/tiny/cpu.h5", "is a folder"]),
        ("previous_golden_is_garbage", ["golden", "update", "tiny.yaml", "--golden-dir", "gbad"],
         2, ["gbad/tiny/cpu.h5"]),
        ("empty_scenario", ["golden", "update", "empty.h5", "--golden-dir", "gnew"], 2,
         ["empty.h5"]),
        ("garbage_scenario", ["golden", "update", "garbage.h5", "--golden-dir", "gnew"], 2,
         ["garbage.h5"]),
        ("scenario_is_a_folder", ["golden", "update", "folder", "--golden-dir", "gnew"], 2,
         ["folder"]),
        ("bad_platform_name", ["golden", "update", "tiny.yaml", "--force-platform", "H/100",
                               "--golden-dir", "gnew"], 2, ["H/100"]),
        ("platform_not_this_device", ["golden", "update", "tiny.yaml", "--platform", "h100",
                                      "--golden-dir", "gnew"], 2, ["--platform h100"]),
    ],
    "bench_recipes": [
        ("results_is_a_report", ["bench", "recipes", "--out", "folder", "--results",
                                 "folder/report"], 2,
         ["--results", "folder/report.json", "is the same path as"]),
        ("results_dot_relative", ["bench", "recipes", "--out", "folder", "--results",
                                  "./folder/report"], 2,
         ["./folder/report.json", "is the same path as"]),
        ("results_through_symlink", ["bench", "recipes", "--out", "folder", "--results",
                                     "folder_link/report"], 2,
         ["folder_link/report.json", "is the same path as"]),
        ("results_hard_link", ["bench", "recipes", "--out", "rep", "--results", "rep_hard"], 2,
         ["rep_hard.json", "is the same path as"]),
        ("out_is_a_file", ["bench", "recipes", "--out", "x.h5"], 2, ["x.h5", "not a directory"]),
        ("out_unwritable", ["bench", "recipes", "--out", RO], 2, [RO, "not writable"]),
        ("results_folder_missing", ["bench", "recipes", "--out", "b", "--results",
                                    "nowhere/h100"], 2, ["nowhere", "does not exist"]),
        ("results_is_a_folder", ["bench", "recipes", "--out", "b", "--results", "dirprefix"], 2,
         ["dirprefix.json", "is a folder"]),
        ("zero_iters", ["bench", "recipes", "--iters", "0", "--out", "b"], 2, ["--iters"]),
        ("unknown_recipe", ["bench", "recipes", "--recipes", "fp7", "--out", "b"], 2, ["fp7"]),
        ("bad_model", ["bench", "recipes", "--model", "huge", "--out", "b"], 2, ["huge"]),
        ("bad_shape", ["bench", "recipes", "--shapes", "12x", "--out", "b"], 2, ["12x"]),
    ],
    "ckpt": [
        ("inspect_a_file", ["ckpt", "inspect", "x.h5"], 2, ["x.h5"]),
        ("inspect_an_empty_folder", ["ckpt", "inspect", "folder"], 2, ["folder"]),
        ("inspect_missing", ["ckpt", "inspect", "nope"], 2, ["nope"]),
        ("inspect_garbage_index", ["ckpt", "inspect", "badindex"], 2, ["badindex"]),
        ("verify_truncated_rank_file", ["ckpt", "verify", "truncated"], 1,
         ["truncated", "rank_00000.h5"]),
        ("verify_missing_rank_file", ["ckpt", "verify", "norankfile"], 1,
         ["norankfile", "rank_00000.h5"]),
        ("verify_a_file", ["ckpt", "verify", "garbage.h5"], 2, ["garbage.h5"]),
        ("diff_missing_side", ["ckpt", "diff", CKPT, "nope"], 2, ["nope"]),
        ("diff_negative_rtol", ["ckpt", "diff", CKPT, CKPT, "--rtol", "-1"], 2, ["--rtol"]),
        ("diff_a_scenario", ["ckpt", "diff", CKPT, "tiny.yaml"], 2, ["tiny.yaml"]),
    ],
    "report_compare": [
        ("empty_report", ["report", "compare", "rep/report.json", "empty.h5"], 2, ["empty.h5"]),
        ("garbage_report", ["report", "compare", "rep/report.json", "garbage.h5"], 2,
         ["garbage.h5"]),
        ("a_folder", ["report", "compare", "rep/report.json", "folder"], 2,
         ["folder is a folder"]),
        ("missing", ["report", "compare", "rep/report.json", "nope.json"], 2, ["nope.json"]),
        ("not_a_report", ["report", "compare", "rep/report.json", "notareport.json"], 2,
         ["notareport.json"]),
        ("a_scenario", ["report", "compare", "tiny.yaml", "rep/report.json"], 2, ["tiny.yaml"]),
        ("a_checkpoint", ["report", "compare", CKPT, "rep/report.json"], 2, [CKPT]),
        ("negative_min_change", ["report", "compare", "rep/report.json", "rep/report.json",
                                 "--min-change", "-1"], 2, ["--min-change"]),
        ("an_hdf5_file", ["report", "compare", "x.h5", "rep/report.json"], 2, ["x.h5"]),
        ("one_report", ["report", "compare", "rep/report.json"], 2, ["compare"]),
    ],
    "validate": [
        ("empty", ["validate", "empty.h5"], 2, ["empty.h5"]),
        ("garbage", ["validate", "garbage.h5"], 2, ["garbage.h5"]),
        ("a_folder", ["validate", "folder"], 2, ["folder"]),
        ("missing", ["validate", "nope.yaml"], 2, ["nope.yaml"]),
        ("unknown_key", ["validate", "tiny.yaml", "--set", "model.hiden=3"], 2, ["model.hiden"]),
        ("bad_value", ["validate", "tiny.yaml", "--set", "model.heads=3"], 2, ["heads"]),
        ("filter_matches_nothing", ["validate", "tiny.yaml", "--filter", "other"], 2, ["other"]),
        ("an_hdf5_file", ["validate", "x.h5"], 2, ["x.h5"]),
        ("a_report", ["validate", "rep/report.json"], 2, ["rep/report.json"]),
        ("malformed_set", ["validate", "tiny.yaml", "--set", "train.steps"], 2, ["train.steps"]),
    ],
}


def make_fixtures(meshproof, work):
    import h5py
    import numpy as np
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.chdir(work)
    rng = np.random.default_rng(46)
    with h5py.File("x.h5", "w") as f:
        f["x"] = rng.standard_normal((64, 64)).astype(np.float32)
    with h5py.File("rank3.h5", "w") as f:
        f["x"] = np.zeros((4, 4, 4), np.float32)
    with h5py.File("int32.h5", "w") as f:
        f["x"] = np.zeros((32, 32), np.int32)
    os.symlink("x.h5", "link.h5")
    os.link("x.h5", "hard.h5")
    open("empty.h5", "wb").close()
    with open("garbage.h5", "wb") as f:
        f.write(bytes(rng.integers(0, 256, 4096, dtype=np.uint8)))
    os.makedirs("folder")
    os.symlink("folder", "folder_link")
    with open("tiny.yaml", "w") as f:
        f.write(TINY)
    os.symlink("tiny.yaml", "tiny_link.yaml")
    os.link("tiny.yaml", "tiny_hard.yaml")
    with open("two.yaml", "w") as f:
        f.write(TWO_RANKS)
    # The scenario file kept where its own golden would go, and a hard link to it there.
    os.makedirs("g/tiny")
    shutil.copy("tiny.yaml", "g/tiny/cpu.h5")
    os.symlink("g", "g_link")
    os.makedirs("ghard/tiny")
    os.link("tiny.yaml", "ghard/tiny/cpu.h5")
    os.makedirs("gdir/tiny/cpu.h5")
    os.makedirs("gbad/tiny")
    shutil.copy("garbage.h5", "gbad/tiny/cpu.h5")
    os.makedirs("dirprefix.json")
    with open("notareport.json", "w") as f:
        f.write('{"hello": "world"}\n')
    if RO == "ro":
        os.makedirs("ro")
        os.chmod("ro", 0o555)
    # A checkpoint and a report, written by meshproof itself.
    subprocess.run([meshproof, "run", "tiny.yaml", "--set", "checkpoint.every=2", "--out", "ckpt",
                    "--quiet"], check=True, capture_output=True)
    shutil.copytree("ckpt", "rep")
    os.link("rep/report.json", "rep_hard.json")
    # Damaged copies for ckpt verify.
    for name in ("badindex", "truncated", "norankfile"):
        shutil.copytree(CKPT, name)
    with open("badindex/index.json", "w") as f:
        f.write("{ not json")
    with open("truncated/rank_00000.h5", "r+b") as f:
        f.truncate(os.path.getsize("truncated/rank_00000.h5") // 2)
    os.remove("norankfile/rank_00000.h5")


def snapshot(work):
    """Every path under work (not following links): its kind, link target or SHA-256."""
    tree = {}
    for root, dirs, files in os.walk(work):
        for d in dirs:
            p = os.path.join(root, d)
            tree[os.path.relpath(p, work)] = ("link", os.readlink(p)) if os.path.islink(p) \
                else ("dir",)
        for name in files:
            p = os.path.join(root, name)
            if os.path.islink(p):
                tree[os.path.relpath(p, work)] = ("link", os.readlink(p))
            else:
                with open(p, "rb") as f:
                    tree[os.path.relpath(p, work)] = ("file", hashlib.sha256(f.read()).hexdigest())
    return tree


def run_verb(meshproof, work, verb):
    make_fixtures(meshproof, work)
    passed = failed = 0
    for name, args, code, patterns in CASES[verb]:
        before = snapshot(work)
        p = subprocess.run([meshproof] + args, cwd=work, capture_output=True, timeout=120)
        # Messages are text: a verb that echoes a binary input's bytes fails here.
        try:
            p.stdout, p.stderr = p.stdout.decode("utf-8"), p.stderr.decode("utf-8")
        except UnicodeDecodeError as e:
            p.stdout, p.stderr = "", "(undecodable output: %s)" % e
        after = snapshot(work)
        problems = []
        if p.returncode != code:
            problems.append("exit %d, expected %d" % (p.returncode, code))
        for pattern in patterns:
            # ckpt verify lists each failing file on stdout; every other verb's error is stderr.
            if pattern not in p.stderr + p.stdout:
                problems.append("the output lacks %r" % pattern)
        if before != after:
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            problems.append("the work folder changed: %s" % changed[:8])
            # Put it back for the next case.
            make_fixtures(meshproof, work)
        line = "%s %s.%s: meshproof %s" % ("ok  " if not problems else "FAIL", verb, name,
                                           " ".join(args))
        print(line)
        if problems:
            failed += 1
            for m in problems:
                print("      " + m)
            print("      stdout: " + p.stdout.strip().replace("\n", "\n              "))
        else:
            passed += 1
        print("      stderr: " + p.stderr.strip().replace("\n", "\n              "))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


def main(argv):
    if len(argv) == 2 and argv[1] == "list":
        for verb, cases in CASES.items():
            print("%s %d" % (verb, len(cases)))
        return 0
    if len(argv) == 4 and argv[3] in CASES:
        return run_verb(os.path.abspath(argv[1]), os.path.abspath(argv[2]), argv[3])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
