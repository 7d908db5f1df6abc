"""gw.plan's predicted scaling of a 175B model (GPT-3: 96 layers, hidden 12288, 96 heads,
sequence 2048, batch 1536) from 8 to 16384 GPUs, in each tensor-parallel mode.

    python benchmarks/plan_scaling.py [--cluster a100-ib]   # results/plan_scaling_175b.json, .png

For each GPU count and mode the best grid of that mode (dp x pp x tp x sp, placement) that
fits in memory; "none" is pipeline x data parallelism only. A prediction, not a measurement.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gridweave import plan
from gridweave.models import ModelConfig

MODEL = plan.Model(ModelConfig("gpt", 51200, hidden=12288, heads=96, layers=96, seq=2048), batch=1536)
MODES = ("none", "row", "square", "cube", "subgraph")


def best_per_mode(n: int, cluster: plan.Cluster) -> dict:
    out = {}
    for g in plan.enumerate_grids(n, MODEL, placements=("topology",)):
        try:
            r = plan.best_microbatching(MODEL, g, cluster, recompute=True)
        except plan.GridError:
            continue
        if r["memory_bytes"] > cluster.memory_bytes:
            continue
        kind = g.tp.keyword
        if kind not in out or r["step_time_s"] < out[kind]["step_time_s"]:
            out[kind] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="a100-ib")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    cluster = plan.load_cluster(args.cluster)
    counts = [2 ** k for k in range(3, 15)]
    data = {"cluster": cluster.name, "model": MODEL.__dict__, "points": {}}
    for n in counts:
        best = best_per_mode(n, cluster)
        data["points"][n] = best
        print(f"{n:6d} GPUs: " + ", ".join(f"{m} {r['step_time_s']:.1f}s ({r['tp']}, dp{r['dp']} pp{r['pp']} "
                                           f"sp{r['sp']})" for m, r in best.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_scaling_175b.json").write_text(json.dumps(data, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    labels = {"none": "pipeline x data only", "row": "1-D (Megatron)", "square": "2-D (SUMMA)",
              "cube": "3-D (Bian et al.)", "subgraph": "sub-graph (SUPER)"}
    for m in MODES:
        pts = [(n, data["points"][n][m]) for n in counts if m in data["points"][n]]
        if not pts:
            continue
        ax.plot([n for n, _ in pts], [r["step_time_s"] for _, r in pts], "o-", label=labels[m])
        ax2.plot([n for n, _ in pts], [r["memory_bytes"] / 2 ** 30 for _, r in pts], "o-", label=labels[m])
    flops = plan.transformer_flops(MODEL, recompute=True)
    ax.plot(counts, [flops / n / cluster.gemm_flops for n in counts], "k:", lw=1, label="compute alone")
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="predicted step time (s)",
           title=f"175B (GPT-3), batch 1536, {cluster.name}: best grid per mode")
    ax2.axhline(cluster.memory_bytes / 2 ** 30, color="k", ls="--", lw=1, label="GPU memory")
    ax2.set(xscale="log", xlabel="GPUs", ylabel="predicted memory per GPU (GiB)", title="memory of that grid")
    ax.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plan_scaling_175b.png", dpi=110)


if __name__ == "__main__":
    main()
