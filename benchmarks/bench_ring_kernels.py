"""Ring attention's local blocks: torch's fused attention kernels (now) against materialised
blocks of scores (before: S = QK^T, P = exp(S - lse), dS by hand), on CPU.

    python benchmarks/bench_ring_kernels.py      # results/ring_kernels.json and .png

One causal ring-attention layer (forward and backward) on one rank, so the block is the
whole sequence; each (variant, length) runs in a fresh process and reports its peak
resident memory above what it held before the layer (ru_maxrss) and the median time of the
layer; both variants' outputs and gradients are compared in the same run.
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from launch import bench_parser, results_dir, save

B, Z, A = 1, 8, 64
LENGTHS = (1024, 2048, 4096)
CPU = torch.device("cpu")


def one(variant: str, length: int) -> dict:
    import gridweave as gw
    from gridweave.autograd import ring

    torch.set_num_threads(1)
    grid = gw.init()
    blocks = ring.FusedBlocks if variant == "fused" else ring.ScoresBlocks
    g = torch.Generator(device=CPU).manual_seed(0)
    q, k, v = (torch.randn(B, Z, length, A, generator=g, device=CPU).requires_grad_() for _ in range(3))
    dout = torch.randn(B, Z, length, A, generator=g, device=CPU)

    def layer():
        for t in (q, k, v):
            t.grad = None
        out = ring.ring_attention(q, k, v, grid, "sp", causal=True, blocks=blocks)
        out.backward(dout)
        return out

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = layer()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        layer()
        times.append(time.perf_counter() - t0)
    # the dense reference: torch's own attention in float64
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    ref.backward(dout.double())
    err = max(float((a.double() - b).abs().max() / b.abs().max())
              for a, b in ((out, ref), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)))
    gw.shutdown()
    return {"variant": variant, "length": length, "peak_bytes": peak, "seconds": statistics.median(times),
            "scores_bytes": B * Z * length * length * 4, "max_rel_error_vs_float64": err}


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in ("materialised", "fused"):
        rows = [r for r in data["rows"] if r["variant"] == variant]
        a.plot([r["length"] for r in rows], [r["peak_bytes"] / 2 ** 20 for r in rows], "o-", label=variant)
        b.plot([r["length"] for r in rows], [r["seconds"] for r in rows], "o-", label=variant)
    a.set(xlabel="sequence length", ylabel="peak memory above start (MiB)", title="one ring-attention layer",
          xscale="log", yscale="log")
    b.set(xlabel="sequence length", ylabel="forward + backward (s)", xscale="log", yscale="log")
    a.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "LENGTH"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]))))
        return
    rows = []
    for length in LENGTHS:
        for variant in ("materialised", "fused"):
            r = subprocess.run([sys.executable, __file__, "--one", variant, str(length)], capture_output=True,
                               text=True, check=True, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(rows[-1])
    by = {(r["variant"], r["length"]): r for r in rows}
    ratios = {str(L): {"memory": by[("materialised", L)]["peak_bytes"] / max(by[("fused", L)]["peak_bytes"], 1),
                       "time": by[("materialised", L)]["seconds"] / by[("fused", L)]["seconds"]} for L in LENGTHS}
    save(results_dir(args), "ring_kernels", {"config": {"batch": B, "heads": Z, "head_dim": A, "causal": True},
                                             "rows": rows, "materialised_over_fused": ratios}, plot)


if __name__ == "__main__":
    main()
