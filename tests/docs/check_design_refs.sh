#!/usr/bin/env bash
# check_design_refs.sh REPOSITORY_ROOT
#
# Checks the repository's references to its design document, docs/design.md:
#   1. docs/design.md has the sections 1-10 of the original plan's numbering, in order, each
#      heading written "## N. Title" (code comments cite them by number).
#   2. No file points outside the repository at the workspace's planning document
#      (../shared/DESIGN.md, which a clone does not have).
#   3. Every citation "design.md section N" (also "sections N and M", "sections N-M", any case)
#      names a section that docs/design.md has.
#   4. Every file (documentation, scenarios, scripts and the C++/CUDA sources' comments) cites
#      docs/design.md, not a bare DESIGN.md.
# Prints every offending file:line and exits 1 when there is one.
set -euo pipefail
root=${1:?usage: check_design_refs.sh REPOSITORY_ROOT}
cd "$root"
design=docs/design.md
[[ -f $design ]] || { echo "FAIL: $design is missing"; exit 1; }

# The folders and top-level files a clone has (build trees, bundles and out/ are not scanned).
scan=(README.md CMakeLists.txt Makefile .ci cmake docs engine golden harness kernels mesh reports
  scenarios tests tools)
existing=()
for p in "${scan[@]}"; do [[ -e $p ]] && existing+=("$p"); done
grep_repo() {  # grep_repo ERE: file:line:text of every match in the scanned text files
  grep -rnIE --exclude-dir=__pycache__ --exclude=check_design_refs.sh -e "$1" "${existing[@]}" || true
}

problems=()

# 1. The numbered sections, in order, 1-10 present.
mapfile -t sections < <(grep -oE '^## [0-9]+\. ' "$design" | grep -oE '[0-9]+')
declare -A has_section=()
for n in "${sections[@]}"; do has_section[$n]=1; done
expect=1
for n in "${sections[@]}"; do
  if [[ $n -ne $expect ]]; then
    problems+=("$design: section headings out of order: found $n, expected $expect")
    break
  fi
  expect=$((expect + 1))
done
for n in $(seq 1 10); do
  [[ -n ${has_section[$n]:-} ]] || problems+=("$design: no heading '## $n. ...'")
done

# 2. Nothing points at the workspace's planning document ("shared/" "DESIGN.md", split so that
#    this script does not match itself; it is excluded from the scan anyway).
while IFS= read -r hit; do
  [[ -n $hit ]] && problems+=("${hit%%:*}:$(cut -d: -f2 <<<"$hit"): points at shared/DESIGN.md outside the repository; cite docs/design.md")
done < <(grep_repo 'shared/''DESIGN\.md')

# 3. Cited sections exist.
while IFS= read -r hit; do
  [[ -z $hit ]] && continue
  loc=$(cut -d: -f1,2 <<<"$hit")
  while IFS= read -r cite; do
    for n in $(grep -oE '[0-9]+' <<<"$cite"); do
      [[ -n ${has_section[$n]:-} ]] ||
        problems+=("$loc: cites design.md section $n, which $design does not have")
    done
  done < <(grep -oiE 'design\.md,? sections? [0-9]+(( and |, |-)[0-9]+)*' <<<"${hit#*:*:}")
done < <(grep_repo '[Dd][Ee][Ss][Ii][Gg][Nn]\.md,? [Ss]ections? [0-9]')

# 4. Documentation cites docs/design.md.
while IFS= read -r hit; do
  [[ -z $hit ]] && continue
  problems+=("$(cut -d: -f1,2 <<<"$hit"): cites DESIGN.md; the design is docs/design.md")
done < <(grep_repo 'DESIGN\.md')

if ((${#problems[@]})); then
  echo "FAIL: design references:"
  printf '  %s\n' "${problems[@]}"
  exit 1
fi
echo "ok: $design has sections ${sections[*]}; every design reference in ${existing[*]} resolves"
