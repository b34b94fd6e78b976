#!/bin/sh
# Issue #18.12: two `golden update`s of one golden at the same time must both succeed and leave a
# valid golden (they shared the temporary <golden>.partial: about 1 in 8 left none). TRIALS
# trials of two concurrent updates (two different learning rates, so the goldens differ); after
# each, the golden must read back (`meshproof run` against it passes for one of the two rates)
# and no temporary may be left.
# Usage: check_concurrent_golden.sh MESHPROOF SCENARIO WORK_DIR TRIALS
mp=$1 scenario=$2 work=$3 trials=$4
rm -rf "$work"
mkdir -p "$work"
fail=0
common="--backend cpu --set train.steps=2 --set checks.resume=false --golden-dir $work/g"
t=1
while [ "$t" -le "$trials" ]; do
  "$mp" golden update "$scenario" $common --set train.lr=1e-3 >"$work/a.log" 2>&1 &
  a=$!
  "$mp" golden update "$scenario" $common --set train.lr=2e-3 >"$work/b.log" 2>&1 &
  b=$!
  wait $a; ra=$?
  wait $b; rb=$?
  if [ "$ra" -ne 0 ] || [ "$rb" -ne 0 ]; then
    echo "FAIL trial $t: exits $ra and $rb"; cat "$work/a.log" "$work/b.log"; fail=1
  fi
  ok=0
  for lr in 1e-3 2e-3; do
    "$mp" run "$scenario" $common --set train.lr=$lr --out "$work/out" --quiet >/dev/null 2>&1 && ok=1
  done
  [ "$ok" -eq 1 ] || { echo "FAIL trial $t: no valid golden left"; ls -la "$work/g/quickstart"; fail=1; }
  left=$(ls -A "$work/g/quickstart" | grep -v '^cpu\.h5$' | wc -l)
  [ "$left" -eq 0 ] || { echo "FAIL trial $t: left behind: $(ls -A "$work/g/quickstart")"; fail=1; }
  t=$((t + 1))
done
[ "$fail" -eq 0 ] && echo "OK: $trials trials of two concurrent updates, each left a valid golden"
exit $fail
