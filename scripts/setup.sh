#!/usr/bin/env bash
# Installs everything gridweave needs on a fresh Debian machine (apt and pip) and
# builds + installs the package. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
# fortunes: a real English text corpus for the main job (byte-level tokens).
# OpenMPI: the MPI transport (mpi/) is built and tested when it is present.
# iproute2: the emulated cluster of the tests (scripts/cluster.sh: ip netns, tc).
say() { echo "gridweave setup: $*"; }
say "system packages (apt: Gloo, Google Test/Benchmark, OpenMPI, the fortunes corpus, iproute2)"
if ! dpkg -s libgloo-dev libgtest-dev libbenchmark-dev fortunes openmpi-bin libopenmpi-dev iproute2 >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq libgloo-dev libgtest-dev libbenchmark-dev cmake fortunes openmpi-bin libopenmpi-dev \
    iproute2 >/dev/null
fi
PIP="python3 -m pip install -q --disable-pip-version-check"
# The CPU wheel of torch first, so nothing later pulls a CUDA build.
say "Python packages (pip: torch 2.13.0 CPU, build tools, tokenizers, transformers, torchao, loggers, docs)"
python3 -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP numpy "scikit-build-core>=0.10" "pybind11>=2.12" ninja pytest pytest-timeout matplotlib tqdm mpi4py \
  safetensors tokenizers tomli-w transformers datasets tensorboard wandb "mkdocs==1.6.1" "mkdocstrings-python>=2" \
  torchao==0.18.0
# torchao: float8's casts and scales (the float8 extra, precision fp8); transformers: the optional hf extra, which the tests check against; datasets: JSON Lines, Parquet and
# Arrow data (the data extra); tensorboard, wandb: the loggers (the log extra); mkdocs: the documentation site
# NCCL headers and library, so the NCCL transport compiles wherever nvcc is found.
if command -v nvcc >/dev/null 2>&1; then $PIP nvidia-nccl-cu13; fi
say "building gridweave: the C++ engine (Gloo, MPI$(command -v nvcc >/dev/null 2>&1 && echo ', CUDA/NCCL')) and its" \
  "Python binding, then installing the package (a few minutes on 2 cores)"
$PIP --no-build-isolation .
say "done: python3 -m gridweave.cli train runs the main job; bash scripts/test.sh the tests"
