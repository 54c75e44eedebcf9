#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one go, on a machine with an NVIDIA GPU: the cuda tests, then
# configs A and F (scaled up) through cuda_layer_bench and through the PyTorch peer.
#   bench/cuda/run_on_gpu.sh BUILD_DIR [OUT_DIR]
# BUILD_DIR holds cuda_moe_test and cuda_layer_bench (a build with SY_BUILD_CUDA=ON, or the two
# binaries copied there); logs go to OUT_DIR (default: the current directory).
set -uo pipefail
bin=${1:?usage: run_on_gpu.sh BUILD_DIR [OUT_DIR]}
out=${2:-.}
here=$(cd "$(dirname "$0")" && pwd)
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -1; }
test_bin=$(find_bin cuda_moe_test)
bench_bin=$(find_bin cuda_layer_bench)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
"$test_bin" 2>&1 | tee "$out/cuda_tests.log"
echo "tests exit status: ${PIPESTATUS[0]}"
# A: 8 experts, top-2 (config A's shape, scaled); F: fine-grained, 64 experts, top-8.
A="--tokens 32768 --model 2048 --hidden 8192 --experts 8 --top-k 2 --cf 1.25"
F="--tokens 32768 --model 2048 --hidden 1024 --experts 64 --top-k 8 --cf 1.25"
{
  for cfg in "A:$A" "F:$F" "F-dropless:$F --dropless"; do
    name=${cfg%%:*}
    args=${cfg#*:}
    for gemm in loop grouped; do
      echo "== $name switchyard $gemm"
      # shellcheck disable=SC2086
      "$bench_bin" $args --gemm "$gemm" --dtype bf16
    done
    for impl in grouped_mm loop; do
      echo "== $name torch $impl"
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 python3 "$here/torch_moe_peer.py" $args --impl "$impl"
    done
  done
} 2>&1 | tee "$out/cuda_bench.log"
grep -E "^== |RESULT" "$out/cuda_bench.log"
