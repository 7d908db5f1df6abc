"""Shared by the Python benchmarks: run a benchmark script's worker on n CPU ranks under
torchrun and collect what rank 0 wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_ranks(script: str, n: int, port: int, out: Path, tag: str, *worker_args: str) -> dict:
    """`python -m torch.distributed.run --nproc-per-node=n script --worker ARGS --out FILE`."""
    path = Path(out) / f".{Path(script).stem}_{tag}.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={port}",
                    script, "--worker", *worker_args, "--out", str(path)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    data = json.loads(path.read_text())
    path.unlink()
    return data
