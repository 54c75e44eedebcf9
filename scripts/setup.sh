#!/usr/bin/env bash
# Installs every Debian package switchyard needs. Idempotent; run as root on Debian 12.
# Skips apt entirely when everything is already installed (so repeated runs are fast).
set -euo pipefail

PACKAGES=(
  build-essential g++ cmake ninja-build pkg-config git
  libopenblas-dev            # GEMM (cblas_sgemm); linked explicitly, never the reference BLAS
  libdnnl-dev                # GEMM on AVX2 / AVX-512 CPUs (oneDNN, kernels by cpuid features)
  libopenmpi-dev openmpi-bin # MPI transport
  libgtest-dev libgmock-dev  # unit tests
  libbenchmark-dev           # Google Benchmark programs in bench/
  libcli11-dev               # command line
  nlohmann-json3-dev         # layer.json, metrics, bench --json
  libfmt-dev                 # formatting
  libsentencepiece-dev python3-sentencepiece  # tokenizer (docs/data.md); its Python twin for tests
  clang clang-format libclang-rt-14-dev  # libFuzzer targets, format check
  ccache                     # optional: cheap rebuilds across work trees (used when present)
  lld                        # optional: faster linking of the test binaries (used when present)
  fortunes fortunes-min fortune-mod   # default training corpus (text under /usr/share/games/fortunes)
  pybind11-dev python3-dev   # the Python module (docs/python.md)
  python3-numpy python3-torch python3-mpi4py python3-pytest  # its tests and example
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
