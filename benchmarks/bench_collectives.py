"""gridweave vs torch.distributed (gloo), side by side in the same processes.

    python benchmarks/bench_collectives.py            # 2, 4 and 8 ranks, writes results/
    torchrun --nproc-per-node N benchmarks/bench_collectives.py --worker

Part 1: all_gather, reduce_scatter, all_reduce from 4 KiB to 64 MiB; each size runs
the two libraries alternately, `reps` times each, and keeps the median.
Part 2 (8 ranks): a segmented all-gather on 4 disjoint groups of 2 at once vs the same
four all-gathers one group after another.

    python benchmarks/bench_collectives.py --checks [--transport mpi]

The cost of each check level (gw.CheckLevel): the same ops on a grid at Detail (every
call's fingerprint all-gathered first) and one at Cheap, alternately, in the same processes;
writes results/check_levels[_mpi].json.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save, stem

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ["all_gather", "reduce_scatter", "all_reduce"]


def _reps(nbytes: int) -> tuple[int, int]:
    """(samples, ops per sample): a sample runs several ops back to back, so one
    scheduler hiccup on a shared 2-core machine does not decide a ratio."""
    inner = max(2, min(100, (16 << 20) // nbytes))
    samples = 15 if nbytes <= (4 << 20) else 7
    return samples, inner


def worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import gridweave as gw

    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    grid = gw.init(dp=n, store=dist.distributed_c10d._get_default_store(), prefix="bench")
    results = []

    def timed(fn, inner):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner

    for nbytes in SIZES:
        count = nbytes // 4
        x = torch.randn(count)
        chunk = torch.randn(max(1, count // n))
        gathered = torch.empty(chunk.numel() * n)
        for op in OPS:
            if op == "all_gather":  # nbytes = the gathered output
                ours = lambda: grid.all_gather(chunk, axis="dp", out=gathered)  # noqa: E731
                theirs = lambda: dist.all_gather_into_tensor(gathered, chunk)
            elif op == "reduce_scatter":  # nbytes = the input
                out = torch.empty(count // n)
                ours = lambda: grid.reduce_scatter(x, axis="dp", out=out)  # noqa: E731
                theirs = lambda: dist.reduce_scatter_tensor(out, x)  # noqa: E731
            else:
                ours = lambda: grid.all_reduce(x, axis="dp")
                theirs = lambda: dist.all_reduce(x)
            ours(), theirs()  # warm up (connections, allocations)
            tg, tt = [], []
            samples, inner = _reps(nbytes)
            for _ in range(samples):
                tg.append(timed(ours, inner))
                tt.append(timed(theirs, inner))
            results.append({"op": op, "ranks": n, "nbytes": nbytes, "gridweave_s": statistics.median(tg),
                            "torch_s": statistics.median(tt), "gridweave_min_s": min(tg), "torch_min_s": min(tt),
                            "samples": samples, "ops_per_sample": inner})

    if n == 8:  # segmented: 4 disjoint groups of 2 ranks
        g4 = gw.init(dp=4, tp=gw.Row(2), store=dist.distributed_c10d._get_default_store(), prefix="bench-seg",
                     placement="naive")
        for nbytes in SIZES:
            t = torch.randn(nbytes // 4 // 2)
            gathered2 = torch.empty(2 * t.numel())
            group = g4.coords["dp"]

            def segmented():
                g4.all_gather(t, axis="tp", out=gathered2)
                g4.barrier()

            def sequential():
                for k in range(4):
                    if k == group:
                        g4.all_gather(t, axis="tp", out=gathered2)
                    g4.barrier()

            segmented(), sequential()
            ts, tq = [], []
            samples, inner = _reps(nbytes)
            for _ in range(samples):
                ts.append(timed(segmented, inner))
                tq.append(timed(sequential, inner))
            results.append({"op": "segmented_all_gather", "ranks": n, "groups": 4, "nbytes": nbytes,
                            "segmented_s": statistics.median(ts), "sequential_s": statistics.median(tq),
                            "segmented_min_s": min(ts), "sequential_min_s": min(tq)})
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    gw.shutdown()
    dist.destroy_process_group()


CHECK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def checks_worker(out_path: str) -> None:
    import torch

    import gridweave as gw

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else gw.launch.mpi_world()[1]
    cheap = gw.init(dp=world, prefix="cheap", check=gw.CheckLevel.Cheap)
    n, store = cheap.world_size, cheap._torch_store[0]
    detail = gw.init(dp=n, prefix="detail", check=gw.CheckLevel.Detail, store=store,
                     rank=cheap.rank, world_size=n)
    results = []
    for nbytes in CHECK_SIZES:
        x = torch.randn(nbytes // 4)
        chunk = torch.randn(max(1, nbytes // 4 // n))
        gathered = torch.empty(chunk.numel() * n)
        for op in ("all_reduce", "all_gather"):
            def run(grid, op=op):
                if op == "all_reduce":
                    grid.all_reduce(x, axis="dp")
                else:
                    grid.all_gather(chunk, axis="dp", out=gathered)
            times = {"cheap": [], "detail": []}
            samples, inner = _reps(nbytes)
            for grid in (cheap, detail):
                run(grid)  # connect
            for _ in range(samples):
                for name, grid in (("cheap", cheap), ("detail", detail)):
                    grid.barrier()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        run(grid)
                    times[name].append((time.perf_counter() - t0) / inner)
            results.append({"op": op, "ranks": n, "nbytes": nbytes, "transport": cheap.backend,
                            "cheap_s": statistics.median(times["cheap"]),
                            "detail_s": statistics.median(times["detail"])})
    if cheap.rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    gw.shutdown()


def plot_checks(results: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in ("all_reduce", "all_gather"):
        for n in sorted({r["ranks"] for r in results}):
            rows = [r for r in results if r["op"] == op and r["ranks"] == n]
            ax.plot([r["nbytes"] for r in rows], [r["detail_s"] / r["cheap_s"] for r in rows], "o-",
                    label=f"{op}, {n} ranks")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set(xscale="log", title=f"CheckLevel.Detail / Cheap ({results[0]['transport']})", xlabel="bytes",
           ylabel="time ratio")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot(results: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, op in zip(axes, OPS):
        for n in sorted({r["ranks"] for r in results}):
            rows = [r for r in results if r["op"] == op and r["ranks"] == n]
            ax.plot([r["nbytes"] for r in rows], [r["gridweave_s"] / r["torch_s"] for r in rows], "o-",
                    label=f"{n} ranks")
        ax.axhline(1.05, color="r", ls="--", lw=1, label="goal 1.05")
        ax.set(xscale="log", title=f"{op}: gridweave / torch (gloo)", xlabel="bytes", ylabel="time ratio")
        ax.legend()
    seg = [r for r in results if r["op"] == "segmented_all_gather"]
    ax = axes[3]
    if not seg:
        ax.set_visible(False)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        return
    ax.plot([r["nbytes"] for r in seg], [r["segmented_s"] / r["sequential_s"] for r in seg], "o-", label="8 ranks")
    ax.axhline(0.5, color="r", ls="--", lw=1, label="goal 0.5")
    ax.set(xscale="log", title="segmented all-gather, 4 groups: at once / one by one", xlabel="bytes per group",
           ylabel="time ratio")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--checks", action="store_true", help="the cost of each check level (gw.CheckLevel)")
    args = ap.parse_args()
    if args.worker:
        (checks_worker if args.checks else worker)(args.out)
        return
    out = results_dir(args)
    if args.checks:
        results = []
        for n in [int(v) for v in args.ranks.split(",")]:
            results += run_ranks(__file__, n, 29519, out, f"checks{n}", "--checks", transport=args.transport)
        save(out, stem("check_levels", args.transport), results, plot_checks)
        for r in results:
            print(f"{r['op']:11s} n={r['ranks']} {r['nbytes']:>9d} B  detail/cheap {r['detail_s'] / r['cheap_s']:.3f} "
                  f"({r['detail_s'] * 1e3:.3f} vs {r['cheap_s'] * 1e3:.3f} ms)")
        return
    results = []
    for n in [int(v) for v in args.ranks.split(",")]:
        results += run_ranks(__file__, n, 29517, out, str(n))
    save(out, "collectives", results, plot)
    for r in results:
        if "torch_s" in r:
            print(f"{r['op']:15s} n={r['ranks']} {r['nbytes']:>9d} B  gridweave/torch median "
                  f"{r['gridweave_s'] / r['torch_s']:.3f}  min {r['gridweave_min_s'] / r['torch_min_s']:.3f}  "
                  f"({r['gridweave_s'] * 1e3:.3f} vs {r['torch_s'] * 1e3:.3f} ms)")
        else:
            print(f"{r['op']:15s} n={r['ranks']} {r['nbytes']:>9d} B  segmented/sequential median "
                  f"{r['segmented_s'] / r['sequential_s']:.3f}  min {r['segmented_min_s'] / r['sequential_min_s']:.3f}")


if __name__ == "__main__":
    main()
