#!/usr/bin/env bash
# clang-format over the project's C++ sources, in place. --check: change nothing, fail (listing
# files) if any would change. Any other argument is an error (it formats nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 1 ] || { [ $# -eq 1 ] && [ "$1" != "--check" ]; }; then
  echo "usage: scripts/format.sh [--check]   (got: $*)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files -co --exclude-standard '*.h' '*.cc' '*.cu' '*.cuh' | grep -v '^build/')
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    if ! clang-format --style=file "$f" | cmp -s - "$f"; then bad+=("$f"); fi
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "clang-format: these files need formatting (run scripts/format.sh):"
    printf '  %s\n' "${bad[@]}"
    exit 1
  fi
  echo "clang-format: ${#files[@]} files ok"
else
  clang-format --style=file -i "${files[@]}"
fi
