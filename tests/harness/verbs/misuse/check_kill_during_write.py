#!/usr/bin/python3
"""A kill while a verb writes its output leaves the old output or a complete new one (issue #46).

usage: check_kill_during_write.py MESHPROOF WORK_DIR quantize|export

An old output (a text file "old output") sits at the target. The verb is started ROUNDS times and
sent SIGKILL after delays spread over its write (timed from the moment its temporary appears, as
measured in an uninterrupted run, to just past its end), at least one of them inside it. After each kill the target must be byte for byte the
old output, or a complete new one: an HDF5 file whose datasets equal those of a reference output
written by an uninterrupted run. Temporaries a kill leaves are the project's pattern
(.<name>.tmp.<pid>.XXXXXX) and the next complete run removes them. Exits 1 naming the round.
"""
import glob
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

ROUNDS = 24
OLD = b"old output\n"


def datasets(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def same_datasets(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def main(argv):
    meshproof, work, verb = argv[1], argv[2], argv[3]
    os.makedirs(work, exist_ok=True)
    for p in glob.glob(os.path.join(work, "*")) + glob.glob(os.path.join(work, ".*")):
        os.remove(p)
    target = os.path.join(work, "out.h5")
    if verb == "quantize":
        # Large enough that writing the eight datasets takes a while (about 200 MB).
        with h5py.File(os.path.join(work, "x.h5"), "w") as f:
            f["x"] = np.random.default_rng(46).standard_normal((4096, 2048)).astype(np.float32)
        cmd = [meshproof, "quantize", "--recipe", "mxfp8", "--in", os.path.join(work, "x.h5"),
               "--out", target]
    else:
        cmd = [meshproof, "export", "--out", target, "--vocab", "512", "--hidden", "128",
               "--heads", "4", "--layers", "2", "--ffn", "512", "--seq-len", "64", "--batch", "8",
               "--steps", "3"]
    temporaries = os.path.join(work, ".out.h5.tmp.*")

    def start_and_wait_for_the_write():
        """Starts the verb; returns it once its temporary exists (the write has begun)."""
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not glob.glob(temporaries) and p.poll() is None:
            time.sleep(0.0005)
        return p

    # One uninterrupted run: the reference output and how long its write takes.
    p = start_and_wait_for_the_write()
    t0 = time.monotonic()
    if p.wait() != 0:
        print("FAIL: the uninterrupted run exited %d" % p.returncode)
        return 1
    write = time.monotonic() - t0
    reference = datasets(target)
    problems = []
    outcomes = {"old": 0, "new": 0}
    during = 0
    for r in range(ROUNDS):
        with open(target, "wb") as f:
            f.write(OLD)
        # Kills spread over the write itself, from its first moment to just past its end.
        delay = write * 1.2 * r / ROUNDS
        p = start_and_wait_for_the_write()
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        during += bool(glob.glob(temporaries))
        for t in glob.glob(temporaries):
            os.remove(t)
        with open(target, "rb") as f:
            head = f.read()
        if head == OLD:
            outcomes["old"] += 1
            continue
        try:
            ok = same_datasets(datasets(target), reference)
        except OSError as e:
            ok = False
            head = str(e).encode()
        if ok:
            outcomes["new"] += 1
        else:
            problems.append("round %d (kill %.4f s into the write): the target is neither the old "
                            "output nor a complete new one: %r" % (r, delay, head[:80]))
    if during == 0:
        problems.append("no kill landed inside the write (the test proved nothing)")
    # A kill leaves its temporary; the next complete run removes it (its process is gone).
    with open(target, "wb") as f:
        f.write(OLD)
    p = start_and_wait_for_the_write()
    time.sleep(write / 4)
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = glob.glob(os.path.join(work, ".out.h5.tmp.*"))
    # A complete run removes what killed runs left (their processes are gone).
    subprocess.run(cmd, check=True, capture_output=True)
    still = glob.glob(os.path.join(work, ".out.h5.tmp.*"))
    if still:
        problems.append("a complete run left the killed runs' temporaries: %s" % still)
    if not same_datasets(datasets(target), reference):
        problems.append("the complete run after the kills wrote other data")
    print("%s: the write takes %.4f s; %d kills spread over it: %d inside the write, %d left the "
          "old output, %d a complete new one; %d temporaries left by a kill, %d after the next "
          "run" % (verb, write, ROUNDS, during, outcomes["old"], outcomes["new"], len(left),
                   len(still)))
    for m in problems:
        print("FAIL: " + m)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
