#!/usr/bin/env bash
# Under mpirun every process runs the scenarios, but only rank 0 prints and writes reports:
# the summary line appears once, and the report set is there.
# Usage: check_rank0_reports.sh MPIEXEC MESHPROOF OUT_DIR -- RUN_ARGS...
set -euo pipefail
mpiexec=$1 meshproof=$2 out=$3
shift 4
rm -rf "$out"
log=$("$mpiexec" -np 4 --oversubscribe "$meshproof" run "$@" --launcher mpi --out "$out")
n=$(grep -c 'scenario(s) met their expectation' <<<"$log" || true)
if [ "$n" != 1 ]; then
  echo "expected one summary line from rank 0, got $n:"
  echo "$log"
  exit 1
fi
for f in junit.xml report.html report.json report.md; do
  [ -s "$out/$f" ] || { echo "missing $out/$f"; exit 1; }
done
echo "one summary line (rank 0), reports in $out"
