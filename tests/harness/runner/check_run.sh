#!/bin/sh
# check_run.sh EXPECTED_EXIT OUT_DIR [GREP_FILE PATTERN] -- meshproof run ARGS...
# Runs the command, requires its exit status, and optionally that GREP_FILE (relative to OUT_DIR)
# contains PATTERN. With EXPECTED_EXIT 2 it also requires that OUT_DIR was not created.
expected=$1; out=$2; shift 2
file=""; pattern=""
if [ "$1" != "--" ]; then file=$1; pattern=$2; shift 2; fi
shift  # --
rm -rf "$out"
"$@"
rc=$?
if [ "$rc" -ne "$expected" ]; then
  echo "check_run: exit $rc, expected $expected" >&2
  exit 1
fi
if [ "$expected" -eq 2 ] && [ -e "$out" ]; then
  echo "check_run: bad input but $out was written" >&2
  exit 1
fi
if [ -n "$file" ]; then
  if ! grep -q -- "$pattern" "$out/$file"; then
    echo "check_run: $out/$file lacks '$pattern'" >&2
    exit 1
  fi
fi
exit 0
