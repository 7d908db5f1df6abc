#!/usr/bin/env bash
# The tests: ctest (math, schedules, the Gloo transport on 2-8 forked processes)
# and pytest (every op through the Python API on a pool of rank processes), twice: the
# second time with torch's default device poisoned to "meta", so any tensor made without
# an explicit device (library or test) fails loudly.
# GRIDWEAVE_CUDA=ON makes a missing nvcc/NCCL an error instead of a skipped build.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/ctest -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRIDWEAVE_CUDA="${GRIDWEAVE_CUDA:-AUTO}" \
  -DGRIDWEAVE_BUILD_TESTS=ON -DGRIDWEAVE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build/ctest -j2
ctest --test-dir build/ctest --output-on-failure -j2
python3 -m pytest -q tests/python
python3 -m pytest -q tests/python --default-device=meta
