"""Li et al.'s memory results (§4.2 Fig. 3, §4.3 Fig. 5, Table 4) on the whole model, on this machine.

    python benchmarks/bench_seq_memory.py      # writes results/seq_memory.json and .png

Under one per-rank memory budget, the longest sequence (batch fixed) and the largest batch
(sequence fixed at 512) that 1-D tensor parallelism (Megatron-LM), Megatron's sequence parallelism
inside it (tp-sp, Korthikanti et al. 2022), sequence parallelism with the zigzag ring and with
DeepSpeed-Ulysses, and (BERT only) Linformer with sequence parallelism (Li et al. §4.3) fit at
N = 2, 4, 8 ranks, the whole model trained as gridweave trains it (embedding, layers, head and loss,
Adam's states on the device, fp32, one micro-batch): with sp every rank embeds, scores and holds
only its L/N tokens.

The models, scaled down from the paper's by one rule (a byte vocabulary; hidden / 6; layers / 6;
heads so that each is 16 wide and they split over 8 tensor ranks): BERT-Base-like (hidden 128, 8
heads, 2 layers), BERT-Large-like (BERT-Large's hidden 1024 is 4/3 of Base's: 176 = 128 x 4/3
rounded up to a multiple of 16, 16 heads of 11, 4 layers as 24 / 6), and a Llama-like one (RMSNorm,
SwiGLU, rotary positions; hidden 128, 8 heads, 2 layers).

How a maximum is found: the planner's memory model (gw.plan.predict, the activations recorded from
the code that runs) proposes it; then real runs decide it. Each proposed maximum and the next size
up are built and trained on N CPU ranks (gw.train.build / train_step; each rank's peak resident
memory over its resident memory before the build, glibc's mmap threshold fixed so that freed
tensors leave the resident set, as bench_plan measures); where the proposal fails the budget the
runs step down, where the next size up still fits they step up, until the maximum runs within the
budget and the next size up exceeds it, both measured. The planner's error at the maxima is kept.
Table 4's weak scaling (the batch, or the sequence, grown with N) is predicted and measured the same way.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from launch import bench_parser, peak_growth_per_rank, results_dir, run_ranks, save, start_worker

BUDGET = 64 << 20  # bytes per rank (Li et al.: 16 GB P100s; scaled with the model)
MODELS = {"bert-base": dict(model="bert", hidden=128, heads=8, layers=2),
          "bert-large": dict(model="bert", hidden=176, heads=16, layers=4),
          "llama": dict(model="llama", hidden=128, heads=8, layers=2, kv_heads=8)}
# linformer: BERT only (it is not causal); ring-zero1: the ring with Adam's states sharded over the sequence
# ranks (ZeRO-1, as Megatron's distributed optimizer shards them over dp x cp); ring-zero3: parameters,
# gradients and states sharded too (ZeRO-3, as DeepSpeed-Ulysses runs: each rank then holds 1/N of the
# model's state, as tensor parallelism does); ring-zero3-fused: and the head's projection fused with the loss
# (fused_loss, Liger-Kernel's fused linear cross-entropy: no token's logits kept for the backward; where the
# vocabulary is split over tp its rank's slice is narrower than the hidden size here, and the fused loss
# would hold more, so tp keeps the unfused one)
METHODS = ("tp", "tp-sp", "ring", "ulysses", "linformer", "ring-zero1", "ring-zero3", "ring-zero3-fused")
SP_METHODS = ("ring", "ulysses", "linformer", "ring-zero1", "ring-zero3", "ring-zero3-fused")
LINFORMER_K = 128
RANKS = (2, 4, 8)
SEARCH_BATCH, BATCH_SEQ = 4, 512  # Fig. 5 fixes the batch (64 in the paper), Fig. 3 the length (512)
PAPER = {"max_seq_sp_over_tp": {16: 1.4, 64: 3.0}, "max_batch_sp_over_tp": {64: 13.7},
         "linformer_tokens_32_gpus": 114_000,
         "weak_batch_memory_mb": {"tp": [8477.28, 9520.47, 12232.52, None], "sp": [8477.53, 8478.76, 8481.26, 8490.75]},
         "weak_seq_memory_mb": {"tp": [3707.39, 4993.43, 8175.93, 14862.09], "sp": [3707.01, 4670.64, 6601.88, 10536.38]}}
WARMUP = 2
ROUNDS = 10  # rounds of measured steps from the planner's proposal before giving up on a maximum


def job(name: str, method: str, n: int, seq: int, batch: int, ac=1):
    """The main job's TrainConfig of one grid: fp32, Adam's states on the device, one micro-batch."""
    import gridweave as gw

    grid = dict(tp=f"row:{n}", sp=1, tp_sp=method == "tp-sp") if method in ("tp", "tp-sp") else dict(tp="none", sp=n)
    attention = method if method in ("ring", "ulysses", "linformer") else "ring"
    words = method.split("-")
    zero = next((int(w[4:]) for w in words if w.startswith("zero")), 0)
    return gw.train.TrainConfig(seq=seq, batch=batch, microbatches=1, dp=1, pp=1, offload=False, ac=ac,
                                zero=zero, fused_loss="fused" in words,
                                attention=attention, linformer_k=LINFORMER_K if method == "linformer" else 0,
                                tokenizer="bytes", **grid, **MODELS[name])


def predicted(name, method, n, seq, batch) -> float:
    """The planner's peak bytes per rank of a training step (gw.plan.predict)."""
    from gridweave import plan

    cfg = job(name, method, n, seq, batch)
    grid = plan.GridShape(tp=cfg.mode, sp=cfg.sp, zero=cfg.zero)
    p = plan.predict(plan.model_of(cfg), grid, plan.load_cluster("local"), microbatches=1, offload_bsize=0)
    return p["memory_bytes"] + p["host_bytes"]


def valid(name, method, n, seq, batch) -> bool:
    import gridweave as gw

    try:
        job(name, method, n, seq, batch).grid_shape(n)
    except gw.GridError:
        return False
    return True


def fits(name, method, n, seq, batch) -> bool:
    return valid(name, method, n, seq, batch) and predicted(name, method, n, seq, batch) <= BUDGET


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


def combos(methods=METHODS):
    for name in MODELS:
        for method in methods:
            if method == "linformer" and MODELS[name]["model"] != "bert":
                continue
            for n in RANKS:
                yield name, method, n


def proposals(methods=METHODS) -> list:
    """Each maximum the planner proposes: (name, method, N, kind, proposal, unit)."""
    out = []
    for name, method, n in combos(methods):
        unit = 2 * n * 8  # the zigzag's 2N chunks, and whole blocks of 8 tokens
        seq = largest(lambda s: fits(name, method, n, s, SEARCH_BATCH), unit, 1 << 17)
        batch = largest(lambda b: fits(name, method, n, BATCH_SEQ, b), 1, 1 << 12)
        out += [(name, method, n, "max_seq", seq, unit), (name, method, n, "max_batch", batch, 1)]
        print(f"proposed {name:10s} {method:9s} N={n}: longest {seq:6d} tokens (batch {SEARCH_BATCH}), "
              f"largest batch {batch:4d} (seq {BATCH_SEQ})", flush=True)
    return out


def case(name, method, n, kind, x) -> list:
    seq, batch = (x, SEARCH_BATCH) if kind == "max_seq" else (BATCH_SEQ, x)
    return [name, method, seq, batch]


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
    for i, (name, method, seq, batch, *ac) in enumerate(cases):
        cfg = job(name, method, n, seq, batch, *ac)
        grid = gw.init(dp=1, pp=1, tp=cfg.mode, sp=cfg.sp, store=store, prefix=f"seqmem-{i}")
        model_cfg = cfg.model_config(256)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (batch, seq), generator=g)
        x, y = gw.data.masked_lm(ids, range(batch), 0, 256, 256) if cfg.masked_lm else (ids, ids.roll(1, 1))
        built = []

        def build():
            torch.manual_seed(0)
            built[:] = gw.train.build(cfg, grid, model_cfg)[1:]

        def step():
            gw.train.train_step(cfg, grid, *built, x, y)

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


def measure(cases_by_n: dict, out: Path, tag: str = "") -> dict:
    """{(n, case): measured peak bytes} over one job of n ranks per n."""
    found = {}
    for n, cases in sorted(cases_by_n.items()):
        if not cases:
            continue
        spec = out / f".seqmem_spec_{n}.json"
        spec.write_text(json.dumps(cases))
        got = run_ranks(__file__, n, 29561 + n, out, f"seqmem_{tag}{n}", str(spec))
        spec.unlink()
        for c, m in zip(cases, got):
            found[(n, tuple(c))] = m
    return found


def decide(props: list, out: Path) -> list:
    """Real runs around each proposal until the maximum fits the budget and the next size up does
    not (or the next size up is not a valid job): rounds of one job per N."""
    state = {}
    for name, method, n, kind, x, unit in props:
        state[(name, method, n, kind)] = dict(unit=unit, proposed=x, runs={}, max=None)
    for r in range(ROUNDS):
        want = {}
        for (name, method, n, kind), st in state.items():
            if st["max"] is not None:
                continue
            unit, runs = st["unit"], st["runs"]
            fitting = [x for x, m in runs.items() if m <= BUDGET]
            over = [x for x, m in runs.items() if m > BUDGET]
            lo = max(fitting) if fitting else None
            if lo is not None and (lo + unit in over or not valid(name, method, n, *case(name, method, n, kind,
                                                                                           lo + unit)[2:])):
                st["max"] = lo
                continue
            if lo is None and runs and min(runs) <= unit:
                st["max"] = 0  # not even the smallest size fits
                continue
            hi = min((x for x in over if lo is None or x > lo), default=None)
            if not runs:
                xs = [st["proposed"] or unit, (st["proposed"] or unit) + unit]
            elif lo is None:  # stepping down, by steps that double
                xs = [max(unit, hi - unit * 2 ** (len(over) - 1))]
            elif hi is None:  # stepping up, by steps that double
                xs = [lo + unit * 2 ** (len(fitting) - 1)]
            else:  # between a size that fits and one that does not: halve the gap
                xs = [lo + (hi - lo) // 2 // unit * unit]
            for x in xs:
                if valid(name, method, n, *case(name, method, n, kind, x)[2:]):
                    want.setdefault(n, []).append(case(name, method, n, kind, x))
                else:
                    st["runs"][x] = float("inf")  # not a job: as good as over the budget
        if not want:
            break
        print(f"round {r}: {sum(map(len, want.values()))} runs", flush=True)
        got = measure(want, out, f"r{r}_")
        for (n, c), m in got.items():  # a run counts for each maximum it is a size of
            name, method, seq, batch = c
            for k in ("max_seq", "max_batch"):
                x = seq if k == "max_seq" else batch
                if case(name, method, n, k, x) == list(c):
                    state[(name, method, n, k)]["runs"][x] = m
    rows = []
    for (name, method, n, kind), st in state.items():
        mx = st["max"]
        runs = {x: m for x, m in st["runs"].items() if m != float("inf")}
        row = dict(model=name, method=method, ranks=n, kind=kind, proposed=st["proposed"], max=mx,
                   decided=mx is not None, measured_runs={str(x): runs[x] for x in sorted(runs)})
        if mx:
            row["measured_at_max"] = runs[mx]
            row["measured_next_up"] = runs.get(mx + st["unit"])
            row["predicted_at_max"] = predicted(name, method, n, *case(name, method, n, kind, mx)[2:])
            row["memory_error"] = row["predicted_at_max"] / runs[mx] - 1
        rows.append(row)
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


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(MODELS), figsize=(6 * len(MODELS), 9))
    colors = dict(zip(METHODS, ("C0", "C5", "C1", "C2", "C4", "C3", "C6", "C7")))
    for col, name in enumerate(MODELS):
        for row, kind in enumerate(("max_seq", "max_batch")):
            ax = axes[row][col]
            for method in METHODS:
                rs = [r for r in data["maxima"] if (r["model"], r["method"], r["kind"]) == (name, method, kind)]
                if rs:
                    ax.plot([r["ranks"] for r in rs], [r["max"] or 0 for r in rs], "o-", color=colors[method],
                            label=method)
            what = f"longest sequence (batch {SEARCH_BATCH})" if kind == "max_seq" else f"largest batch (seq {BATCH_SEQ})"
            ax.set(xscale="log", yscale="log", xlabel="ranks N", ylabel=what, title=f"{name}: {what}")
            ax.set_xticks(RANKS, [str(n) for n in RANKS])
            ax.legend(fontsize=8)
    s = data["summary"]
    fig.suptitle(f"Li et al. Fig. 3 / Fig. 5 on CPU ranks, the whole model, {BUDGET >> 20} MiB per rank: every "
                 f"maximum measured (it fits, the next size up does not); the planner at the maxima: median "
                 f"|error| {100 * s['median_abs_memory_error']:.1f}%, worst {100 * s['worst_abs_memory_error']:.1f}%")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def summarize(rows, weak_rows) -> dict:
    errors = [abs(r["memory_error"]) for r in rows if r.get("memory_error") is not None]
    errors += [abs(w["memory_error"]) for w in weak_rows]
    return {"median_abs_memory_error": statistics.median(errors), "worst_abs_memory_error": max(errors),
            "validated_points": len(errors), "undecided": sum(not r["decided"] for r in rows),
            "runs": sum(len(r["measured_runs"]) for r in rows) + len(weak_rows)}


def repredict(out: Path) -> None:
    """The planner's predictions at the measured maxima and weak-scaling points again (after a
    change to its memory model): the measurements are kept."""
    data = json.loads((out / "seq_memory.json").read_text())
    for r in data["maxima"]:
        if r.get("max"):
            r["predicted_at_max"] = predicted(r["model"], r["method"], r["ranks"], *case(r["model"], r["method"],
                                                                                           r["ranks"], r["kind"],
                                                                                           r["max"])[2:])
            r["memory_error"] = r["predicted_at_max"] / r["measured_at_max"] - 1
    for w in data["weak_scaling"]:
        w["predicted"] = predicted("bert-base", w["method"], w["ranks"], w["seq"], w["batch"])
        w["memory_error"] = w["predicted"] / w["measured"] - 1
    data["summary"] = summarize(data["maxima"], data["weak_scaling"])
    save(out, "seq_memory", data, plot)
    s = data["summary"]
    print(f"memory model vs peak RSS: median |error| {100 * s['median_abs_memory_error']:.1f}%, "
          f"worst {100 * s['worst_abs_memory_error']:.1f}% over {s['validated_points']} points")


def main():
    ap = bench_parser(__file__)
    ap.add_argument("spec", nargs="?")
    ap.add_argument("--repredict", action="store_true", help="the planner's predictions again, the measurements kept")
    ap.add_argument("--add", nargs="+", choices=METHODS, help="measure these methods' maxima, keep the others'")
    args = ap.parse_args()
    if args.worker:
        worker(args.spec, args.out)
        return
    out = results_dir(args)
    if args.repredict:
        repredict(out)
        return
    if args.add:  # these methods' maxima measured and added to the results of the others
        old = json.loads((out / "seq_memory.json").read_text())
        rows = [r for r in old["maxima"] if r["method"] not in args.add] + decide(proposals(tuple(args.add)), out)
        rows.sort(key=lambda r: (list(MODELS).index(r["model"]), METHODS.index(r["method"]), r["ranks"]))
        weak_rows = old["weak_scaling"]
    else:
        rows = decide(proposals(), out)
        weak_rows = weak_scaling(out)
    finish(out, rows, weak_rows)


def weak_scaling(out: Path) -> list:
    weak = weak_points()
    measured = measure({n: [["bert-base", m, seq, batch] for _, m, k, seq, batch in weak if k == n]
                        for n in sorted({w[2] for w in weak})}, out, "weak_")
    weak_rows = []
    for kind, method, n, seq, batch in weak:
        m = measured[(n, ("bert-base", method, seq, batch))]
        p = predicted("bert-base", method, n, seq, batch)
        weak_rows.append(dict(kind=kind, method=method, ranks=n, seq=seq, batch=batch, measured=m, predicted=p,
                              memory_error=p / m - 1))
    return weak_rows


def finish(out: Path, rows: list, weak_rows: list) -> None:
    """The ratios to tensor parallelism, the maxima by N, the planner's errors: saved and printed."""

    def best(name, method, n, kind):
        return next(r["max"] for r in rows if (r["model"], r["method"], r["ranks"], r["kind"]) == (name, method, n, kind))

    ratios = {}
    for name, method, n in combos():
        if method in SP_METHODS:
            ratios[f"{name}/{method}/N{n}"] = {
                f"{kind}_over_{base}": (best(name, method, n, kind) / best(name, base, n, kind)
                                        if best(name, base, n, kind) and best(name, method, n, kind) is not None
                                        else None)
                for kind in ("max_seq", "max_batch") for base in ("tp", "tp-sp")}
    doubling = {f"{name}/{method}/{kind}": [best(name, method, n, kind) for n in RANKS]
                for name, method, _ in combos() for kind in ("max_seq", "max_batch") if method in SP_METHODS}
    data = {"budget_bytes": BUDGET, "models": MODELS, "linformer_k": LINFORMER_K, "search_batch": SEARCH_BATCH,
            "batch_seq": BATCH_SEQ, "maxima": rows, "weak_scaling": weak_rows, "ratios": ratios,
            "maxima_by_n": doubling, "paper": PAPER, "summary": summarize(rows, weak_rows)}
    save(out, "seq_memory", data, plot)
    for k, v in ratios.items():
        print(f"{k}: " + ", ".join(f"{a} x{b:.2f}" for a, b in v.items() if b is not None))
    for w in weak_rows:
        print(f"{w['kind']} {w['method']} N={w['ranks']} seq {w['seq']} batch {w['batch']}: measured "
              f"{w['measured'] / 2 ** 20:.1f} MiB, predicted {w['predicted'] / 2 ** 20:.1f} ({100 * w['memory_error']:+.0f}%)")
    print(f"memory model vs peak RSS: median |error| {100 * data['summary']['median_abs_memory_error']:.1f}%, "
          f"worst {100 * data['summary']['worst_abs_memory_error']:.1f}% over {data['summary']['validated_points']} points; "
          f"{data['summary']['undecided']} maxima undecided")


if __name__ == "__main__":
    main()
