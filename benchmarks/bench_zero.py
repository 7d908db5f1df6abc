"""Issue 30: sharded data parallelism against torch's own FSDP2, side by side in one run.

    python benchmarks/bench_zero.py        # 4 CPU ranks (torchrun + Gloo): results/zero.json and .png

The main job's Llama (hidden 256, 8 heads / 4 kv heads, 4 layers, seq 128, global batch 16) on
dp 4, the same weights and batches: gridweave's optimizer at ZeRO stages 0, 1, 2, 3 (the state on
the device: gw.optim.DistributedAdam), AxoNN's OffloadAdam (the main job's default), and torch's
FSDP2 (fully_shard per transformer layer and the root, torch.optim.AdamW, clip_grad_norm_). Every
variant's step (forward, backward, reduction, clipping, update) is timed in rounds, one variant
after the other, so they share the machine alike; tokens/s is the global batch's tokens over the
median step. Memory per rank: the bytes of parameters, gradients and optimizer state held after
a step (each storage once; FSDP2's DTensor shards, its optimizer's states). The losses of every
variant are compared with FSDP2's (the same model and data: they must agree).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch import (bench_parser, interleaved_rounds, results_dir, run_ranks, save, start_worker,  # noqa: E402
                    torch_held_bytes)

SIZES = dict(model="llama", hidden=256, heads=8, layers=4, seq=128, batch=16, microbatches=1, tokenizer="bytes",
             lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
ROUNDS, WARMUP = 8, 2


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gridweave as gw

    n, rank, store = start_worker()
    cfg0 = gw.train.TrainConfig(**SIZES, dp=n, pp=1)
    model_cfg = cfg0.model_config(256)
    shard = cfg0.batch // n
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (cfg0.batch, cfg0.seq + 1), generator=g) for _ in range(ROUNDS)]
    mine = [b[rank * shard:(rank + 1) * shard] for b in batches]

    variants = {}
    for name, extra in (("gridweave zero 0", dict(zero=0, offload=False)),
                        ("gridweave zero 1", dict(zero=1, offload=False)),
                        ("gridweave zero 2", dict(zero=2, offload=False)),
                        ("gridweave zero 3", dict(zero=3, offload=False)),
                        ("gridweave OffloadAdam (AxoNN)", dict(zero=0, offload=True))):
        cfg = gw.train.TrainConfig(**SIZES, dp=n, pp=1, **extra)
        grid = gw.init(dp=n, store=store, prefix=f"zero-{len(variants)}")
        torch.manual_seed(cfg.seed)
        _, stage, opt, scaler = gw.train.build(cfg, grid, model_cfg)

        def step(b, cfg=cfg, grid=grid, stage=stage, opt=opt, scaler=scaler):
            return gw.train.train_step(cfg, grid, stage, opt, scaler, b[:, :-1], b[:, 1:])[0]

        variants[name] = (step, lambda stage=stage, opt=opt: gw.optim.held_bytes(list(stage.parameters()), opt))

    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(cfg0.seed)
    dense = gw.models.build(model_cfg)
    for layer in dense.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(dense, mesh=mesh)
    params = list(dense.parameters())
    adamw = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                              lr=cfg0.lr, weight_decay=cfg0.weight_decay, eps=1e-8)

    def fsdp_step(b):
        adamw.zero_grad()
        loss = dense.loss(dense(b[:, :-1]), b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), cfg0.max_grad_norm)
        adamw.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        return t.item() / n

    variants["torch FSDP2 (fully_shard)"] = (fsdp_step, lambda: torch_held_bytes(dense, adamw))

    times, losses = interleaved_rounds(variants, mine)
    held = {}
    for name, (_, measure) in variants.items():
        mem = torch.tensor([float(v) for v in measure().values()], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the largest rank's holdings
        held[name] = dict(zip(("parameters", "gradients", "optimizer", "optimizer_buffers"), map(int, mem.tolist())))
    if rank == 0:
        ref = losses["torch FSDP2 (fully_shard)"]
        rows = [{"variant": name, "step_s": statistics.median(t[WARMUP:]),
                 "tokens_per_s": cfg0.batch * cfg0.seq / statistics.median(t[WARMUP:]), "memory_bytes": held[name],
                 "losses": losses[name],
                 "max_rel_loss_diff_vs_fsdp2": max(abs(a - b) / abs(b) for a, b in zip(losses[name], ref))}
                for name, t in times.items()]
        Path(args.out).write_text(json.dumps({"ranks": n, "model": model_cfg.to_dict(), "sizes": SIZES,
                                              "rounds": ROUNDS, "warmup": WARMUP, "rows": rows}))
    gw.shutdown()
    dist.destroy_process_group()


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    names = [r["variant"].replace("gridweave ", "gw ").replace(" (fully_shard)", "").replace(" (AxoNN)", "")
             for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.barh(names, [r["tokens_per_s"] for r in rows])
    a.set(xlabel="tokens/s (global batch, median step)", title=f"{data['ranks']} CPU ranks, dp {data['ranks']}")
    left = [0.0] * len(rows)
    for kind in ("parameters", "gradients", "optimizer", "optimizer_buffers"):
        vals = [r["memory_bytes"][kind] / 2 ** 20 for r in rows]
        b.barh(names, vals, left=left, label=kind)
        left = [x + y for x, y in zip(left, vals)]
    b.set(xlabel="MiB per rank held after a step (largest rank)", title="parameters, gradients, optimizer state")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main():
    ap = bench_parser(__file__)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = results_dir(args)
    data = run_ranks(__file__, 4, 29931, out, "zero")
    save(out, "zero", data, plot)
    for r in data["rows"]:
        mem = sum(r["memory_bytes"].values()) / 2 ** 20
        print(f"{r['variant']:34s} {r['tokens_per_s']:9.0f} tok/s  {mem:7.2f} MiB  "
              f"loss diff vs FSDP2 {r['max_rel_loss_diff_vs_fsdp2']:.2e}")


if __name__ == "__main__":
    main()
