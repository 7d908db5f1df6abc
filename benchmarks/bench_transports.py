"""gridweave on MPI vs mpi4py on the same OpenMPI vs gridweave on Gloo, side by side in the
same processes (issue 14); and OpenMPI's own nonblocking calls polled as the engine polls them.

    python benchmarks/bench_transports.py             # 2, 4 and 8 ranks under mpirun, writes results/
    mpirun -np N python benchmarks/bench_transports.py --worker --out FILE

all_gather, reduce_scatter, all_reduce, broadcast and all_to_all from 4 KiB to 64 MiB
(nccl-tests' convention: the size is the whole buffer, n chunks for the gathers and
all_to_all), and send/recv latency (ping-pong of ranks 0 and 1, one way). Each sample
starts after a barrier and takes the slowest rank's time; the four run alternately and
keep the best sample. mpi4py initialises MPI first: gridweave keeps that MPI.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from launch import bench_parser, results_dir, save

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send_recv"]
IMPLS = ["gridweave_mpi", "mpi4py", "gridweave_gloo", "mpi4py_nonblocking"]
GOAL_RANGE = (64 << 10, 4 << 20)  # the goal: geomean over these sizes <= 1.1x OpenMPI
GOAL_OPS = ["all_gather", "reduce_scatter", "all_reduce"]


def _samples(nbytes: int) -> int:
    return 12 if nbytes <= (1 << 20) else 5 if nbytes <= (16 << 20) else 3


def _ops(n: int, rank: int, nbytes: int, g_mpi, g_gloo, comm, MPI):
    """{op: {impl: thunk}} on preallocated float32 buffers."""
    import torch

    e = nbytes // 4
    chunk = e // n
    cpu = torch.device("cpu")
    full = torch.ones(chunk * n, device=cpu)
    part = torch.ones(chunk, device=cpu)
    out_full = torch.empty(chunk * n, device=cpu)
    buf = torch.ones(e, device=cpu)
    fn, pn, on, bn = full.numpy(), part.numpy(), out_full.numpy(), buf.numpy()
    peer = 1 - rank if rank < 2 else None

    def ping(send, recv):
        def run():
            if peer is None:
                return
            if rank == 0:
                send()
                recv()
            else:
                recv()
                send()
        return run

    def gw(g):
        return {
            "all_gather": lambda: g.all_gather(part, "dp", out=out_full),
            "reduce_scatter": lambda: g.reduce_scatter(full, "dp", out=part),
            "all_reduce": lambda: g.all_reduce(buf, "dp"),
            "broadcast": lambda: g.broadcast(buf, "dp", src=0),
            "all_to_all": lambda: g.all_to_all(full, "dp"),
            "send_recv": ping(lambda: g.send(buf, peer, "dp"), lambda: g.recv(buf, peer, "dp")),
        }

    # OpenMPI's nonblocking calls polled as the engine polls them (mpi/mpi_communicator.cpp
    # poll_for: spin where each rank has a processor, else yield between tests): the floor of a
    # transport that may not block past a deadline.
    cpus = os.sched_getaffinity(0)
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", n))
    idle = (lambda: None) if len(cpus) == 1 or local <= len(cpus) else os.sched_yield

    def polled(start):
        def run():
            req = start()
            while not req.Test():
                idle()
        return run

    nonblocking = {
        "all_gather": polled(lambda: comm.Iallgather(pn, on)),
        "reduce_scatter": polled(lambda: comm.Ireduce_scatter_block(fn, pn, op=MPI.SUM)),
        "all_reduce": polled(lambda: comm.Iallreduce(MPI.IN_PLACE, bn, op=MPI.SUM)),
        "broadcast": polled(lambda: comm.Ibcast(bn, root=0)),
        "all_to_all": polled(lambda: comm.Ialltoall(fn, on)),
        "send_recv": ping(polled(lambda: comm.Isend(bn, dest=peer)), polled(lambda: comm.Irecv(bn, source=peer))),
    }
    mine = {
        "all_gather": lambda: comm.Allgather(pn, on),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(fn, pn, op=MPI.SUM),
        "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, bn, op=MPI.SUM),
        "broadcast": lambda: comm.Bcast(bn, root=0),
        "all_to_all": lambda: comm.Alltoall(fn, on),
        "send_recv": ping(lambda: comm.Send(bn, dest=peer), lambda: comm.Recv(bn, source=peer)),
    }
    ours_mpi, ours_gloo = gw(g_mpi), gw(g_gloo)
    return {op: {"gridweave_mpi": ours_mpi[op], "mpi4py": mine[op], "gridweave_gloo": ours_gloo[op],
                 "mpi4py_nonblocking": nonblocking[op]} for op in OPS}


def worker(out_path: str, port: int) -> None:
    from mpi4py import MPI  # initialises MPI (thread multiple) before gridweave sees it

    import torch
    from datetime import timedelta
    from torch.distributed import TCPStore

    import gridweave as gw

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    store = TCPStore("127.0.0.1", port, n, is_master=rank == 0, timeout=timedelta(seconds=120))
    g_gloo = gw.init(dp=n, backend="gloo", rank=rank, world_size=n, store=store, prefix="gloo", timeout=120)
    g_mpi = gw.init(dp=n, backend="mpi", timeout=120)
    rows = []
    for nbytes in SIZES:
        ops = _ops(n, rank, nbytes, g_mpi, g_gloo, comm, MPI)
        for op in OPS:
            best = {}
            for impl in IMPLS:  # warm-up: connect, touch the buffers
                ops[op][impl]()
            for s in range(_samples(nbytes)):
                order = IMPLS[s % len(IMPLS):] + IMPLS[:s % len(IMPLS)]
                for impl in order:
                    comm.Barrier()
                    t0 = time.perf_counter()
                    ops[op][impl]()
                    dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                    best[impl] = min(best.get(impl, math.inf), dt / (2 if op == "send_recv" else 1))
            rows.append({"ranks": n, "op": op, "nbytes": nbytes, **{f"{k}_s": v for k, v in best.items()}})
            if rank == 0:
                print(f"{n} ranks {op:>14} {nbytes:>9} B  " +
                      "  ".join(f"{k} {v * 1e3:8.3f} ms" for k, v in best.items()), flush=True)
    if rank == 0:
        import json

        Path(out_path).write_text(json.dumps(rows))
    g_mpi.shutdown()
    g_gloo.shutdown()


def _geomean(ratios) -> float:
    ratios = list(ratios)
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def summary(rows: list) -> dict:
    """Per rank count: geomean of gridweave-MPI / mpi4py over the goal's ops and sizes (and
    over everything); the same for OpenMPI's own nonblocking calls, polled (what a transport
    that may not block can reach); the cases where gridweave-MPI is slower than gridweave-Gloo."""
    out = {}
    for n in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == n]
        goal = [r for r in mine if r["op"] in GOAL_OPS and GOAL_RANGE[0] <= r["nbytes"] <= GOAL_RANGE[1]]
        out[str(n)] = {
            "geomean_mpi_over_openmpi_goal_range": _geomean(r["gridweave_mpi_s"] / r["mpi4py_s"] for r in goal),
            "geomean_nonblocking_openmpi_over_openmpi_goal_range":
                _geomean(r["mpi4py_nonblocking_s"] / r["mpi4py_s"] for r in goal),
            "geomean_mpi_over_nonblocking_openmpi_goal_range":
                _geomean(r["gridweave_mpi_s"] / r["mpi4py_nonblocking_s"] for r in goal),
            "geomean_mpi_over_openmpi_all": _geomean(r["gridweave_mpi_s"] / r["mpi4py_s"] for r in mine),
            "geomean_gloo_over_mpi_all": _geomean(r["gridweave_gloo_s"] / r["gridweave_mpi_s"] for r in mine),
            "slower_than_gloo": [f"{r['op']} {r['nbytes']}" for r in mine if r["gridweave_mpi_s"] > r["gridweave_gloo_s"]],
        }
    return out


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    for ax, op in zip(axes.flat, OPS):
        for n in sorted({r["ranks"] for r in rows}):
            mine = [r for r in rows if r["op"] == op and r["ranks"] == n]
            x = [r["nbytes"] for r in mine]
            ax.plot(x, [r["gridweave_mpi_s"] / r["mpi4py_s"] for r in mine], "o-", label=f"gridweave-MPI, {n} ranks")
            ax.plot(x, [r["gridweave_gloo_s"] / r["mpi4py_s"] for r in mine], "x--", label=f"gridweave-Gloo, {n} ranks")
            ax.plot(x, [r["mpi4py_nonblocking_s"] / r["mpi4py_s"] for r in mine], ":", label=f"OpenMPI nonblocking, {n} ranks")
        ax.axhline(1.1, color="r", lw=1, label="goal 1.1")
        ax.set(xscale="log", yscale="log", title=f"{op}: time / mpi4py (OpenMPI)", xlabel="bytes",
               ylabel="time ratio")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--port", type=int, default=29671)
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.port)
        return
    import json
    import subprocess

    import gridweave as gw

    out = results_dir(args)
    rows = []
    for n in (int(v) for v in args.ranks.split(",")):
        path = out / f".transports_{n}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(gw.launch.mpirun_command(n) + [sys.executable, __file__, "--worker", "--out", str(path),
                                                      "--port", str(args.port + n)],
                       check=True, env=env, stdin=subprocess.DEVNULL)
        rows += json.loads(path.read_text())
        path.unlink()
    data = {"rows": rows, "summary": summary(rows)}
    save(out, "transports", data, plot)
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
