#!/usr/bin/python3
"""docs/scenarios.md's fault table says what the fault table in the binary says (issue #46: the
catalog's "caught by" and the code had disagreed).

usage: check_fault_catalog_doc.py MESHPROOF DOCS/scenarios.md

For every row of `meshproof faults --json`, the table under "### `faults`" has one row whose
first cell is the fault's name, and its "caught by" cell names exactly the row's checks. A cell
lists checks separated by commas, each optionally followed by a note in parentheses; "resume
with a mesh override" is the claim resume_cross_mesh. Exits 1 naming each difference.
"""
import json
import re
import subprocess
import sys

PHRASES = {"resume with a mesh override": "resume_cross_mesh"}


def strip_notes(cell):
    out, depth = "", 0
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            out += ch
        depth -= ch == ")"
    return out


def doc_rows(path):
    text = open(path, encoding="utf-8").read()
    section = text[text.index("### `faults`"):]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z0-9_]+)`( \(generic\))? \|", line)
        if not m:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 5:
            raise SystemExit("%s: row of %s has %d cells, expected 5" % (path, m.group(1),
                                                                        len(cells)))
        checks = set()
        for part in strip_notes(cells[3]).split(","):
            part = part.strip()
            if part:
                checks.add(PHRASES.get(part, part))
        rows[m.group(1)] = checks
    return rows


def main(argv):
    table = json.loads(subprocess.run([argv[1], "faults", "--json"], check=True,
                                      capture_output=True, text=True).stdout)
    docs = doc_rows(argv[2])
    problems = []
    for row in table:
        name, claims = row["name"], set(row["caught_by"])
        if name not in docs:
            problems.append("%s: no row in %s" % (name, argv[2]))
        elif docs[name] != claims:
            problems.append("%s: the docs say caught by %s, the binary %s" %
                            (name, sorted(docs[name]), sorted(claims)))
    for name in sorted(set(docs) - {r["name"] for r in table}):
        problems.append("%s: documented but not in the fault table" % name)
    for p in problems:
        print("FAIL: " + p)
    print("%d faults, %d problems" % (len(table), len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
