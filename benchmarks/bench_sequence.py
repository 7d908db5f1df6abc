"""Sequence parallelism (Li et al.) on CPU ranks.

    python benchmarks/bench_sequence.py      # writes results/sequence.json and .png

memory: per-rank activation bytes saved for backward by one attention (B=1, Z=8, A=32,
  L=2048) vs N = 1, 2, 4, 8: RSA keeps its (L/N x L) probabilities, blockwise keeps O(L/N),
  Linformer with sequence parallelism (K=256, Li et al. Table 3) keeps O(L K / N).
longest: the longest sequence whose layer activations fit a per-rank budget, sequence
  parallel (blockwise ring, and RSA) vs 1-D tensor parallel, at N = 4 and 8.
overlap: blockwise ring attention forward+backward vs its compute alone (the ring
  replaced by a local stand-in) and its communication alone (the same exchanges, no math), at
  N = 2, 4, 8; its efficiency as ring-flash-attention reports it (compute alone / the ring), for
  one sequence and for packed documents (issue 31: the blocks masked per document).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, saved_bytes, start_worker, stem

MEM = dict(B=1, Z=8, A=32, L=2048)
LINFORMER_K = 256
LAYER = dict(hidden=256, heads=8, batch=1)
BUDGET = 24 << 20  # bytes of activations per rank


class _NoComm:
    """The grid with its ring replaced by _LocalRing (grid.ring is what ring attention asks)."""

    def __init__(self, grid):
        self._grid = grid

    def ring(self, axis):
        return _LocalRing(self._grid, axis)

    def __getattr__(self, name):
        return getattr(self._grid, name)


class _LocalRing:
    """Stand-in ring for 'compute alone': same steps, no communication."""

    def __init__(self, grid, axis):
        self.size, self.rank = grid.size(axis), grid.index(axis)

    def source_at(self, step):
        return (self.rank - step) % self.size

    def pass_on(self, tensors, step):
        class Done:
            def wait(_self):
                return [t.contiguous() for t in tensors]
        return Done()


def worker(part, out_path):
    import torch
    import torch.distributed as dist

    import gridweave as gw
    from gridweave.autograd import ring as ring_mod

    n, rank, store = start_worker()
    result = {"ranks": n}
    if part == "memory":
        grid = gw.init(sp=n, store=store, prefix="seq-mem")
        B, Z, A, L = MEM["B"], MEM["Z"], MEM["A"], MEM["L"]
        for algo in ("rsa", "ring"):
            q, k, v = (torch.randn(B, Z, L // n, A, requires_grad=True) for _ in range(3))
            fn = (lambda: ring_mod.ring_self_attention(q, k, v, grid, causal=True)) if algo == "rsa" else \
                (lambda: ring_mod.ring_attention(q, k, v, grid, causal=True))
            out, saved = saved_bytes(fn, (q, k, v))
            result[algo] = saved
            out.sum().backward()
        # Li et al. Table 3: Linformer with sequence parallelism, this rank's L/N columns of E and F,
        # the (K x A) products all-reduced over sp: every term in L divided by N
        from gridweave.autograd.comm import all_reduce_replicated
        from gridweave.nn.dense import linformer_attention

        q, k, v = (torch.randn(B, Z, L // n, A, requires_grad=True) for _ in range(3))
        lowrank = torch.randn(2, LINFORMER_K, L // n, requires_grad=True)
        total = (lambda t: all_reduce_replicated(t, grid, "sp")) if n > 1 else None
        out, saved = saved_bytes(lambda: linformer_attention(q, k, v, lowrank, total), (q, k, v, lowrank))
        result["linformer"] = saved
        out.sum().backward()
    elif part == "longest":
        grid_sp = gw.init(sp=n, store=store, prefix="seq-long-sp")
        grid_tp = gw.init(tp=gw.Row(n), store=store, prefix="seq-long-tp")
        torch.manual_seed(0)
        H, heads = LAYER["hidden"], LAYER["heads"]
        dense = gw.nn.DenseTransformerLayer(H, heads)
        layers = {"sp-ring": gw.nn.TransformerLayer.from_dense(dense, grid_sp, mode="sp", attention="ring"),
                  "sp-rsa": gw.nn.TransformerLayer.from_dense(dense, grid_sp, mode="sp", attention="rsa"),
                  "tp-1d": gw.nn.TransformerLayer.from_dense(dense, grid_tp, mode="1d")}
        for name, layer in layers.items():
            params = list(layer.parameters())
            curve = []

            def fits_budget(L):
                x = torch.randn(LAYER["batch"], L if name == "tp-1d" else L // n, H)
                _, saved = saved_bytes(lambda: layer(x.requires_grad_()), params)
                # every rank must take the same decision: use the largest rank's bytes
                t = torch.tensor([saved], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                curve.append((L, int(t.item())))
                return t.item() <= BUDGET

            step = 2 * n * 16  # zigzag needs 2N chunks
            lo, hi = 0, step
            while fits_budget(hi) and hi < (1 << 17):  # doubling, then bisection to `step`
                lo, hi = hi, hi * 2
            while hi - lo > step:
                mid = (lo + hi) // 2 // step * step
                lo, hi = (mid, hi) if fits_budget(mid) else (lo, mid)
            result[name] = {"longest": lo, "curve": sorted(curve)}
    else:  # overlap
        grid = gw.init(sp=n, store=store, prefix="seq-ovl")
        B, Z, A, L = 1, 8, 64, 4096
        q, k, v = (torch.randn(B, Z, L // n, A, requires_grad=True) for _ in range(3))

        # packed documents of 256-1280 tokens (seeded alike on every rank)
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(256, 1280, (L // 256,), generator=g)
        docs = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:L].reshape(1, L)

        def full(documents=None):
            out = ring_mod.ring_attention(q, k, v, grid, causal=True, documents=documents)
            out.sum().backward()

        def compute(documents=None):
            out = ring_mod.ring_attention(q, k, v, _NoComm(grid), causal=True, documents=documents)
            out.sum().backward()

        ring = grid.ring("sp")

        def comm():  # the exchanges of forward (K, V) and backward (K, V, then dK, dV)
            for s in range(n - 1):
                ring.pass_on([k.detach(), v.detach()], s).wait()
            for s in range(n):
                if s < n - 1:
                    ring.pass_on([k.detach(), v.detach()], 2 * s).wait()
                ring.pass_on([k.detach(), v.detach()], 2 * s + 1).wait()

        runs = (("ring", full), ("compute", compute), ("comm", comm),
                 ("ring_documents", lambda: full(docs)), ("compute_documents", lambda: compute(docs)))
        times = {name: [] for name, _ in runs}
        for _, f in runs:
            f()  # warm-up
        for _ in range(7):  # interleaved rounds: the variants see the same machine
            for name, f in runs:
                dist.barrier()
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        result.update({k: statistics.median(v) for k, v in times.items()})
        result["efficiency"] = result["compute"] / result["ring"]  # ring-flash-attention's measure
        result["efficiency_documents"] = result["compute_documents"] / result["ring_documents"]
        result["config"] = dict(B=B, Z=Z, A=A, L=L, documents=len(lengths))
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    gw.shutdown()
    dist.destroy_process_group()


def run(part, n, out, transport):
    return run_ranks(__file__, n, 29547, out, f"{part}_{n}", part, transport=transport)


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    ax = axes[0]
    ns = [r["ranks"] for r in data["memory"]]
    for algo in ("rsa", "ring", "linformer"):
        if all(algo in r for r in data["memory"]):
            ax.plot(ns, [r[algo] / 2 ** 20 for r in data["memory"]], "o-",
                    label=f"linformer K={LINFORMER_K}" if algo == "linformer" else algo)
    ax.plot(ns, [data["memory"][0]["ring"] / 2 ** 20 / x for x in ns], "k--", lw=1, label="1/N")
    ax.set(xscale="log", yscale="log", title=f"attention activations per rank, L={MEM['L']}", xlabel="N",
           ylabel="MiB")
    ax.legend()
    ax = axes[1]
    labels, vals = [], []
    for r in data["longest"]:
        for name in ("sp-ring", "sp-rsa", "tp-1d"):
            labels.append(f"{name}\nN={r['ranks']}")
            vals.append(r[name]["longest"])
    ax.bar(labels, vals)
    ax.set(title=f"longest sequence within {BUDGET >> 20} MiB of activations per rank", ylabel="tokens")
    ax.tick_params(axis="x", labelsize=8)
    ax = axes[2]
    labels = [f"N={r['ranks']}" for r in data["overlap"]]
    for i, key in enumerate(("ring", "compute", "comm")):
        ax.bar([x + i * 0.27 for x in range(len(labels))], [r[key] * 1e3 for r in data["overlap"]], 0.27, label=key)
    ax.set_xticks([x + 0.27 for x in range(len(labels))], labels)
    for x, r in enumerate(data["overlap"]):
        ax.annotate(f"eff {r['efficiency']:.2f}", (x, r["ring"] * 1e3), ha="center", va="bottom", fontsize=8)
    ax.set(title="ring attention fwd+bwd vs compute alone and comm alone", ylabel="ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = bench_parser(__file__, ("memory", "longest", "overlap"))
    ap.add_argument("--parts", default="memory,longest,overlap")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return
    out = results_dir(args)
    name = stem("sequence", args.transport)
    path = out / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    ranks = {"memory": (1, 2, 4, 8), "longest": (4, 8), "overlap": (2, 4, 8)}
    for part in args.parts.split(","):
        data[part] = [run(part, n, out, args.transport) for n in ranks[part]]
    path.write_text(json.dumps(data, indent=1))
    if all(k in data for k in ranks):  # the figure needs every part
        plot(data, out / f"{name}.png")
    for r in data.get("memory", []):
        print(f"memory N={r['ranks']}: RSA {r['rsa']} B, blockwise {r['ring']} B, Linformer {r.get('linformer')} B")
    for r in data.get("longest", []):
        print(f"longest N={r['ranks']}: " + ", ".join(f"{k} {r[k]['longest']}" for k in ("sp-ring", "sp-rsa", "tp-1d")))
    for r in data.get("overlap", []):
        print(f"overlap N={r['ranks']}: ring {r['ring'] * 1e3:.1f} ms, compute {r['compute'] * 1e3:.1f} ms, "
              f"comm {r['comm'] * 1e3:.1f} ms, efficiency {r['efficiency']:.2f} "
              f"(packed documents {r['efficiency_documents']:.2f})")


if __name__ == "__main__":
    main()
