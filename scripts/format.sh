#!/usr/bin/env bash
# clang-format over the project's C++ sources. --check: fail (listing files) if any would change.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files -co --exclude-standard '*.h' '*.cc' | grep -v '^build/')
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
