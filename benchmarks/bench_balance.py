"""Work-balanced packed context parallelism against the zigzag, on skewed documents.

    python benchmarks/bench_balance.py      # writes results/balance.json and .png

Packed windows of one long document (half the window, at a random place) among short ones (16 to 64
tokens), causal. For sp = 2, 4, 8 ring members: each member's attention work (the (query, key)
token pairs its ring computes; FLOPs = 4 x head_dim x heads x pairs forward) under
- "zigzag": today's shards, chunks r and 2N-1-r, every causally visible block computed;
- "zigzag-skipping": the same shards, the blocks no document crosses skipped;
- "balanced": gw.documents.balanced_order, the chunks dealt by work, the same blocks skipped;
and the step time of the main job's model (Llama-like, 4 layers, hidden 128) trained on such windows
(gw.train.train_step, --pack-documents) with the balanced order and with the zigzag, at sp 2, where
each rank has a core of its own (more ranks would share the 2 cores, and a rank that waits gives its
core to the others, hiding the imbalance): the two variants alternate step by step in one run, and
their losses are compared (the same mathematics).
"""
from __future__ import annotations

import statistics

from launch import bench_parser, interleaved_rounds, results_dir, run_ranks, save, start_worker

SEQ, LONG, ROWS, SEEDS = 4096, 0.5, 1, 8
RANKS = (2, 4, 8)
TIMED_SP, BATCH, ROUNDS = 2, 2, 8


def skewed(rows, length, long_share, seed):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = torch.empty(rows, length, dtype=torch.int64, device="cpu")
    n_long = int(long_share * length)
    for b in range(rows):
        at = int(torch.randint(0, length - n_long, (1,), generator=g, device="cpu"))
        i, d, placed = 0, 0, False
        while i < length:
            n = n_long if not placed and i >= at else int(torch.randint(16, 65, (1,), generator=g, device="cpu"))
            placed |= n == n_long
            out[b, i:i + n] = d
            i, d = i + n, d + 1
    return out


def work_table() -> list:
    import torch

    from gridweave.documents import balanced_order, member_work

    rows = []
    for n in RANKS:
        for seed in range(SEEDS):
            docs = skewed(ROWS, SEQ, LONG, seed)
            zig = balanced_order(docs, n, True, balance=False)
            per = {"zigzag": member_work(every_block_computed(zig), True),
                   "zigzag-skipping": member_work(zig, True),
                   "balanced": member_work(balanced_order(docs, n, True), True)}
            pairs = int(torch.ones(SEQ, SEQ).tril().mul(
                (docs[0][:, None] == docs[0][None, :]).double()).sum())  # the pairs that attend (one row)
            for variant, w in per.items():
                mean = statistics.mean(w)
                rows.append(dict(ranks=n, seed=seed, variant=variant, work=w, max_over_mean=max(w) / mean,
                                 max_work=max(w), visible_pairs=pairs))
    return rows


def every_block_computed(order):
    """The zigzag as today's ring computes it: every causally visible block, documents or not."""
    import dataclasses

    return dataclasses.replace(order, visible=None)


def worker(out_path: str) -> None:
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import gridweave as gw

    n, rank, store = start_worker()
    variants, losses = {}, {}
    for i, balance in enumerate((True, False)):
        cfg = gw.train.TrainConfig(seq=SEQ, batch=BATCH, microbatches=1, sp=n, dp=1, pp=1, tp="none",
                                   pack_documents=True, balance_documents=balance, attention="ring", offload=False)
        grid = gw.init(dp=1, pp=1, sp=n, store=store, prefix=f"balance-{i}")
        torch.manual_seed(0)
        built = gw.train.build(cfg, grid, cfg.model_config(1024))[1:]
        variants["balanced" if balance else "zigzag"] = (
            lambda batch, cfg=cfg, grid=grid, built=built: float(gw.train.train_step(cfg, grid, *built, *batch)[0]),
            grid)
    batches = []
    for r in range(ROUNDS):
        g = torch.Generator().manual_seed(r)
        x = torch.randint(0, 1024, (BATCH, SEQ), generator=g)
        batches.append((x, x.roll(-1, 1), skewed(BATCH, SEQ, LONG, 100 + r)))
    times, losses = interleaved_rounds(variants, batches)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": times, "losses": losses}))
    gw.shutdown()
    dist.destroy_process_group()


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6))
    for variant in ("zigzag", "zigzag-skipping", "balanced"):
        a.plot(RANKS, [data["summary"][variant][str(n)]["max_over_mean"] for n in RANKS], "o-", label=variant)
    a.axhline(1.1, color="gray", ls=":", label="10% over the mean")
    a.set(xscale="log", xlabel="ring members N", ylabel="busiest rank's work / mean",
          title=f"attention work, one document of {int(LONG * 100)}% among short ones, seq {SEQ}")
    a.set_xticks(RANKS, [str(n) for n in RANKS])
    a.legend()
    t = data["step_time"]
    b.bar(list(t), [statistics.median(v) for v in t.values()])
    b.set(ylabel="median step time (s)", title=f"main job's model, sp {TIMED_SP}, seq {SEQ}, batch {BATCH}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main():
    ap = bench_parser(__file__)
    args = ap.parse_args()
    if args.worker:
        worker(args.out)
        return
    out = results_dir(args)
    rows = work_table()
    summary = {}
    for variant in ("zigzag", "zigzag-skipping", "balanced"):
        summary[variant] = {}
        for n in RANKS:
            rs = [r for r in rows if (r["variant"], r["ranks"]) == (variant, n)]
            summary[variant][str(n)] = {"max_over_mean": max(r["max_over_mean"] for r in rs),
                                        "median_max_over_mean": statistics.median(r["max_over_mean"] for r in rs),
                                        "max_work": statistics.mean(r["max_work"] for r in rs)}
    timed = run_ranks(__file__, TIMED_SP, 29581, out, "balance")
    steps = {k: v[1:] for k, v in timed["times"].items()}  # the first step of each warms up
    data = {"seq": SEQ, "long_share": LONG, "rows": rows, "summary": summary, "step_time": steps,
            "losses": timed["losses"],
            "loss_difference": max(abs(a - b) / abs(b) for a, b in zip(timed["losses"]["balanced"],
                                                                       timed["losses"]["zigzag"])),
            "speedup_balanced_over_zigzag": statistics.median(steps["zigzag"]) / statistics.median(steps["balanced"]),
            "busiest_work_zigzag_over_balanced": {str(n): summary["zigzag"][str(n)]["max_work"]
                                                  / summary["balanced"][str(n)]["max_work"] for n in RANKS}}
    save(out, "balance", data, plot)
    for variant, per in summary.items():
        print(variant, {n: round(v["max_over_mean"], 3) for n, v in per.items()})
    print(f"step time at sp {TIMED_SP}: zigzag {statistics.median(steps['zigzag']):.3f} s, balanced "
          f"{statistics.median(steps['balanced']):.3f} s (x{data['speedup_balanced_over_zigzag']:.2f}); losses within "
          f"{data['loss_difference']:.1e}")


if __name__ == "__main__":
    main()
