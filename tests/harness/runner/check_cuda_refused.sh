#!/bin/sh
# Issue #17.3: an explicit cuda backend on a machine without a usable GPU is bad input (exit 2,
# nothing run, no output folder), with the reason `meshproof env` gives; it used to skip every
# scenario and exit 0. Both spellings: --backend cuda, and the scenario's own backend: cuda; also
# `golden update --backend cuda`; and every other verb that takes --backend (bench comm, bench
# recipes, quantize: kernels::resolve_backend, before any input is read). Where a GPU is usable there is nothing to refuse: exit 77
# (CTest: skipped).
# Usage: check_cuda_refused.sh MESHPROOF SCENARIO OUT_DIR
mp=$1 scenario=$2 out=$3
if ! "$mp" env | grep -q 'active backend *cpu'; then
  echo "a GPU is usable here: an explicit cuda backend is not refused"; exit 77
fi
reason=$("$mp" env --json | sed -n 's/.*"unusable_reason": "\(.*\)".*/\1/p' | head -n 1)
[ -n "$reason" ] || { echo "FAIL: meshproof env --json gives no unusable_reason"; exit 1; }
fail=0
expect_refused() {  # WHAT PATTERN -- ARGS...
  what=$1 pattern=$2; shift 3
  rm -rf "$out"
  "$mp" "$@" >"$out.stdout" 2>"$out.stderr"
  rc=$?
  if [ "$rc" -ne 2 ]; then echo "FAIL ($what): exit $rc, expected 2"; cat "$out.stdout" "$out.stderr"; fail=1; return; fi
  if [ -e "$out" ]; then echo "FAIL ($what): $out was created"; fail=1; fi
  if grep -q '^OK\|^run \|wrote ' "$out.stdout"; then echo "FAIL ($what): something ran"; fail=1; fi
  grep -qF -- "$pattern" "$out.stderr" || { echo "FAIL ($what): stderr lacks '$pattern':"; cat "$out.stderr"; fail=1; }
  grep -qF -- "$reason" "$out.stderr" || { echo "FAIL ($what): stderr lacks env's reason '$reason'"; fail=1; }
  echo "ok ($what): $(cat "$out.stderr")"
}
expect_refused "--backend cuda" "backend cuda (--backend cuda) but no usable GPU: " -- \
  run "$scenario" --backend cuda --out "$out" --quiet
expect_refused "backend: cuda" "backend cuda (the scenario's backend: cuda) but no usable GPU: " -- \
  run "$scenario" --set backend=cuda --out "$out" --quiet
expect_refused "golden update" "backend cuda (--backend cuda) but no usable GPU: " -- \
  golden update "$scenario" --backend cuda --golden-dir "$out"
pattern="backend 'cuda' requested but CUDA is not usable: "
expect_refused "bench comm" "$pattern" -- bench comm --backend cuda --mesh dp_shard=2 --sizes 4K
expect_refused "bench recipes" "$pattern" -- bench recipes --backend cuda
expect_refused "quantize" "$pattern" -- \
  quantize --recipe current --backend cuda --in "$out.missing.h5" --out "$out"
rm -f "$out.stdout" "$out.stderr"
exit $fail
