#!/usr/bin/env bash
# The README's run command: installs what is needed, builds (release) and runs the main job.
# Extra arguments are passed to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target switchyard
exec build/release/src/cli/switchyard bench gemm --m 256 --k 512 --n 2048 "$@"
