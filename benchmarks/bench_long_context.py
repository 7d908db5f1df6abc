"""A long-context run: the main job's model at 16 times its context on 8 CPU ranks, the whole model on
sequence shards (Li et al.), and its memory per rank beside tensor parallelism's at that length.

    python benchmarks/bench_long_context.py      # writes results/long_context.json and .png

1. `gridweave train` with --seq 2048 (the main job's is 128), sp 8 (the zigzag ring), activation
   checkpointing (AxoNN's optimal factor), on the fortunes corpus: it trains and validates; its
   losses, validation loss and speed come from its metrics.json.
2. One training step of the same model, batch and length on 8 ranks under each grid, each rank's
   peak resident memory over its resident memory before the build (bench_seq_memory's accounting):
   sp 8 with the ring, with USP (Ulysses over 4, the ring across 2: the model's 4 key/value heads
   sent as they are) and with the ring without checkpointing; and the most tensor parallelism the
   model takes (its 4 key/value heads: tp row:4, dp 2 for the other ranks), with and without
   Megatron's sequence parallelism, checkpointed alike.
3. Ulysses under grouped-query attention (32 query, 8 key/value heads, 8 ranks): the bytes a rank
   sends and its peak memory with the key/value heads sent as they are, against repeated first.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launch import bench_parser, peak_growth_per_rank, results_dir, run_ranks, save, start_worker

SEQ, BATCH, STEPS, RANKS = 2048, 8, 150, 8
VOCAB = 1024  # the main job's tokenizer's
GQA_HEADS, GQA_KV, GQA_SEQ = 32, 8, 1 << 14  # Ulysses under grouped-query attention: 8 of 32 heads sent
GRIDS = {"sp8-ring-ac": dict(tp="none", sp=8, dp=1, attention="ring", ac="auto"),
         "sp8-usp4x2-ac": dict(tp="none", sp=8, dp=1, attention="usp", ulysses_degree=4, ac="auto"),
         "sp8-ring": dict(tp="none", sp=8, dp=1, attention="ring", ac=1),
         "tp4-dp2-ac": dict(tp="row:4", sp=1, dp=2, ac="auto"),
         "tpsp4-dp2-ac": dict(tp="row:4", tp_sp=True, sp=1, dp=2, ac="auto")}


def job(name):
    import gridweave as gw

    return gw.train.TrainConfig(seq=SEQ, batch=BATCH, microbatches=1, pp=1, offload=False, **GRIDS[name])


def worker(out_path: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import gridweave as gw

    n, rank, store = start_worker()
    results = {}
    for i, name in enumerate(GRIDS):
        cfg = job(name)
        grid = gw.init(dp=cfg.dp, pp=1, tp=cfg.mode, sp=cfg.sp, store=store, prefix=f"longctx-{i}")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        rows = slice(grid.coords["dp"] * (BATCH // cfg.dp), (grid.coords["dp"] + 1) * (BATCH // cfg.dp))
        x, y = ids[rows], ids.roll(1, 1)[rows]
        built = []

        def build():
            torch.manual_seed(0)
            built[:] = gw.train.build(cfg, grid, cfg.model_config(VOCAB))[1:]

        def step():
            gw.train.train_step(cfg, grid, *built, x, y)

        def drop():
            built.clear()
            gc.collect()

        results[name] = peak_growth_per_rank(build, step, drop, 1)
        drop()
        grid.shutdown()
    results["gqa"] = gqa_exchange(store, gw)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    gw.shutdown()
    dist.destroy_process_group()


def gqa_exchange(store, gw) -> dict:
    """Ulysses over the 8 ranks (dividing the key/value heads: they cross as they are) on a
    GQA_HEADS-head, GQA_KV-key/value-head layer's q, k, v of one
    sequence of GQA_SEQ (forward and backward): the bytes a rank sends and its peak resident
    growth with the key/value heads sent as they are (repeated only to lcm(kv, N)) and with them
    repeated to the query heads first (what Ulysses sent before)."""
    import torch

    from gridweave import calibrate
    from gridweave.autograd.ulysses import ulysses_attention

    grid = gw.init(sp=RANKS, store=store, prefix="longctx-gqa")
    out = {}
    local = GQA_SEQ // RANKS
    for expand in (False, True, False, True):  # the first two warm up (first-time allocations)
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, GQA_HEADS, local, 16, generator=g)
        k, v = (torch.randn(1, GQA_KV, local, 16, generator=g) for _ in range(2))
        with calibrate.resident_accounting():
            calibrate.restart_peak()
            base = calibrate.resident_bytes()
            grid.reset_stats()
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            kk, vv = ((t.repeat_interleave(GQA_HEADS // GQA_KV, dim=1) for t in (kl, vl)) if expand else (kl, vl))
            o = ulysses_attention(ql, kk, vv, grid, "sp", causal=True)
            o.sum().backward()
            peak = calibrate.peak_resident_bytes() - base
        s = grid.stats()["sp"]
        out["repeated" if expand else "as_is"] = {"sent_bytes": s["sent_intra"]["bytes"] + s["sent_inter"]["bytes"],
                                                        "peak_bytes": peak}
    grid.shutdown()
    return out


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.8))
    run = data["run"]
    a.plot(range(1, len(run["loss"]) + 1), run["loss"], label="training loss")
    if run["val_loss"]:
        a.plot([v[0] for v in run["val_loss"]], [v[1] for v in run["val_loss"]], "o-", label="validation loss")
    a.axhline(run["unigram_entropy_val"], color="gray", ls=":", label="unigram entropy")
    a.set(xlabel="step", ylabel="nats/token", title=f"seq {SEQ} (16x the main job's) on sp 8 (ring, ac)")
    a.legend()
    names = list(data["memory_mib"])
    b.barh(names, [max(data["memory_mib"][k]) for k in names])
    b.set(xlabel="peak MiB a rank (the step's growth)", title=f"one step, seq {SEQ}, batch {BATCH}, 8 ranks")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main():
    ap = bench_parser(__file__)
    ap.add_argument("--memory-only", action="store_true", help="measure the memory again, keep the run's figures")
    args = ap.parse_args()
    if args.worker:
        worker(args.out)
        return
    out = results_dir(args)
    folder = Path("/tmp") / "gridweave_long_context_run"  # its checkpoints stay out of the results
    cmd = [sys.executable, "-m", "gridweave.cli", "train", "--seq", str(SEQ), "--sp", "8", "--dp", "1", "--pp", "1",
           "--attention", "ring", "--ac", "auto", "--batch", str(BATCH), "--microbatches", "1", "--steps", str(STEPS),
           "--val-every", "50", "--val-samples", "16", "--out", str(folder)]
    if args.memory_only:  # the run's figures as the last full run wrote them
        m = json.loads((out / "long_context.json").read_text())["run"]
    else:
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
        m = json.loads((folder / "metrics.json").read_text())
    memory = run_ranks(__file__, RANKS, 29571, out, "longctx")
    data = {"seq": SEQ, "default_seq": 128, "batch": BATCH, "ranks": RANKS, "command": cmd[2:],
            "run": {k: m[k] for k in ("loss", "val_loss", "unigram_entropy_val", "tokens_per_s", "grid", "config")},
            "memory_mib": {k: [v / 2 ** 20 for v in vs] for k, vs in memory.items() if k != "gqa"},
            "gqa": {"heads": GQA_HEADS, "kv_heads": GQA_KV, "seq": GQA_SEQ, **memory["gqa"]},
            "grids": GRIDS}
    save(out, "long_context", data, plot)
    for k, vs in data["memory_mib"].items():
        print(f"{k:24s} peak {max(vs):7.1f} MiB a rank")
    print(f"final loss {m['loss'][-1]:.3f}, validation {m['val_loss'][-1] if m['val_loss'] else None}")
    print("Ulysses under GQA:", data["gqa"])


if __name__ == "__main__":
    main()
