"""gw.plan against this machine: calibrate, then predict and measure our own 8-rank benchmarks.

    python benchmarks/bench_plan.py     # writes results/plan_local.json and .png

One torchrun job of 8 CPU ranks (as bench_collectives and bench_layers run): the ranks first
calibrate (gridweave.calibrate.measure: alpha, beta, GEMM rate, element-wise bandwidth and
per-op cost, all ranks at once), then time the world's ring collectives over a range of
sizes and one transformer layer (bench_layers' sizes) forward + backward under 1-D and 3-D
tensor parallelism. The parent predicts each measurement from the calibrated preset alone
(plan.collective_time, plan.predict) and reports predicted / measured.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench_layers import TIMING
from launch import bench_parser, results_dir, run_ranks, save, start_worker

SIZES = [1 << 16, 1 << 18, 1 << 20, 1 << 22]  # bytes of the full buffer
OPS = ("all_gather", "reduce_scatter", "all_reduce")
LAYER_GRIDS = {"1d": "row:8", "3d": "cube:2"}


def worker(out_path: str, reps: int) -> None:
    import torch
    import torch.distributed as dist

    import gridweave as gw
    from gridweave import calibrate

    n, rank, store = start_worker()
    world = gw.init(dp=n, store=store, prefix="plan-world")
    preset = calibrate.measure(world)
    measured = {}
    for op in OPS:
        for nbytes in SIZES:
            full = torch.ones(nbytes // 4)
            part = full[: full.numel() // n].clone()
            fn = {"all_gather": lambda: world.all_gather(part, "dp"),
                  "reduce_scatter": lambda: world.reduce_scatter(full, "dp"),
                  "all_reduce": lambda: world.all_reduce(full.clone(), "dp")}[op]
            fn()
            ts = []
            for _ in range(reps):
                world.barrier()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            measured[f"{op}:{nbytes}"] = statistics.median(ts)

    torch.manual_seed(0)
    cfg = TIMING
    dense = gw.nn.DenseTransformerLayer(cfg["hidden"], cfg["heads"], cfg["ffn"])
    x_full = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"])
    layers = {}
    for mode, tp in (("1d", gw.Row(n)), ("3d", gw.Cube(round(n ** (1 / 3))))):
        grid = gw.init(tp=tp, store=store, prefix=f"plan-{mode}")
        layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=mode)
        layers[mode] = (layer, gw.scatter(x_full, layer.input_layout, grid), [])

    def step(layer, x):
        x = x.detach().requires_grad_()
        layer(x).sum().backward()

    for layer, x, _ in layers.values():
        step(layer, x)
    for _ in range(reps):  # alternating rounds, so both modes see the same machine
        for layer, x, ts in layers.values():
            dist.barrier()
            t0 = time.perf_counter()
            step(layer, x)
            ts.append(time.perf_counter() - t0)
    for mode, (_, _, ts) in layers.items():
        measured[f"layer:{mode}"] = statistics.median(ts)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"ranks": n, "preset": preset, "measured": measured,
                                              "layer_config": cfg}, indent=1))
    gw.shutdown()
    dist.destroy_process_group()


def predictions(data: dict) -> dict:
    """Each measurement's prediction from the calibrated preset alone."""
    from gridweave import plan

    preset = data["preset"]
    cluster = plan.Cluster(**{k: v for k, v in preset.items() if k in plan.Cluster.__dataclass_fields__})
    n = data["ranks"]
    link = (cluster.intra_alpha_s, cluster.intra_bandwidth_Bps)
    out = {}
    for key in data["measured"]:
        kind, arg = key.split(":")
        if kind == "layer":
            cfg = data["layer_config"]
            model = plan.Model(hidden=cfg["hidden"], layers=1, heads=cfg["heads"], seq=cfg["seq"],
                               batch=cfg["batch"], vocab=0, bytes_per_value=4)
            tp = gw.modes.parse(LAYER_GRIDS[arg])
            out[key] = plan.predict(model, plan.GridShape(tp=tp), cluster)["step_time_s"]
        else:
            out[key] = cluster.launch_s + plan.collective_time(kind, n, int(arg), link, cluster)
    return out


def plot(rows: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for kind, marker in (("all_gather", "o"), ("reduce_scatter", "s"), ("all_reduce", "^"), ("layer", "*")):
        pts = [r for r in rows if r["key"].startswith(kind)]
        ax.scatter([r["measured_s"] * 1e3 for r in pts], [r["predicted_s"] * 1e3 for r in pts], marker=marker,
                   s=90 if kind == "layer" else 40, label=kind if kind != "layer" else "layer fwd+bwd (1-D, 3-D)")
    for r in rows:
        if r["key"].startswith("layer"):
            ax.annotate(r["key"].split(":")[1], (r["measured_s"] * 1e3, r["predicted_s"] * 1e3), fontsize=8)
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.5
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="gray", alpha=0.2, label="±25%")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured (ms)",
           ylabel="predicted by gw.plan from the calibrated preset (ms)",
           title="gw.plan vs our 8-rank CPU benchmarks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.reps)
        return
    out = results_dir(args)
    data = run_ranks(__file__, 8, 29571, out, "8", "--reps", str(args.reps))
    pred = predictions(data)
    rows = [{"key": k, "measured_s": v, "predicted_s": pred[k], "ratio": pred[k] / v}
            for k, v in data["measured"].items()]
    data["rows"] = rows
    save(out, "plan_local", data, lambda d, png: plot(d["rows"], png))
    for r in rows:
        print(f"{r['key']:24s} measured {r['measured_s'] * 1e3:9.3f} ms  predicted {r['predicted_s'] * 1e3:9.3f} ms"
              f"  ratio {r['ratio']:.2f}")
    inside = sum(0.75 <= r["ratio"] <= 1.25 for r in rows)
    print(f"{inside}/{len(rows)} predictions within 25%")


if __name__ == "__main__":
    main()
