"""Shared by the Python benchmarks: the command line every script has, running a script's
worker on n CPU ranks under torchrun and collecting what rank 0 wrote, and saving results."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def bench_parser(script: str, parts=None) -> argparse.ArgumentParser:
    """--worker (a flag, or which of `parts` this rank process runs) and --out (default:
    results/ beside the script); each script adds its own options."""
    ap = argparse.ArgumentParser()
    if parts:
        ap.add_argument("--worker", choices=list(parts))
    else:
        ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=str(Path(script).parent / "results"))
    return ap


def results_dir(args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def save(out: Path, stem: str, data, plot=None) -> None:
    """out/STEM.json, and out/STEM.png drawn by plot(data, path)."""
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    if plot is not None:
        plot(data, out / f"{stem}.png")


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
