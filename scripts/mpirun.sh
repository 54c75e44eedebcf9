#!/usr/bin/env bash
# Launch a switchyard program under OpenMPI with the flags this kind of machine needs (docs/
# PERFORMANCE.md, "The machine and the limits figures are compared to"): running as root, more
# ranks than cores, shared-memory transport, and no core binding (ranks run progress threads and
# BLAS threads of their own).
#
#   scripts/mpirun.sh -np 4 build/release/src/cli/switchyard bench comm --transport mpi --op alltoall
#   scripts/mpirun.sh -np 2 build/release/tests/comm/comm_mpi_test
#
# Extra mpirun flags may precede the program (they are passed through unchanged).
set -euo pipefail
if ! command -v mpirun >/dev/null; then
  echo "scripts/mpirun.sh: mpirun not found (install openmpi-bin: bash scripts/setup.sh)" >&2
  exit 127
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One BLAS/OpenMP thread per rank unless the caller says otherwise.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec mpirun --oversubscribe --bind-to none --mca btl self,vader \
  -x OPENBLAS_NUM_THREADS -x OMP_NUM_THREADS "$@"
