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
    ap.add_argument("--transport", default="gloo", choices=["gloo", "mpi"],
                    help="the CPU transport: gloo (ranks from torchrun) or mpi (ranks from mpirun)")
    return ap


def stem(name: str, transport: str) -> str:
    """Results of the MPI runs sit beside the Gloo ones: NAME.json and NAME_mpi.json."""
    return name if transport == "gloo" else f"{name}_{transport}"


def results_dir(args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def save(out: Path, stem: str, data, plot=None) -> None:
    """out/STEM.json, and out/STEM.png drawn by plot(data, path)."""
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    if plot is not None:
        plot(data, out / f"{stem}.png")


def run_ranks(script: str, n: int, port: int, out: Path, tag: str, *worker_args: str, transport: str = "gloo") -> dict:
    """n ranks of `script --worker ARGS --out FILE`, started by torchrun (gloo) or mpirun (mpi)."""
    import gridweave as gw

    path = Path(out) / f".{Path(script).stem}_{tag}.json"
    launcher = "mpirun" if transport == "mpi" else "torchrun"
    subprocess.run(gw.launch.command(launcher, n, port) + [script, "--worker", *worker_args, "--out", str(path)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": str(port)},
                   stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    data = json.loads(path.read_text())
    path.unlink()
    return data


def start_worker():
    """In a rank: one thread, torch's gloo process group for the benchmark's own timing
    collectives (its store is shared with gridweave). Under mpirun the ranks come from MPI
    and gw.init's backend "auto" is MPI. Returns (world size, rank, store)."""
    import torch
    import torch.distributed as dist

    import gridweave as gw

    torch.set_num_threads(1)
    if gw.launch.mpi_launched():  # mpirun: tell torch who is who, as MPI says
        rank, size = gw.launch.mpi_world()
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(size))
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(gw.launch.local_world_size() or size))
    dist.init_process_group("gloo")
    return dist.get_world_size(), dist.get_rank(), dist.distributed_c10d._get_default_store()


def interleaved_rounds(variants: dict, batches: list) -> tuple:
    """Each variant's step(batch) once a round, one variant after the other, every step between
    two barriers, so all variants share the machine alike: ({key: seconds}, {key: losses}), a
    round for each batch. variants: key -> (step, anything)."""
    import time

    import torch.distributed as dist

    times = {k: [] for k in variants}
    losses = {k: [] for k in variants}
    for batch in batches:
        for key, (step, _) in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            losses[key].append(step(batch))
            dist.barrier()
            times[key].append(time.perf_counter() - t0)
    return times, losses


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor parameters


def torch_held_bytes(model, opt) -> dict:
    """A torch model's holdings (gw.optim.held_bytes' accounting): its parameters' and gradients'
    local shards (DTensor's too: FSDP2, tensor parallelism), the optimizer's states; each storage once."""
    import torch

    seen = set()

    def size(ts):
        total = 0
        for t in ts:
            if t is None:
                continue
            t = _local(t)
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    params = list(model.parameters())
    return {"parameters": size(params), "gradients": size(p.grad for p in params),
            "optimizer": size(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
            "optimizer_buffers": 0}


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


def peak_growth_per_rank(build, step, drop, warmup: int) -> list:
    """Every rank's peak resident memory over its resident memory before build(), over the build
    and `warmup` calls of step(), glibc's mmap threshold fixed (freed tensors leave the resident
    set: calibrate.resident_accounting). First a throwaway build, step and drop(): what a process
    makes once per code path and shape (kernel scratch, the transport's buffers, the heap's first
    growth) is not the model's memory, and otherwise lands on whichever grid comes first (measured:
    the same grid grew 70 MiB a rank run first after another grid, 36-39 MiB run again); under the
    allocator settings of the measured build (outside them it left 17 MiB a rank more)."""
    import torch
    import torch.distributed as dist

    from gridweave import calibrate

    with calibrate.resident_accounting():
        build()
        step()
        drop()
        calibrate.restart_peak()
        base = calibrate.resident_bytes()
        build()
        for _ in range(warmup):
            step()
        mem = torch.tensor([float(calibrate.peak_resident_bytes() - base)], dtype=torch.float64)
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mem)
    return [float(v) for v in every]
