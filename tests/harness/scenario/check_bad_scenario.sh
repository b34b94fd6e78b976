#!/bin/sh
# Runs the real binary on one bad scenario and checks what a user's shell sees: exit code 2 and,
# as the first line on stderr, exactly the message in the file's `# expect:` header (with
# ${FILE} standing for the path as passed on the command line).
# usage: check_bad_scenario.sh MESHPROOF FILE
meshproof="$1"
file="$2"
expected=$(sed -n 's/^# expect: //p' "$file" | sed "s|\${FILE}|$file|g")
[ -n "$expected" ] || { echo "$file has no '# expect:' header"; exit 1; }
err=$("$meshproof" validate "$file" 2>&1 >/dev/null)
rc=$?
if [ "$rc" -ne 2 ]; then
  echo "exit code $rc, want 2"
  exit 1
fi
first=$(printf '%s\n' "$err" | head -n 1)
if [ "$first" != "$expected" ]; then
  echo "got:  $first"
  echo "want: $expected"
  exit 1
fi
echo "ok: $first"
