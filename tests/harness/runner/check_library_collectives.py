#!/usr/bin/env python3
"""The collectives check passes on every library scenario (issue #20).

Every scenarios/*.yaml runs (every matrix entry) with its other checks switched off and
`collectives: true`: each step's recorded parameter collectives of every rank must equal the
sharding plan's. Each scenario must pass (a requires_gpu scenario on a machine without a GPU:
skipped), its report must hold a passing collectives check, and over the library at least one
scenario must have compared a collective (a budget that is always empty would pass vacuously).

  check_library_collectives.py MESHPROOF SCENARIOS OUT [STEM...]
"""
import os
import re
import sys

from library_run import judge_check, run_with_checks

OFF = ("golden", "resume", "reference", "allgather_parity", "determinism", "state")


def main(argv):
    if len(argv) < 4:
        print(__doc__)
        return 2
    meshproof, scenarios, out = argv[1:4]
    stems = argv[4:]
    problems = []
    ran = compared = 0
    for name in sorted(os.listdir(scenarios)):
        if not name.endswith(".yaml") or (stems and name[:-5] not in stems):
            continue
        checks = ["%s: false" % c for c in OFF] + ["collectives: true"]
        dest = os.path.join(out, name[:-5])
        report = run_with_checks(meshproof, os.path.join(scenarios, name), dest, checks, problems)
        if report is None:
            continue
        n, passed = judge_check(report, "collectives", problems)
        ran += n
        for _, c in passed:
            m = re.match(r"(\d+) parameter collectives", c["message"])
            compared += int(m.group(1)) if m else 0
    for m in problems:
        print("FAIL: " + m)
    print("%d scenario(s), %d collectives compared, %d problem(s)" % (ran, compared, len(problems)))
    return 1 if problems or ran == 0 or compared == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
