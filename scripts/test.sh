#!/usr/bin/env bash
# The README's test command: installs what is needed, builds, and runs every test.
#   1. Debian packages (scripts/setup.sh)
#   2. clang-format check of the sources
#   3. release build + the whole CTest suite (unit, MPI, reduced-size slow checks)
#   4. asan (address+undefined) build + the unit tests under it
#   5. tsan build + the in-process transport and overlap-pipeline tests under it
#   6. libFuzzer targets for a short bounded time (when present)
# Set SY_TEST_SKIP="asan tsan fuzz format" to skip stages locally; CI skips nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${SY_JOBS:-$(nproc)}
# Unity batches of the libraries' sources: about half the compile time of each build below
# (docs/ARCHITECTURE.md, Build). SY_UNITY_BUILD=OFF builds file by file.
export SY_UNITY_BUILD=${SY_UNITY_BUILD:-ON}
UNITY=-DSY_UNITY_BUILD=$SY_UNITY_BUILD
skip() { [[ " ${SY_TEST_SKIP:-} " == *" $1 "* ]]; }
stage() { echo; echo "=== $* (at ${SECONDS}s) ==="; }

bash scripts/setup.sh

if ! skip format; then
  stage "clang-format check"
  bash scripts/format.sh --check
fi

stage "release build + all tests"
cmake --preset release "$UNITY" >/dev/null
cmake --build --preset release -j "$JOBS"
ctest --preset release -j "$JOBS" --timeout 600

if ! skip asan; then
  stage "asan build + unit tests"
  cmake --preset asan "$UNITY" >/dev/null
  # Every unit test binary except those that run the `switchyard` executable (label cli: they
  # run in the release stage; the file parsers they reach are fuzzed under ASan below).
  cmake --build --preset asan -j "$JOBS" --target asan_tests
  # Also skipped: the planner's two whole-search tests (a minute of the stage under ASan, the
  # search code they walk is the smaller SearchTest cases' too; they run in the release stage).
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --preset asan -j "$JOBS" --timeout 600 -LE cli \
    -E 'SearchTest\.(FixedKeysAreTheFullSearchFiltered|EveryLayoutItEmitsTrainAccepts)$'
fi

if ! skip tsan && [ -d tests/comm ]; then
  stage "tsan build + in-process transport and overlap-pipeline tests"
  cmake --preset tsan "$UNITY" >/dev/null
  cmake --build --preset tsan -j "$JOBS" --target tsan_tests
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" ctest --preset tsan -j "$JOBS" --timeout 600
fi

if ! skip fuzz && [ -f fuzz/CMakeLists.txt ]; then
  stage "fuzzers (bounded)"
  bash scripts/fuzz.sh "${SY_FUZZ_SECONDS:-10}"
fi

echo
echo "=== all tests passed (${SECONDS}s) ==="
