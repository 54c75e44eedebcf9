#!/usr/bin/env bash
# The README's run command: installs what is needed, builds (release) and runs the main job.
# Extra arguments are passed to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target switchyard
# The main job: `switchyard train` on its embedded default (a small Mixtral-style MoE transformer,
# 4 ranks as threads of this process with the experts spread over them, the fortunes corpus),
# into runs/train.
exec build/release/src/cli/switchyard train "$@"
