#!/usr/bin/env bash
# Packs meshproof and one test binary with tools/gpu-bundle and checks the bundle stands on its own:
#   - every bundled binary has RUNPATH $ORIGIN/../lib and every bundled library RUNPATH $ORIGIN
#     (and no old-style RPATH, which would be searched before LD_LIBRARY_PATH and inherited);
#   - with LD_LIBRARY_PATH unset, ldd resolves every library that is not on the bundle's exclusion
#     list (glibc, the CUDA driver, cuBLAS/cuBLASLt/NCCL) to a file inside the bundle;
#   - meshproof --version, `meshproof env` and the bundled test binary run from the bundle.
# Hiding the build machine's own library folders would need a mount namespace; the ldd check
# stands in for it (the loader searches RUNPATH before its cache and default folders).
#   gpu_bundle_test.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -uo pipefail
src=$1 build=$2 work=$3
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

rm -rf "$work" && mkdir -p "$work"
bundle=$(realpath -m "$work/bundle")
if ! "$src/tools/gpu-bundle" --bin kernels_core_test "$build" "$bundle"; then
  echo "FAIL: tools/gpu-bundle exited non-zero"; exit 1
fi
unset LD_LIBRARY_PATH

runpath_of() { readelf -d "$1" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p'; }
has_rpath() { readelf -d "$1" | grep -q '(RPATH)'; }

for b in meshproof kernels_core_test; do
  f=$bundle/bin/$b
  [ -x "$f" ] || { fail "$f missing"; continue; }
  rp=$(runpath_of "$f")
  [ "$rp" = '$ORIGIN/../lib' ] || fail "$b RUNPATH is '$rp', want \$ORIGIN/../lib"
  has_rpath "$f" && fail "$b has a DT_RPATH"
done
nlibs=0
for f in "$bundle"/lib/*.so*; do
  nlibs=$((nlibs + 1))
  rp=$(runpath_of "$f")
  [ "$rp" = '$ORIGIN' ] || fail "$(basename "$f") RUNPATH is '$rp', want \$ORIGIN"
  has_rpath "$f" && fail "$(basename "$f") has a DT_RPATH"
done
# The build links HDF5, fmt, yaml-cpp and libstdc++ at least: an empty lib/ means ldd found nothing.
[ "$nlibs" -ge 4 ] || fail "only $nlibs libraries bundled"

skip=$(cat "$bundle/lib/EXCLUDED")
[[ "libcublasLt.so.13" =~ $skip ]] || fail "cuBLASLt is bundled without --with-cuda-libs"
[[ "libhdf5_serial.so.103" =~ $skip ]] && fail "the exclusion list covers HDF5"
# Libraries each binary must find inside the bundle whatever the build (CUDA on or off): the C++
# runtime and fmt everywhere, yaml-cpp and HDF5 for the CLI.
declare -A required=([meshproof]="libstdc++ libfmt libyaml-cpp libhdf5"
                     [kernels_core_test]="libstdc++ libfmt")
for b in meshproof kernels_core_test; do
  inside=0
  inside_names=""
  while read -r line; do
    case "$line" in *"not found"*) fail "$b: $line"; continue ;; esac
    name=$(awk '{print $1}' <<< "$line")
    path=$(awk '/=>/ {print $3}' <<< "$line")
    [ -n "$path" ] || continue
    path=$(realpath -m "$path")  # the loader reports $ORIGIN/../lib as bin/../lib
    if [[ "$name" =~ $skip ]]; then continue; fi
    case "$path" in
      "$bundle"/lib/*) inside=$((inside + 1)); inside_names+=" $name" ;;
      *) fail "$b: $name resolves outside the bundle: $path" ;;
    esac
  done < <(ldd "$bundle/bin/$b")
  for lib in ${required[$b]}; do
    [[ "$inside_names" == *" $lib"* ]] || fail "$b: $lib is not resolved inside the bundle"
  done
done

out=$("$bundle/bin/meshproof" --version) || fail "bin/meshproof --version exited $?"
[[ "$out" == meshproof* ]] || fail "bin/meshproof --version printed '$out'"
out=$("$bundle/meshproof" --version) || fail "the bundle's meshproof link exited $?"
"$bundle/bin/meshproof" env > "$work/env.txt" || fail "bin/meshproof env exited $?"
grep -q '^active backend' "$work/env.txt" || fail "meshproof env printed no active backend"
# cuBLASLt is opened with dlopen (kernels/gemm/cublaslt_api.h), not linked: in a CUDA build the bundled
# binary must still find it (here through the loader's search or the build's toolkit folder).
if grep -q '^backends compiled.*cuda' "$work/env.txt"; then
  ldd "$bundle/bin/meshproof" | grep -q libcublasLt && fail "bin/meshproof links libcublasLt again"
  grep -Eq '^cuBLASLt +[0-9]+\.[0-9]+' "$work/env.txt" ||
    fail "the bundled meshproof env did not open cuBLASLt: $(grep '^cuBLASLt' "$work/env.txt")"
fi
"$bundle/bin/kernels_core_test" --gtest_brief=1 > "$work/core_test.txt" 2>&1 ||
  fail "bundled kernels_core_test failed: $(tail -5 "$work/core_test.txt")"

"$src/tools/gpu-bundle" --bogus "$build" "$work/x" > /dev/null 2>&1
[ $? -eq 2 ] || fail "gpu-bundle --bogus did not exit 2"

if [ "$fails" -ne 0 ]; then echo "$fails check(s) failed"; exit 1; fi
echo "gpu bundle OK: $nlibs libraries, RUNPATH \$ORIGIN, binaries run from $bundle"
