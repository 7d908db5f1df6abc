"""Li et al.'s memory results (§4.2 Fig. 3, §4.3 Fig. 5, Table 4) as ratios on this machine (issue 31).

    python benchmarks/bench_seq_memory.py      # writes results/seq_memory.json and .png

Under one per-rank memory budget, the longest sequence (batch fixed) and the largest batch
(sequence fixed at 512) that 1-D tensor parallelism (Megatron, Megatron-LM), sequence parallelism
with the zigzag ring, with DeepSpeed-Ulysses and with Li et al.'s own RSA, and (BERT only)
Linformer with sequence parallelism (Li et al. §4.3) fit at N = 2, 4, 8 ranks, for a BERT-Base-
like and a Llama-like model scaled down (hidden 128, 8 heads, 2 layers, byte vocabulary: the
layers dominate as in BERT-Base, whose 30k vocabulary is 18% of its parameters).

Two scopes. "model": the whole model as gridweave trains it, whose embedding, head and loss every
sequence rank computes on the whole sequence (only the transformer layers split it). "layers":
the transformer layers alone (and their parameters, gradients and Adam's states), the part seed
004's Table 3 accounts and its ColossalAI implementation splits end to end: the paper's trend.

How a maximum is found: the planner's memory model (gw.plan.predict: parameters, gradients,
Adam's states on the device, and the activations of one micro-batch recorded from the code that
runs it, for the attention the grid runs) is searched for the largest length / batch within the
budget. The model is then validated where it matters, at those maxima: every such grid is built and
trained for real on N CPU ranks (gw.train.build / train_step, as bench_plan measures: each rank's
peak resident memory over its resident memory before the build, glibc's mmap threshold fixed so
that freed tensors leave the resident set), and the prediction's error is reported beside each
maximum. Table 4's weak scaling (the batch, or the sequence, grown with N) is predicted and
measured the same way.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from launch import bench_parser, peak_growth_per_rank, results_dir, run_ranks, save, start_worker

BUDGET = 64 << 20  # bytes per rank (Li et al.: 16 GB P100s; scaled with the model)
MODEL = dict(hidden=128, heads=8, layers=2, kv_heads=8, tokenizer="bytes")
FAMILIES = ("bert", "llama")
METHODS = ("tp", "ring", "ulysses", "rsa", "linformer")  # linformer: BERT only (it is not causal)
LINFORMER_K = 128
RANKS = (2, 4, 8)
SEARCH_BATCH, BATCH_SEQ = 4, 512  # Fig. 5 fixes the batch (64 in the paper), Fig. 3 the length (512)
PAPER = {"max_seq_sp_over_tp": {16: 1.4, 64: 3.0}, "max_batch_sp_over_tp": {64: 13.7},
         "linformer_tokens_32_gpus": 114_000,
         "weak_batch_memory_mb": {"tp": [8477.28, 9520.47, 12232.52, None], "sp": [8477.53, 8478.76, 8481.26, 8490.75]},
         "weak_seq_memory_mb": {"tp": [3707.39, 4993.43, 8175.93, 14862.09], "sp": [3707.01, 4670.64, 6601.88, 10536.38]}}
WARMUP = 2


def job(family: str, method: str, n: int, seq: int, batch: int):
    """The main job's TrainConfig of one grid: fp32, Adam's states on the device, one micro-batch."""
    import gridweave as gw

    grid = dict(tp=f"row:{n}", sp=1) if method == "tp" else dict(tp="none", sp=n)
    attention = "ring" if method == "tp" else method
    return gw.train.TrainConfig(model=family, seq=seq, batch=batch, microbatches=1, dp=1, pp=1, offload=False,
                                attention=attention, linformer_k=LINFORMER_K if method == "linformer" else 0,
                                **grid, **MODEL)


SCOPES = ("model", "layers")


def predicted(family, method, n, seq, batch, scope="model") -> float:
    """The planner's peak bytes per rank of a training step (gw.plan.predict); scope "layers": the
    transformer layers alone (plan.Model(embedding=False))."""
    from gridweave import plan

    cfg = job(family, method, n, seq, batch)
    grid = plan.GridShape(tp=cfg.mode, sp=cfg.sp)
    model = dataclasses.replace(plan.model_of(cfg), embedding=scope == "model")
    p = plan.predict(model, grid, plan.load_cluster("local"), microbatches=1, offload_bsize=0)
    return p["memory_bytes"] + p["host_bytes"]


def fits(family, method, n, seq, batch, scope) -> bool:
    import gridweave as gw

    try:
        job(family, method, n, seq, batch).grid_shape(n)
    except gw.GridError:
        return False
    return predicted(family, method, n, seq, batch, scope) <= BUDGET


def largest(ok, unit: int, cap: int) -> int:
    """The largest multiple of `unit` (up to cap) with ok(x), memory growing with x: doubling, then bisection."""
    if not ok(unit):
        return 0
    lo, hi = unit, 2 * unit
    while hi <= cap and ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def maxima(scope: str) -> list:
    rows = []
    for family in FAMILIES:
        for method in METHODS:
            if method == "linformer" and family != "bert":
                continue
            for n in RANKS:
                unit = 2 * n * 8  # the zigzag's 2N chunks, and whole blocks of 8 tokens
                seq = largest(lambda s: fits(family, method, n, s, SEARCH_BATCH, scope), unit, 1 << 17)
                batch = largest(lambda b: fits(family, method, n, BATCH_SEQ, b, scope), 1, 1 << 12)
                rows.append(dict(scope=scope, family=family, method=method, ranks=n, max_seq=seq, max_batch=batch,
                                 predicted_at_max_seq=predicted(family, method, n, seq, SEARCH_BATCH, scope)
                                 if seq else None))
                print(f"{scope:6s} {family:5s} {method:9s} N={n}: longest {seq:6d} tokens (batch {SEARCH_BATCH}), "
                      f"largest batch {batch:4d} (seq {BATCH_SEQ})", flush=True)
    return rows


def weak_points() -> list:
    """Table 4 scaled down: (kind, method, N, seq, batch) with the batch, or the length, grown with N."""
    out = []
    for n in (1, 2, 4, 8):
        for method in ("tp", "ring"):
            if n == 1 and method == "ring":
                continue  # N = 1: one grid for both
            out.append(("weak_batch", method, n, 256, 4 * n))
            out.append(("weak_seq", method, n, 256 * n, 4))
    return out


def worker(spec_path: str, out_path: str) -> None:
    """Each case of the spec on this job's ranks: the model built and trained as gridweave train
    does, each rank's peak resident growth (bench_plan's accounting)."""
    import gc

    import torch
    import torch.distributed as dist

    import gridweave as gw

    n, rank, store = start_worker()
    cases = json.loads(Path(spec_path).read_text())
    results = []
    for i, (scope, family, method, seq, batch) in enumerate(cases):
        cfg = job(family, method, n, seq, batch)
        grid = gw.init(dp=1, pp=1, tp=cfg.mode, sp=cfg.sp, store=store, prefix=f"seqmem-{i}")
        model_cfg = cfg.model_config(256)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (batch, seq), generator=g)
        x, y = gw.data.masked_lm(ids, range(batch), 0, 256, 256) if cfg.masked_lm else (ids, ids.roll(1, 1))
        built = []

        def build():
            torch.manual_seed(0)
            if scope == "model":
                built[:] = gw.train.build(cfg, grid, model_cfg)[1:]
                return
            dense = gw.models.build(model_cfg, device=grid.device)  # the layers alone, Adam on the device
            layers = torch.nn.ModuleList(gw.nn.TransformerLayer.from_dense(d, grid, mode=cfg.mode, attention=cfg.attention)
                                         for d in dense.layers)
            del dense
            built[:] = [layers, gw.optim.DistributedAdam(layers.parameters(), grid, lr=1e-3, zero=0, offload=False)]

        def step():
            if scope == "model":
                gw.train.train_step(cfg, grid, *built, x, y)
                return
            layers, opt = built
            shape = layers[0].input_layout.without("dp").local_shape((batch, seq, cfg.hidden), grid)
            h = torch.randn(shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
            out = gw.pipeline.run_layers(layers, h, 1, None)
            out.backward(torch.ones_like(out))
            opt.step()

        def drop():
            built.clear()
            gc.collect()

        results.append(max(peak_growth_per_rank(build, step, drop, WARMUP)))
        drop()
        grid.shutdown()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    gw.shutdown()
    dist.destroy_process_group()


def measure(cases_by_n: dict, out: Path) -> dict:
    """{(n, case): measured peak bytes} over one job of n ranks per n."""
    found = {}
    for n, cases in sorted(cases_by_n.items()):
        spec = out / f".seqmem_spec_{n}.json"
        spec.write_text(json.dumps(cases))
        got = run_ranks(__file__, n, 29561 + n, out, f"seqmem_{n}", str(spec))
        spec.unlink()
        for case, m in zip(cases, got):
            found[(n, tuple(case))] = m
    return found


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(23, 5))
    panels = [(scope, key) for scope in SCOPES for key in ("max_seq", "max_batch")]
    colors = dict(zip(METHODS, ("C0", "C1", "C2", "C3", "C4")))
    for ax, (scope, key) in zip(axes, panels):
        for family, style in zip(FAMILIES, ("o-", "s--")):
            for method in METHODS:
                rs = [r for r in data["maxima"] if (r["scope"], r["family"], r["method"]) == (scope, family, method)]
                if rs:
                    ax.plot([r["ranks"] for r in rs], [r[key] for r in rs], style, color=colors[method],
                            label=f"{family} {method}")
        what = f"longest sequence (batch {SEARCH_BATCH})" if key == "max_seq" else f"largest batch (seq {BATCH_SEQ})"
        ax.set(xscale="log", yscale="log", xlabel="ranks N", ylabel=what,
               title=f"{'whole model' if scope == 'model' else 'transformer layers alone'}: {what}")
        ax.set_xticks(RANKS, [str(n) for n in RANKS])
        ax.legend(fontsize=7, ncol=2)
    s = data["summary"]
    fig.suptitle(f"Li et al. on CPU ranks, {BUDGET >> 20} MiB per rank: sequence parallelism (ring, Ulysses, RSA, "
                 f"Linformer) vs 1-D tensor parallelism (tp); the planner's memory model against peak RSS at "
                 f"{s['validated_points']} points: median |error| {100 * s['median_abs_memory_error']:.0f}%, "
                 f"worst {100 * s['worst_abs_memory_error']:.0f}%")
    fig.tight_layout()
    fig.savefig(png, dpi=95)
    plt.close(fig)


def main():
    ap = bench_parser(__file__)
    ap.add_argument("spec", nargs="?")
    args = ap.parse_args()
    if args.worker:
        worker(args.spec, args.out)
        return
    out = results_dir(args)
    rows = [r for scope in SCOPES for r in maxima(scope)]
    weak = weak_points()
    cases = {}
    for r in rows:  # the model validated at the maxima it found
        if r["max_seq"]:
            cases.setdefault(r["ranks"], []).append([r["scope"], r["family"], r["method"], r["max_seq"], SEARCH_BATCH])
    for kind, method, n, seq, batch in weak:
        cases.setdefault(n, []).append(["model", "bert", method, seq, batch])
    measured = measure(cases, out)
    errors = []
    for r in rows:
        if r["max_seq"]:
            m = measured[(r["ranks"], (r["scope"], r["family"], r["method"], r["max_seq"], SEARCH_BATCH))]
            r["measured_at_max_seq"] = m
            r["memory_error"] = r["predicted_at_max_seq"] / m - 1
            errors.append(abs(r["memory_error"]))
    weak_rows = []
    for kind, method, n, seq, batch in weak:
        m = measured[(n, ("model", "bert", method, seq, batch))]
        p = predicted("bert", method, n, seq, batch)
        weak_rows.append(dict(kind=kind, method=method, ranks=n, seq=seq, batch=batch, measured=m, predicted=p,
                              memory_error=p / m - 1))
        errors.append(abs(p / m - 1))

    def ratio(scope, family, method, n, key):
        def row(m):
            return next(r for r in rows if (r["scope"], r["family"], r["method"], r["ranks"]) == (scope, family, m, n))
        a, b = row(method), row("tp")
        return a[key] / b[key] if b[key] else None

    ratios = {f"{scope}/{family}/{method}/N={n}": {"max_seq_over_tp": ratio(scope, family, method, n, "max_seq"),
                                                   "max_batch_over_tp": ratio(scope, family, method, n, "max_batch")}
              for scope in SCOPES for family in FAMILIES for method in METHODS[1:] for n in RANKS
              if not (method == "linformer" and family != "bert")}
    data = {"budget_bytes": BUDGET, "model": MODEL, "linformer_k": LINFORMER_K, "search_batch": SEARCH_BATCH,
            "batch_seq": BATCH_SEQ, "maxima": rows, "weak_scaling": weak_rows, "ratios": ratios, "paper": PAPER,
            "summary": {"median_abs_memory_error": statistics.median(errors), "worst_abs_memory_error": max(errors),
                        "validated_points": len(errors)}}
    save(out, "seq_memory", data, plot)
    for k, v in ratios.items():
        print(f"{k}: longest x{v['max_seq_over_tp']:.2f}, batch x{v['max_batch_over_tp']:.2f} of tp")
    for w in weak_rows:
        print(f"{w['kind']} {w['method']} N={w['ranks']} seq {w['seq']} batch {w['batch']}: measured "
              f"{w['measured'] / 2 ** 20:.1f} MiB, predicted {w['predicted'] / 2 ** 20:.1f} ({100 * w['memory_error']:+.0f}%)")
    print(f"memory model vs peak RSS: median |error| {100 * data['summary']['median_abs_memory_error']:.1f}%, "
          f"worst {100 * data['summary']['worst_abs_memory_error']:.1f}% over {len(errors)} points")


if __name__ == "__main__":
    main()
