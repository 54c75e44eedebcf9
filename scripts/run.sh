#!/usr/bin/env bash
# The README's run command: installs what is needed, builds (release) and runs the main job.
# Extra arguments are passed to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target switchyard
# Until `switchyard train` (EP over in-process ranks, issue 7) exists, the main job is the most complete
# real workload: the single-rank trainer with an MoE FFN in every other block on the fortunes corpus.
exec build/release/src/cli/switchyard train-dense --moe_every 2 --steps 300 --out runs/main "$@"
