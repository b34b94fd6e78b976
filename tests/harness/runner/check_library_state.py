#!/usr/bin/env python3
"""The state check passes on every library scenario with a resume check (issue #20).

For every scenarios/*.yaml whose `checks` hold a `resume` check, the scenario runs (every matrix
entry) with its other checks switched off and `state` enabled at the resume's `at_step` on the
resume's mesh (the scenario's own when the resume has none): same-mesh and cross-mesh, every
recipe of the library. Each scenario must pass (a requires_gpu scenario on a machine without a
GPU: skipped), and its report must hold a passing state check.

  check_library_state.py MESHPROOF SCENARIOS OUT [STEM...]
"""
import os
import re
import sys

from library_run import judge_check, run_with_checks

OFF = ("golden", "resume", "reference", "allgather_parity", "determinism")


def resume_of(path):
    """(at_step, mesh flow mapping or None) of the file's checks.resume, or None without one."""
    lines = open(path).read().splitlines()
    in_checks = in_resume = False
    at_step, mesh = None, None
    for line in lines:
        if re.match(r"^checks:", line):
            in_checks = True
            continue
        if in_checks and re.match(r"^\S", line):
            in_checks = in_resume = False
        if in_checks and re.match(r"^  resume:", line):
            in_resume = True
            continue
        if in_resume and re.match(r"^  \S", line):
            in_resume = False
        if in_resume:
            m = re.match(r"^    at_step:\s*(\d+)", line)
            if m:
                at_step = int(m.group(1))
            m = re.match(r"^    mesh:\s*(\{.*\})", line)
            if m:
                mesh = m.group(1)
    if at_step is None:
        return None
    return at_step, mesh


def main(argv):
    if len(argv) < 4:
        print(__doc__)
        return 2
    meshproof, scenarios, out = argv[1:4]
    stems = argv[4:]
    problems = []
    ran = 0
    for name in sorted(os.listdir(scenarios)):
        if not name.endswith(".yaml") or (stems and name[:-5] not in stems):
            continue
        r = resume_of(os.path.join(scenarios, name))
        if r is None:
            continue
        checks = ["%s: false" % c for c in OFF]
        checks.append("state: {at_step: %d%s}" % (r[0], ", mesh: " + r[1] if r[1] else ""))
        dest = os.path.join(out, name[:-5])
        report = run_with_checks(meshproof, os.path.join(scenarios, name), dest, checks, problems)
        if report is None:
            continue
        ran += judge_check(report, "state", problems)[0]
    for m in problems:
        print("FAIL: " + m)
    print("%d scenario(s), %d problem(s)" % (ran, len(problems)))
    return 1 if problems or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
