#!/bin/bash
# Issue #18.11, a full disk simulated with a file-size limit (ulimit -f; SIGXFSZ ignored, so a
# write past the limit fails with EFBIG "File too large" as ENOSPC would):
#  1. A checkpoint save that fails (the resume check's checkpoint folder cannot be created:
#     checkpoint.dir under /proc) while the reports can be written: the run ends with exit 3 and
#     all four reports, the resume check's error in them with the reason. (A checkpoint save that
#     hits the size limit itself crashes in the HDF5 rank-file writer, engine/checkpoint/checkpoint.cc: a
#     failed H5File::close is closed again by the destructor -- reported to its owner; this case
#     is the report side of the contract.)
#  2. 2 KiB: not even the reports fit: exit 3, the summary still prints, the last line says the
#     reports were not written and exactly why, and no temporary is left in --out.
# Usage: check_disk_full.sh MESHPROOF SCENARIO WORK_DIR RUN_ARGS...
mp=$1 scenario=$2 work=$3
shift 3
rm -rf "$work"
mkdir -p "$work"
fail=0
out="$work/checkpoint_full"
"$mp" run "$scenario" "$@" --set checkpoint.dir=/proc/1/meshproof_ckpt --out "$out" --quiet \
  >"$work/stdout1" 2>&1
rc=$?
cat "$work/stdout1"
[ "$rc" -eq 3 ] || { echo "FAIL (checkpoint full): exit $rc, expected 3"; fail=1; }
for f in report.json report.md junit.xml report.html; do
  [ -s "$out/$f" ] || { echo "FAIL (checkpoint full): $f missing"; fail=1; }
done
grep -q '"kind": "resume"' "$out/report.json" && grep -q '/proc/1/meshproof_ckpt' "$out/report.json" ||
  { echo "FAIL (checkpoint full): report.json lacks the resume check's error with the reason"; fail=1; }
out="$work/reports_full"
(trap '' XFSZ; ulimit -f 2; exec "$mp" run "$scenario" "$@" --set checks.resume=false --out "$out" --quiet) \
  >"$work/stdout2" 2>&1
rc=$?
cat "$work/stdout2"
[ "$rc" -eq 3 ] || { echo "FAIL (reports full): exit $rc, expected 3"; fail=1; }
grep -q 'met their expectation' "$work/stdout2" || { echo "FAIL (reports full): no summary"; fail=1; }
grep -q "the reports were not written to $out: cannot write $out/\.report\.[a-z]*\.tmp\.[0-9]*\.[A-Za-z0-9]*: File too large" "$work/stdout2" ||
  { echo "FAIL (reports full): no line saying why the reports were not written"; fail=1; }
left=$(ls -A "$out" | grep -c '\.tmp\.')
[ "$left" -eq 0 ] || { echo "FAIL (reports full): $left temporaries left in $out"; ls -A "$out"; fail=1; }
[ "$fail" -eq 0 ] && echo "OK"
exit $fail
