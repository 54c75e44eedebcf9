#!/usr/bin/env bash
# Usage: scripts/losses.sh SWITCHYARD_BINARY OUTDIR [EXTRA TRAIN FLAGS...]
# Runs `train` for 6 steps on five layouts (the default 4 ranks with ep 4, tp 2 + sequence
# parallel, pp 2 with 1F1B, cp 2, ep 4 + ZeRO-3) and writes OUTDIR/<layout>.losses: every
# metrics.jsonl line with the timing fields removed (losses, gradient norms, aux loss, lr, ...).
# Two binaries' outputs compared with `cmp` say whether a change kept the arithmetic bit for bit;
# e.g. `scripts/losses.sh old/switchyard a --arch gpt; scripts/losses.sh new/switchyard b --arch gpt`.
# Run both under the same SY_EXPERT_GEMM (docs/moe.md): the experts' GEMM kernel follows the CPU
# unless it is set, and the packed kernel and the BLAS backend sum in different orders.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,9p "$0"; exit 2; }
[ -f "$1" ] && [ -x "$1" ] || { echo "losses.sh: '$1' is not an executable file (expected a switchyard binary)" >&2; exit 2; }
BIN=$(readlink -f "$1"); OUT=$(readlink -f -m "$2"); shift 2
mkdir -p "$OUT"
common=(--steps 6 --log-every 1 --eval-every 3 --checkpoint-every 0 --sample-tokens 0 --threads 1)
run() {
  local name=$1; shift
  rm -rf "$OUT/run_$name"
  "$BIN" train "${common[@]}" --out "$OUT/run_$name" "$@" > "$OUT/$name.log" 2>&1 ||
    { echo "losses.sh: $name failed (log: $OUT/$name.log)" >&2; exit 1; }
  python3 - "$OUT/run_$name/metrics.jsonl" > "$OUT/$name.losses" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    for k in list(d):
        if any(s in k for s in ("time", "per_s", "_s", "seconds", "share", "rss", "mfu", "flops", "bytes", "eta")):
            d.pop(k)
    print(json.dumps(d, sort_keys=True))
PY
}
run default "$@"
run tp2sp --tp 2 --sequence-parallel "$@"
run pp2 --pp 2 --microbatches 4 --pipeline-schedule 1f1b "$@"
run cp2 --cp 2 "$@"
run ep4z3 --ep 4 --zero-stage 3 "$@"
echo "wrote $OUT"
