#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, AddressSanitizer + UBSan) in build/fuzz and runs each for
# SECONDS on a copy of its seed corpus (fuzz/corpus/<name>/), with its dictionary
# (fuzz/dicts/<name>.dict). Fails on any crash, uncaught exception, sanitizer report, leak,
# timeout or out-of-memory; the input that caused it is kept in build/fuzz/run/<target>/ and its
# log is printed. New inputs found are left in build/fuzz/run/<target>/corpus (copy interesting
# ones into fuzz/corpus/ by hand).
#
# Usage: scripts/fuzz.sh [SECONDS]   (default 20; per target)
#   SY_FUZZ_TARGETS="fuzz_npy ..."  run only these targets
#   SY_JOBS=N                       build parallelism (default: nproc)
#   SY_UNITY_BUILD=ON               unity batches of the libraries (scripts/test.sh sets it)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-20}
BUILD=build/fuzz
JOBS=${SY_JOBS:-$(nproc)}

for tool in clang clang++; do
  command -v "$tool" >/dev/null || { echo "fuzz: $tool not found (scripts/setup.sh installs it)"; exit 1; }
done

# Tests, benchmarks and MPI are not needed; warnings are checked by the gcc builds.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSY_BUILD_FUZZ=ON -DSY_SANITIZE=address,undefined \
  -DSY_BUILD_TESTS=OFF -DSY_BUILD_BENCH=OFF -DSY_WITH_MPI=OFF -DSY_WERROR=OFF \
  -DSY_UNITY_BUILD="${SY_UNITY_BUILD:-OFF}" >/dev/null
mapfile -t targets < <(grep -v '^$' "$BUILD/fuzz/targets.txt")
if [ -n "${SY_FUZZ_TARGETS:-}" ]; then read -r -a targets <<< "$SY_FUZZ_TARGETS"; fi
cmake --build "$BUILD" --target "${targets[@]}" -j "$JOBS"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# The targets run at the same time (each libFuzzer process is single-threaded), then their logs
# are checked one by one.
failed=()
pids=()
for target in "${targets[@]}"; do
  name=${target#fuzz_}
  run="$BUILD/run/$target"
  rm -rf "$run"
  mkdir -p "$run/corpus" "$run/artifacts"
  if [ -d "fuzz/corpus/$name" ]; then cp fuzz/corpus/"$name"/* "$run/corpus/"; fi
  args=(-max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -max_len=16384
        -print_final_stats=1 -artifact_prefix="$run/artifacts/")
  if [ -f "fuzz/dicts/$name.dict" ]; then args+=(-dict="fuzz/dicts/$name.dict"); fi
  echo "fuzz: $target for ${SECONDS_PER_TARGET}s ($(ls "$run/corpus" | wc -l) seed inputs)"
  ( status=0
    "$BUILD/fuzz/$target" "${args[@]}" "$run/corpus" >"$run/log" 2>&1 || status=$?
    echo "$status" >"$run/status" ) &
  pids+=($!)
done
wait "${pids[@]}"
for target in "${targets[@]}"; do
  run="$BUILD/run/$target"
  status=$(cat "$run/status")
  if [ "$status" -ne 0 ] || grep -qE 'ERROR: (Address|Leak|Undefined)Sanitizer|runtime error:' "$run/log" \
     || ls "$run/artifacts" | grep -q .; then
    echo "fuzz: $target FAILED (exit $status); last lines of $run/log:"
    tail -n 60 "$run/log"
    echo "fuzz: reproduce with: $BUILD/fuzz/$target $run/artifacts/<file>"
    failed+=("$target")
  else
    execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$run/log" | grep -oE '[0-9]+$' || echo '?')
    echo "fuzz: $target ok: $execs inputs, corpus $(ls "$run/corpus" | wc -l) files, no crash"
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${SECONDS_PER_TARGET}s each without a finding"
