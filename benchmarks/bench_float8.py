"""The main job in float8 against bf16 over 200 steps (the float8 issue's numerics goal): on three
composed grids of 8 CPU ranks (and the 3-D cube and Mixtral over expert parallelism beside them),
`gridweave train --precision fp8` (torchao's tensorwise recipe; under ZeRO-3 its weights gathered in float8)
and `fp8-rowwise` beside `--precision bf16` on the same grid, from the same initial weights and
batches: each run's loss curve, the mean of its last 20 steps, and whether float8's ends within 2%
of bf16's; plus whether any run diverged (a non-finite loss or a last mean above the first).

    python benchmarks/bench_float8.py [--steps 200] [--out benchmarks/results]
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import bench_parser, results_dir, save

# Multiples of 16 in every product (float8's rule): hidden 32, SwiGLU width 96, 32 tokens a
# micro-batch on a rank at the smallest shard. Small: on CPU ranks the products are emulated
MODEL = ["--hidden", "32", "--layers", "4", "--heads", "4", "--ffn-hidden", "96", "--seq", "32", "--batch", "16",
         "--microbatches", "2", "--tokenizer", "bytes", "--warmup", "10", "--val-every", "0", "--sample-tokens", "0",
         "--quiet"]
GRIDS = {"row2-tpsp-pp2-dp2": ["--tp", "row:2", "--tp-sp", "--pp", "2", "--dp", "2"],
         "subgraph2-sp2-dp2": ["--tp", "subgraph:2", "--sp", "2", "--dp", "2", "--pp", "1"],
         "sp2-dp4-zero3": ["--sp", "2", "--dp", "4", "--pp", "1", "--zero", "3"],
         # the cube's local weights are (in / p, out / p^2): hidden 64 and width 128 keep them multiples of 16
         "cube2": ["--tp", "cube:2", "--hidden", "64", "--ffn-hidden", "128", "--microbatches", "1"],
         "mixtral-ep2-dp8": ["--model", "mixtral", "--experts", "4", "--top-k", "2", "--ep", "2", "--dp", "8",
                             "--pp", "1"]}
PRECISIONS = ("bf16", "fp8", "fp8-rowwise")
TAIL = 20


def train(out: Path, grid: list, precision: str, steps: int, port: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    env.pop("RANK", None)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *MODEL, "--steps", str(steps), "--nproc", "8",
                        "--precision", precision, *grid, "--out", str(out)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{precision} {grid}: {r.stderr[-3000:]}")
    losses = json.loads((out / "metrics.json").read_text())["loss"]
    return {"losses": losses, "seconds": time.perf_counter() - t0,
            "last_mean": sum(losses[-TAIL:]) / TAIL, "first": losses[0]}


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["grids"]), figsize=(4 * len(data["grids"]), 4))
    for ax, (name, runs) in zip(axes, data["grids"].items()):
        for p, run in runs.items():
            ax.plot(run["losses"], label=p, lw=1)
        ax.set_title(name)
        ax.set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    grids, port = {}, 29861
    with tempfile.TemporaryDirectory() as tmp:
        for name, grid in GRIDS.items():
            runs = {}
            for precision in PRECISIONS:
                port += 2
                runs[precision] = train(Path(tmp) / f"{name}-{precision}", grid, precision, args.steps, port)
                print(name, precision, f"last {TAIL} steps' mean {runs[precision]['last_mean']:.4f}",
                      f"({runs[precision]['seconds']:.0f} s)", flush=True)
            base = runs["bf16"]["last_mean"]
            for precision in PRECISIONS[1:]:
                runs[precision]["vs_bf16"] = runs[precision]["last_mean"] / base - 1
            grids[name] = runs
    diverged = [f"{g} {p}" for g, runs in grids.items() for p, r in runs.items()
                if not all(math.isfinite(x) for x in r["losses"]) or r["last_mean"] >= r["first"]]
    worst = max(abs(r["vs_bf16"]) for runs in grids.values() for p, r in runs.items() if p != "bf16")
    summary = {"steps": args.steps, "worst_vs_bf16": worst, "within_2pct": worst <= 0.02, "diverged": diverged}
    print(json.dumps(summary), flush=True)
    save(results_dir(args), "float8_losses", {"model": MODEL, "grids": grids, "summary": summary}, plot)


if __name__ == "__main__":
    main()
