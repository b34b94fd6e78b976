#!/usr/bin/python3
"""Runs a meshproof command and checks that what it wrote records the argv exactly as given.

usage: check_command_line.py report OUT_DIR/report.json -- MESHPROOF ARGS...
       check_command_line.py golden GOLDEN.h5 -- MESHPROOF ARGS...

report: report.json's command_line equals the argv list.
golden: the golden's `command` provenance attribute, split as a POSIX shell would (shlex), equals
the argv list (and `device` is "cpu" for --backend cpu).
The command must exit 0. Exits 1 naming the difference otherwise.
"""
import json
import os
import shlex
import subprocess
import sys

import h5py


def main():
    kind, path = sys.argv[1], sys.argv[2]
    assert sys.argv[3] == "--", "usage: see the docstring"
    argv = sys.argv[4:]
    if os.path.exists(path):
        os.remove(path)
    rc = subprocess.run(argv).returncode
    if rc != 0:
        print("command exited %d" % rc)
        return 1
    if kind == "report":
        with open(path, encoding="utf-8") as f:
            got = json.load(f)["command_line"]
    else:
        with h5py.File(path, "r") as f:
            attrs = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in f.attrs.items()}
        got = shlex.split(attrs["command"])
        if "--backend" in argv and argv[argv.index("--backend") + 1] == "cpu" and attrs["device"] != "cpu":
            print("golden device %r, expected 'cpu'" % attrs["device"])
            return 1
    if got != argv:
        print("recorded %r\nexpected %r" % (got, argv))
        return 1
    print("%s records the argv (%d words)" % (path, len(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
