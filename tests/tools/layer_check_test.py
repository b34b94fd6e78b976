#!/usr/bin/python3
"""tools/check-layers rejects wrong-direction includes under the repository's own rules.

usage: layer_check_test.py REPOSITORY_ROOT WORK_DIR

1. The repository as it is: exit 0.
2. A copy of the repository's layer folders' README.md files (its rules, nothing else) plus one
   source per case: a kernels file including an engine header (upward), a reports file including
   a harness header (reports is apart), an engine file including reports, a sibling folder the
   README does not list (kernels/core including kernels/attention), a source directly in a layer
   folder, and a folder without a README: each exits 1 and names the file and line. A source
   including only what its README lists exits 0 (the cases fail for their include, not for the
   copy).
Prints one line per case and "N passed, M failed".
"""
import os
import shutil
import subprocess
import sys

CASES = [
    # (name, path, text, expected exit, expected substring)
    ("kernels includes engine", "kernels/core/bad.cc", '#include "engine/model/model.h"\n', 1,
     "kernels/core/bad.cc:1: includes engine/model/model.h: layers point down"),
    ("reports includes harness", "reports/writers/bad.cc",
     '#include "reports/record/run_record.h"\n#include "harness/run/runner.h"\n', 1,
     "reports/writers/bad.cc:2: includes harness/run/runner.h: layers point down"),
    ("engine includes reports", "engine/model/bad.cc", '#include "reports/record/run_record.h"\n',
     1, "engine/model/bad.cc:1: includes reports/record/run_record.h: layers point down"),
    ("unlisted sibling", "kernels/core/bad.cc", '#include "kernels/attention/attention.h"\n', 1,
     "kernels/core/bad.cc:1: includes kernels/attention/attention.h, but kernels/core/README.md "
     "does not list kernels/attention"),
    ("source in a layer folder", "mesh/stray.cc", '#include "mesh/core/layout.h"\n', 1,
     "mesh/stray.cc: a source directly in mesh/"),
    ("folder without a README", "harness/newfolder/x.cc", '#include "harness/run/runner.h"\n', 1,
     "harness/newfolder/ has no README.md"),
    ("listed includes only", "engine/model/ok.cc",
     '#include "engine/config/config.h"\n#include "kernels/core/tensor.h"\n', 0, "0 violations"),
]


def main(argv):
    root, work = argv[1], argv[2]
    tool = os.path.join(root, "tools", "check-layers")
    passed = failed = 0

    def check(name, r, code, text):
        nonlocal passed, failed
        ok = r.returncode == code and text in r.stdout
        print("%s %s: exit %d%s" % ("ok  " if ok else "FAIL", name, r.returncode,
                                     "" if ok else "\n" + r.stdout))
        passed, failed = passed + ok, failed + (not ok)

    check("the repository", subprocess.run([tool, root], capture_output=True, text=True), 0,
          "0 violations")
    for name, path, text, code, expected in CASES:
        shutil.rmtree(work, ignore_errors=True)
        for layer in ("kernels", "mesh", "engine", "harness", "reports"):
            for dirpath, _, files in os.walk(os.path.join(root, layer)):
                if "README.md" in files:
                    dst = os.path.join(work, os.path.relpath(dirpath, root))
                    os.makedirs(dst, exist_ok=True)
                    shutil.copy(os.path.join(dirpath, "README.md"), dst)
        os.makedirs(os.path.dirname(os.path.join(work, path)), exist_ok=True)
        with open(os.path.join(work, path), "w") as f:
            f.write(text)
        check(name, subprocess.run([tool, work], capture_output=True, text=True), code, expected)
    shutil.rmtree(work, ignore_errors=True)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
