#!/bin/sh
# The output folder is checked before any training (issues #17.5, #18.11): --out naming an
# existing file (left unchanged) or a folder this process cannot write is exit 2 with the reason
# and no scenario run. A good --out: a run removes the orphan report temporaries a killed run
# left there (the project's pattern, process gone) and nothing else.
# Usage: check_out_preflight.sh MESHPROOF SCENARIO WORK_DIR RUN_ARGS...
mp=$1 scenario=$2 work=$3
shift 3
rm -rf "$work"
mkdir -p "$work"
fail=0
check() {  # WHAT OUT PATTERN
  what=$1 out=$2 pattern=$3
  shift 3
  "$mp" run "$scenario" "$@" --out "$out" --quiet >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [ "$rc" -eq 2 ] || { echo "FAIL ($what): exit $rc, expected 2"; cat "$work/stdout" "$work/stderr"; fail=1; }
  if grep -q '^OK\|^FAIL\|^ERROR' "$work/stdout"; then echo "FAIL ($what): a scenario ran"; fail=1; fi
  grep -qF -- "$pattern" "$work/stderr" || { echo "FAIL ($what): stderr lacks '$pattern':"; cat "$work/stderr"; fail=1; }
  echo "ok ($what): $(cat "$work/stderr")"
}
# An existing file.
printf 'keep me\n' >"$work/a_file"
check "--out is a file" "$work/a_file" "exists and is not a directory" "$@"
[ "$(cat "$work/a_file")" = "keep me" ] || { echo "FAIL: the file was changed"; fail=1; }
# A folder that cannot be written: chmod works for an ordinary user; root writes anywhere but
# /proc.
if [ "$(id -u)" -ne 0 ]; then
  mkdir "$work/ro" && chmod 555 "$work/ro"
  check "unwritable folder" "$work/ro" "the folder is not writable: cannot create a temporary file in" "$@"
  chmod 755 "$work/ro"
else
  check "unwritable folder" /proc/1 "the folder is not writable: cannot create a temporary file in" "$@"
fi
# Orphans: a temporary of a dead process is removed; a live one's, other files, are not.
sh -c 'exit 0' &
dead=$!
wait $dead
out="$work/good"
mkdir -p "$out"
for f in ".report.json.tmp.$dead.Ab12Cd" ".junit.xml.tmp.$dead" ".report.html.tmp.$$.Zz99Yy" \
         ".notes.tmp.$dead.Ab12Cd" "keep.tmp"; do
  printf x >"$out/$f"
done
"$mp" run "$scenario" "$@" --out "$out" --quiet >"$work/stdout" 2>&1
rc=$?
[ "$rc" -eq 0 ] || { echo "FAIL (good run): exit $rc"; cat "$work/stdout"; fail=1; }
for f in ".report.json.tmp.$dead.Ab12Cd" ".junit.xml.tmp.$dead"; do
  [ ! -e "$out/$f" ] || { echo "FAIL: orphan $f was not removed"; fail=1; }
done
for f in ".report.html.tmp.$$.Zz99Yy" ".notes.tmp.$dead.Ab12Cd" "keep.tmp" report.json; do
  [ -e "$out/$f" ] || { echo "FAIL: $f is gone"; fail=1; }
done
[ "$(ls -A "$out" | grep -c 'meshproof-write-probe')" -eq 0 ] || { echo "FAIL: the write probe was left behind"; fail=1; }
[ "$fail" -eq 0 ] && echo "OK"
exit $fail
