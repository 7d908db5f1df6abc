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


def start_worker():
    """In a torchrun worker: one thread, torch's gloo process group (its store is shared
    with gridweave). Returns (world size, rank, store)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_world_size(), dist.get_rank(), dist.distributed_c10d._get_default_store()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor parameters


def saved_bytes(fn, exclude=()):
    """(fn(), bytes of the distinct tensors autograd saves for backward in it, except `exclude`)."""
    import torch

    skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        s = _local(t).untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())
