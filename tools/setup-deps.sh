#!/usr/bin/env bash
# Installs meshproof's build and test dependencies from Debian packages. Idempotent: packages
# already present are skipped, and apt is not touched at all when nothing is missing.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libyaml-cpp-dev libhdf5-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libopenblas-dev libopenmpi-dev openmpi-bin libxxhash-dev
  # engine/dcp: the zip archives torch.save writes inside PyTorch DCP checkpoints
  libzip-dev
  libgtest-dev libgmock-dev libbenchmark-dev clang-format
  # make test-sanitize / make fuzz: clang with ASan, UBSan and libFuzzer runtimes, and
  # llvm-symbolizer for the reports' stacks
  clang libclang-rt-dev llvm
  # tools/gpu-bundle: sets the bundled binaries' RUNPATH to $ORIGIN
  patchelf
  # test-side reference scripts (Debian's python3): h5py for HDF5 round trips, torch for the
  # independent PyTorch model reference
  python3 python3-numpy python3-h5py python3-torch
  # report tests: report.json against reports/schema/report.schema.json, junit.xml against the
  # Ant JUnit XSD
  python3-jsonschema python3-xmlschema
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
