#!/usr/bin/env bash
# The mpi launcher's collective watchdog against a stopped rank (issue #18.2): run
# mpi_stall_probe under `mpirun -np NP` with MESHPROOF_COLLECTIVE_TIMEOUT=TIMEOUT, SIGSTOP rank
# VICTIM once every rank is looping all_reduce, and require that
#   - the job ends by itself within BOUND seconds of the stop, with a non-zero status,
#   - the output names the collective, the group of all NP ranks and exactly the stopped rank,
#   - a waiting rank (rank 0) used less than a third of a core while it waited (poll with backoff,
#     not a 100% spin), measured from its /proc utime+stime between 1 s and TIMEOUT-1 s after the
#     stop.
# Usage: check_mpi_watchdog.sh MPIEXEC PROBE NP VICTIM TIMEOUT BOUND
set -u
mpiexec=$1 probe=$2 np=$3 victim=$4 timeout=$5 bound=$6
log=$(mktemp)
trap 'rm -f "$log"' EXIT
MESHPROOF_COLLECTIVE_TIMEOUT=$timeout "$mpiexec" -np "$np" --oversubscribe "$probe" >"$log" 2>&1 &
mp=$!
for _ in $(seq 600); do
  [ "$(grep -c '^ready rank' "$log")" -ge "$np" ] && break
  kill -0 "$mp" 2>/dev/null || break
  sleep 0.1
done
if [ "$(grep -c '^ready rank' "$log")" -lt "$np" ]; then
  echo "FAIL: the probe did not start $np ranks:"; cat "$log"; kill "$mp" 2>/dev/null; exit 1
fi
vpid=$(awk -v r="$victim" '$1 == "ready" && $3 == r { print $5 }' "$log")
wpid=$(awk '$1 == "ready" && $3 == 0 { print $5 }' "$log")
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0; }
kill -STOP "$vpid"
stopped=$(date +%s.%N)
sleep 1
c0=$(cpu_ticks "$wpid") t0=$(date +%s.%N)
sleep $(awk -v t="$timeout" 'BEGIN { print t - 2 }')
c1=$(cpu_ticks "$wpid") t1=$(date +%s.%N)
hz=$(getconf CLK_TCK)
while kill -0 "$mp" 2>/dev/null; do
  if awk -v a="$stopped" -v b="$(date +%s.%N)" -v m="$bound" 'BEGIN { exit !(b - a > m) }'; then
    echo "FAIL: the job still runs $bound s after rank $victim was stopped (timeout $timeout s):"
    cat "$log"
    kill -CONT "$vpid"; kill "$mp"; sleep 1; kill -9 "$mp" 2>/dev/null
    exit 1
  fi
  sleep 0.2
done
wait "$mp"
status=$?
ended=$(date +%s.%N)
kill -CONT "$vpid" 2>/dev/null  # in case mpirun left it behind
cat "$log"
elapsed=$(awk -v a="$stopped" -v b="$ended" 'BEGIN { printf "%.1f", b - a }')
share=$(awk -v c="$((c1 - c0))" -v hz="$hz" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", c / hz / (b - a) }')
echo "job ended ${elapsed}s after the stop with status $status; rank 0 used $share of a core while waiting"
fail=0
[ "$status" -ne 0 ] || { echo "FAIL: the job exited 0"; fail=1; }
ranks=$(seq -s ', ' 0 $((np - 1)))
grep -q "mpi all_reduce (call [0-9]* on this group) on dp_shard group of ranks \[$ranks\] timed out after [0-9.]* s on rank [0-9]*: ranks \[$victim\] never arrived" "$log" ||
  { echo "FAIL: no watchdog message naming all_reduce, the group [$ranks] and rank $victim"; fail=1; }
grep -q "MESHPROOF_COLLECTIVE_TIMEOUT" "$log" || { echo "FAIL: the message does not say how to change the limit"; fail=1; }
awk -v s="$share" 'BEGIN { exit !(s < 0.34) }' || { echo "FAIL: a waiting rank used $share of a core"; fail=1; }
[ "$fail" -eq 0 ] && echo "OK"
exit "$fail"
