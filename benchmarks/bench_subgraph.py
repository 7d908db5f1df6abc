"""Sub-graph parallelism (SUPER) on CPU ranks: one transformer layer training step.

    python benchmarks/bench_subgraph.py      # writes results/subgraph.json and .png

step: D&SP (g sub-grids) vs pure data parallelism on 4 and 8 ranks, small batch (one
  sample per rank) and many heads; also the two slice/concat methods (all-to-all vs
  all-gather-and-discard) with the common projections.
bytes: intra- and inter-node bytes of a D&SP step on 8 ranks emulating 4 nodes of 2,
  naive vs topology placement.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save, start_worker

CFG = dict(hidden=256, heads=32, seq=64)


def worker(out_path, rounds):
    import torch
    import torch.distributed as dist

    import gridweave as gw

    n, rank, store = start_worker()
    torch.manual_seed(0)
    H, heads, S = CFG["hidden"], CFG["heads"], CFG["seq"]
    dense = gw.nn.DenseTransformerLayer(H, heads)
    x_full = torch.randn(n, S, H)  # one sample per rank
    runs = {}
    grid = gw.init(dp=n, store=store, prefix="sg-dp")
    runs["dp"] = (grid, gw.nn.TransformerLayer.from_dense(dense, grid, mode="sp"))
    for g in (2, 4, 8):
        if g > n:
            continue
        grid = gw.init(dp=n // g, tp=gw.SubGraph(g), store=store, prefix=f"sg-dsp{g}")
        runs[f"dsp-g{g}"] = (grid, gw.nn.TransformerLayer.from_dense(dense, grid, mode="dsp"))
        if g == 2:
            for method in ("all_to_all", "all_gather"):
                runs[f"dsp-g{g}-common-{method}"] = (grid, gw.nn.TransformerLayer.from_dense(
                    dense, grid, mode="dsp", projection="common", method=method))
    result = {"ranks": n, "config": {**CFG, "batch": n}, "step_s": {}, "bytes": {}}

    def step(grid, layer, x):
        layer.zero_grad()
        y = layer(x)
        axes = ("dp", "sg")
        gw.nn.global_token_mean(y.pow(2).sum(), y.shape[0] * y.shape[1], grid, axes).backward()
        gw.reduce_gradients(layer, grid)

    inputs = {k: gw.scatter(x_full, layer.input_layout, grid) for k, (grid, layer) in runs.items()}
    for k, (grid, layer) in runs.items():
        step(grid, layer, inputs[k])
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, (grid, layer) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(grid, layer, inputs[k])
            times[k].append(time.perf_counter() - t0)
    result["step_s"] = {k: statistics.median(v) for k, v in times.items()}
    if n == 8:  # naive vs topology traffic, 4 emulated nodes of 2 ranks, g = 2
        for placement in ("naive", "topology"):
            grid = gw.init(dp=4, tp=gw.SubGraph(2), store=store, prefix=f"sg-{placement}", placement=placement,
                           ranks_per_node=2)
            layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode="dsp")
            x = gw.scatter(x_full, layer.input_layout, grid)
            step(grid, layer, x)
            grid.reset_stats()
            step(grid, layer, x)
            sg = grid.stats()["sg"]
            t = torch.tensor([sg["sent_intra"]["bytes"], sg["sent_inter"]["bytes"]], dtype=torch.float64)
            dist.all_reduce(t)
            result["bytes"][placement] = {"split_join_intra": int(t[0]), "split_join_inter": int(t[1])}
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    gw.shutdown()
    dist.destroy_process_group()


def run(n, out, rounds):
    return run_ranks(__file__, n, 29553, out, str(n), "--rounds", str(rounds))


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, r in zip(axes[:2], data["runs"]):
        names = list(r["step_s"])
        ax.bar(names, [r["step_s"][k] * 1e3 for k in names])
        ax.set(title=f"layer training step, {r['ranks']} ranks, batch {r['ranks']}, {CFG['heads']} heads",
               ylabel="ms")
        ax.tick_params(axis="x", rotation=25, labelsize=8)
    b = [r for r in data["runs"] if r["bytes"]][0]["bytes"]
    ax = axes[2]
    names = list(b)
    ax.bar([x - 0.2 for x in range(len(names))], [b[k]["split_join_intra"] for k in names], 0.4, label="intra-node")
    ax.bar([x + 0.2 for x in range(len(names))], [b[k]["split_join_inter"] for k in names], 0.4, label="inter-node")
    ax.set_xticks(range(len(names)), names)
    ax.set(title="bytes on sg per step (8 ranks, 4 nodes of 2, g=2)", ylabel="bytes, all ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = bench_parser(__file__)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.rounds)
        return
    out = results_dir(args)
    data = {"runs": [run(n, out, args.rounds) for n in (4, 8)]}
    save(out, "subgraph", data, plot)
    for r in data["runs"]:
        base = r["step_s"]["dp"]
        print(f"-- {r['ranks']} ranks: " + ", ".join(f"{k} {v * 1e3:.1f} ms (DP/this {base / v:.2f}x)"
                                                     for k, v in r["step_s"].items()))
        if r["bytes"]:
            print("   bytes on sg per step:", r["bytes"])


if __name__ == "__main__":
    main()
