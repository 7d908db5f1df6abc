#!/usr/bin/env bash
# The tests: ctest (math, schedules, the Gloo transport on 2-8 forked processes, the MPI
# transport under mpirun) and pytest (every op through the Python API on a pool of rank
# processes), twice: on the Gloo transport, then on the MPI transport (the pool and the main
# jobs under mpirun) with torch's default device poisoned to "meta", so any tensor made
# without an explicit device (library or test) fails loudly. Without MPI the second run
# stays on Gloo.
# GRIDWEAVE_CUDA=ON makes a missing nvcc/NCCL an error instead of a skipped build.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/ctest -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRIDWEAVE_CUDA="${GRIDWEAVE_CUDA:-AUTO}" \
  -DGRIDWEAVE_BUILD_TESTS=ON -DGRIDWEAVE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build/ctest -j2
ctest --test-dir build/ctest --output-on-failure -j2
python3 -m pytest -q tests/python --transport=gloo
if python3 -c "import sys, gridweave.launch as l; sys.exit(0 if l.mpi_installed() else 1)"; then
  python3 -m pytest -q tests/python --transport=mpi --default-device=meta
else
  python3 -m pytest -q tests/python --transport=gloo --default-device=meta
fi
