"""gridweave vs torch.distributed (gloo), side by side in the same processes.

    python benchmarks/bench_collectives.py            # 2, 4 and 8 ranks, writes results/
    torchrun --nproc-per-node N benchmarks/bench_collectives.py --worker

Part 1: all_gather, reduce_scatter, all_reduce from 4 KiB to 64 MiB; each size runs
the two libraries alternately, `reps` times each, and keeps the median.
Part 2 (8 ranks): a segmented all-gather on 4 disjoint groups of 2 at once vs the same
four all-gathers one group after another.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save

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
    args = ap.parse_args()
    if args.worker:
        worker(args.out)
        return
    out = results_dir(args)
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
