"""One transformer layer, forward + backward, per tensor-parallel mode on CPU ranks.

    python benchmarks/bench_layers.py        # all parts; writes results/layers.json and .png

timing, 8 ranks: gridweave 1-D vs PyTorch DTensor (ColwiseParallel / RowwiseParallel on
  the same layer and sizes) vs gridweave 3-D (2x2x2), overlap off and on;
timing, 4 ranks: gridweave 1-D vs 2-D (2x2);
  each: median step time (alternating rounds), per-rank bytes sent (the engine's
  counters), per-rank parameter bytes and activation bytes saved for backward.
scaling: per-rank bytes of one step at a fixed problem size for P = 2, 4, 8 (1-D),
  4, 9 (2-D), 8, 27 (3-D), against O(1) for 1-D and O(P^-2/3) for 3-D (Bian et al. §3.1.2).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save, saved_bytes, start_worker, stem

TIMING = dict(hidden=256, heads=8, ffn=1024, batch=8, seq=64)
SCALING = dict(hidden=72, heads=24, ffn=288, batch=36, seq=4)


def _sent(grid):
    return sum(v["sent_intra"]["bytes"] + v["sent_inter"]["bytes"] for v in grid.stats().values())


def _dtensor_layer(dense, heads, n):
    """The same layer under torch's Megatron-style plan: qkv/fc1 colwise, proj/fc2 rowwise."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import gridweave as gw
    from gridweave.sharding import group_order

    class Local(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln1, self.qkv, self.proj, self.ln2, self.fc1, self.fc2 = d.ln1, d.qkv, d.proj, d.ln2, d.fc1, d.fc2

        def forward(self, x):
            x = x + self.proj(gw.nn.attention(self.qkv(self.ln1(x)), heads // n, True))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    import copy

    d = copy.deepcopy(dense)
    order = group_order(d.arch.qkv_widths(d.qkv.in_features, heads), n)
    with torch.no_grad():  # heads grouped per rank, as gridweave does, so local attention is exact
        d.qkv.weight.copy_(d.qkv.weight[order])
        d.qkv.bias.copy_(d.qkv.bias[order])
    mesh = init_device_mesh("cpu", (n,))
    return parallelize_module(Local(d), mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                               "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def worker(part: str, out_path: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import gridweave as gw

    n, rank, store = start_worker()
    cfg = TIMING if part == "timing" else SCALING
    torch.manual_seed(0)
    dense = gw.nn.DenseTransformerLayer(cfg["hidden"], cfg["heads"], cfg["ffn"])
    x_full = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"])
    candidates = {}
    cube = round(n ** (1 / 3)) ** 3 == n
    square = round(n ** 0.5) ** 2 == n
    grids = {"1d": lambda: gw.init(tp=gw.Row(n), store=store, prefix=f"b-{part}-1d"),
             "2d": lambda: gw.init(tp=gw.Square(round(n ** 0.5)), store=store, prefix=f"b-{part}-2d"),
             "3d": lambda: gw.init(tp=gw.Cube(round(n ** (1 / 3))), store=store, prefix=f"b-{part}-3d")}
    modes = ["1d"] + (["2d"] if square and n > 1 and (part == "scaling" or n == 4) else []) + \
            (["3d"] if cube and n > 1 and (part == "scaling" or n == 8) else [])
    if part == "scaling":
        modes = [m for m in modes if (m == "1d" and n in (2, 4, 8)) or (m == "2d" and n in (4, 9))
                 or (m == "3d" and n in (8, 27))]
    for mode in modes:
        grid = grids[mode]()
        layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=mode)
        candidates[f"gridweave-{mode}"] = (grid, layer, gw.scatter(x_full, layer.input_layout, grid))
        if mode == "3d" and part == "timing":
            layer_o = gw.nn.TransformerLayer.from_dense(dense, grid, mode=mode, overlap=True)
            candidates["gridweave-3d-overlap"] = (grid, layer_o, gw.scatter(x_full, layer.input_layout, grid))
    if part == "timing" and n == 8:
        candidates["dtensor-1d"] = (None, _dtensor_layer(dense, cfg["heads"], n), x_full.clone())

    results = {}

    def step(layer, x):
        x = x.detach().requires_grad_()
        y, act = saved_bytes(lambda: layer(x), list(layer.parameters()))
        y.sum().backward()
        return act

    for name, (grid, layer, x) in candidates.items():  # warm-up, bytes and memory of one step
        if grid is not None:
            grid.reset_stats()
        act = step(layer, x)
        params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                     for p in layer.parameters())
        results[name] = {"bytes_sent": _sent(grid) if grid is not None else None, "activation_bytes": act,
                         "param_bytes": params, "times": []}
    if part == "timing":
        for _ in range(rounds):
            for name, (grid, layer, x) in candidates.items():
                dist.barrier()
                t0 = time.perf_counter()
                step(layer, x)
                results[name]["times"].append(time.perf_counter() - t0)
    for r in results.values():
        r["step_s"] = statistics.median(r["times"]) if r["times"] else None
        del r["times"]
    if rank == 0:
        Path(out_path).write_text(json.dumps({"part": part, "ranks": n, "config": cfg, "results": results},
                                             indent=1))
    gw.shutdown()
    dist.destroy_process_group()


def run(part: str, n: int, out: Path, rounds: int, transport: str) -> dict:
    return run_ranks(__file__, n, 29541, out, f"{part}_{n}", part, "--rounds", str(rounds), transport=transport)


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, runs, title in ((axes[0], [r for r in data["timing"] if r["ranks"] == 8], "8 ranks"),
                            (axes[1], [r for r in data["timing"] if r["ranks"] == 4], "4 ranks")):
        res = runs[0]["results"]
        names = list(res)
        ax.bar(names, [res[k]["step_s"] * 1e3 for k in names])
        ax.set(title=f"layer fwd+bwd step time, {title}", ylabel="ms")
        ax.tick_params(axis="x", rotation=20)
    ax = axes[2]
    for mode, marker in (("1d", "o-"), ("2d", "s-"), ("3d", "^-")):
        pts = sorted((r["ranks"], r["results"][f"gridweave-{mode}"]["bytes_sent"]) for r in data["scaling"]
                     if f"gridweave-{mode}" in r["results"])
        if pts:
            ax.plot([p for p, _ in pts], [b for _, b in pts], marker, label=f"gridweave {mode}")
    pts3 = sorted((r["ranks"], r["results"]["gridweave-3d"]["bytes_sent"]) for r in data["scaling"]
                  if "gridweave-3d" in r["results"])
    if pts3:
        p0, b0 = pts3[0]
        xs = [8, 27, 64, 125]
        cube = [round(x ** (1 / 3)) for x in xs]
        q0 = round(p0 ** (1 / 3))
        ax.plot(xs, [b0 * ((q - 1) / q ** 3) / ((q0 - 1) / q0 ** 3) for q in cube], "k:", lw=1,
                label="3-D model (p-1)/p^3 through P=8")
        ax.plot(xs, [b0 * (x / p0) ** (-2 / 3) for x in xs], "k--", lw=1, label="P^-2/3 through P=8")
    ax.set(xscale="log", yscale="log", title="per-rank bytes of one step vs P (fixed size)", xlabel="P",
           ylabel="bytes sent per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = bench_parser(__file__, ("timing", "scaling"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from results/layers.json")
    args = ap.parse_args()
    if args.plot_only:
        out = Path(args.out)
        plot(json.loads((out / "layers.json").read_text()), out / "layers.png")
        return
    if args.worker:
        worker(args.worker, args.out, args.rounds)
        return
    out = results_dir(args)
    data = {"timing": [run("timing", n, out, args.rounds, args.transport) for n in (8, 4)],
            "scaling": [run("scaling", n, out, 1, args.transport) for n in (2, 4, 8, 9, 27)]}
    save(out, stem("layers", args.transport), data, plot)
    for r in data["timing"]:
        print(f"-- timing, {r['ranks']} ranks, {r['config']}")
        for k, v in r["results"].items():
            print(f"  {k:22s} step {v['step_s'] * 1e3:8.2f} ms  sent/rank {v['bytes_sent']}  "
                  f"params/rank {v['param_bytes']}  activations/rank {v['activation_bytes']}")
    for r in data["scaling"]:
        print(f"-- scaling, P={r['ranks']}: " + ", ".join(f"{k} {v['bytes_sent']} B" for k, v in r["results"].items()))


if __name__ == "__main__":
    main()
