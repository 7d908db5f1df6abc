"""The main job: train a GPT on byte-level English text over a dp x pp grid of CPU ranks.

Composition implemented here: data parallelism x the message-driven pipeline (AxoNN) with
the bucketed OffloadAdam. Tensor, sequence and sub-graph axes train through their layers
(gw.nn.TransformerLayer) but are not yet composed into this GPT: asking for them here
gives a clear error (issue 7 continues).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

import gridweave as gw

from .errors import GridError

CONFIG_KEYS = ("vocab", "hidden", "heads", "layers", "seq", "batch", "microbatches", "lr", "seed", "steps")


def _atomic_save(obj, path: Path, writer):
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    writer(obj, tmp)
    os.replace(tmp, path)  # readers see the whole file or none of it


def _json_writer(obj, path):
    Path(path).write_text(json.dumps(obj, indent=1))


def _names(model, stage_layers):
    """Global parameter names (as in the dense GPT) of this stage's parameters."""
    ids = {id(p): n for n, p in model.named_parameters()}
    return [(ids[id(p)], p) for m in stage_layers for p in m.parameters()]


def save_checkpoint(out: Path, step, cfg, grid, model, layers, opt, losses):
    """Each stage (its dp-rank-0 replica) writes its parameters and optimizer state under
    their dense names; the manifest is written last by rank 0, after every shard."""
    ck = out / "checkpoint"
    ck.mkdir(parents=True, exist_ok=True)
    s = grid.coords["pp"]
    if grid.coords["dp"] == 0:
        named = _names(model, layers)
        off, state = 0, {}
        for name, p in named:
            n = p.numel()
            state[name] = {"param": p.detach().clone(), "master": opt.master[off:off + n].clone(),
                           "exp_avg": opt.exp_avg[off:off + n].clone(),
                           "exp_avg_sq": opt.exp_avg_sq[off:off + n].clone()}
            off += n
        _atomic_save({"stage": s, "tensors": state, "optimizer_step": opt.step_count}, ck / f"stage{s}.pt",
                     torch.save)
    grid.barrier()
    if grid.rank == 0:
        manifest = {"step": step, "config": {k: cfg[k] for k in CONFIG_KEYS}, "grid": dict(grid.axes),
                    "files": [f"stage{k}.pt" for k in range(grid.axes["pp"])], "losses": losses,
                    "layout": "every tensor is dense (replicated over dp, one pipeline stage per file)"}
        _atomic_save(manifest, ck / "manifest.json", _json_writer)
    grid.barrier()


def load_checkpoint(path: Path):
    ck = Path(path) / "checkpoint"
    manifest_path = ck / "manifest.json"
    if not manifest_path.exists():
        raise GridError(f"no checkpoint manifest at {manifest_path}")
    manifest = json.loads(manifest_path.read_text())
    tensors, step = {}, 0
    for f in manifest["files"]:
        blob = torch.load(ck / f, weights_only=False)
        tensors.update(blob["tensors"])
        step = blob["optimizer_step"]
    return manifest, tensors, step


def run(args) -> dict:
    cfg = dict(vocab=256, hidden=args.hidden, heads=args.heads, layers=args.layers, seq=args.seq, batch=args.batch,
               microbatches=args.microbatches, lr=args.lr, seed=args.seed, steps=args.steps)
    tp = (args.tp or "none").lower()
    if tp != "none" or args.sp != 1:
        raise GridError(f"gridweave train composes dp x pp today; --tp {tp} / --sp {args.sp} train through "
                        "gw.nn.TransformerLayer but are not yet wired into the GPT of the main job")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = args.pp or (2 if world % 2 == 0 and cfg["layers"] % 2 == 0 and world > 1 else 1)
    dp = args.dp or world // pp
    grid = gw.init(dp=dp, pp=pp, timeout=args.timeout)
    if cfg["layers"] % pp:
        raise GridError(f"{cfg['layers']} layers do not split over {pp} pipeline stages")
    if cfg["batch"] % (dp * cfg["microbatches"]):
        raise GridError(f"batch {cfg['batch']} does not split into {dp} dp shards of {cfg['microbatches']} "
                        "microbatches")
    corpus = gw.data.load_corpus(args.data)
    torch.manual_seed(cfg["seed"])
    model = gw.models.GPT(cfg["vocab"], cfg["hidden"], cfg["heads"], cfg["layers"], cfg["seq"])
    s = grid.coords["pp"]
    layers = model.stage_layers(s, pp)
    stage = torch.nn.Sequential(*layers)
    opt = gw.optim.OffloadAdam(stage.parameters(), lr=cfg["lr"], weight_decay=0.01, bsize=1 << 14, coarsening=4,
                               grid=grid, dp_axis="dp")
    start, losses = 0, []
    if args.resume:
        manifest, tensors, opt_step = load_checkpoint(Path(args.resume))
        if any(manifest["config"][k] != cfg[k] for k in CONFIG_KEYS if k != "steps"):
            raise GridError(f"checkpoint config {manifest['config']} differs from this run's {cfg}")
        off = 0
        with torch.no_grad():
            for name, p in _names(model, layers):
                t, n = tensors[name], p.numel()
                p.copy_(t["param"])
                opt.master[off:off + n] = t["master"]
                opt.exp_avg[off:off + n] = t["exp_avg"]
                opt.exp_avg_sq[off:off + n] = t["exp_avg_sq"]
                off += n
        opt.step_count = opt_step
        start, losses = manifest["step"], list(manifest["losses"])
    out = Path(args.out)
    if grid.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    shard = cfg["batch"] // dp
    mb = shard // cfg["microbatches"]
    bar = None
    if grid.rank == 0 and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=cfg["steps"], initial=start, desc="train", unit="step")
    tokens_per_s = []
    for step in range(start, cfg["steps"]):
        t0 = time.perf_counter()
        x, y = gw.data.batch(corpus, step, cfg["seed"], cfg["batch"], cfg["seq"])
        lo = grid.coords["dp"] * shard
        xs = [x[lo + i * mb:lo + (i + 1) * mb] for i in range(cfg["microbatches"])]
        ys = [y[lo + i * mb:lo + (i + 1) * mb] for i in range(cfg["microbatches"])]
        opt.zero_grad()
        loss, _ = gw.pipeline.pipeline_step(stage, grid, xs, ys, model.loss, (mb, cfg["seq"], cfg["hidden"]),
                                            schedule=args.schedule, pipeline_limit=max(pp, 2))
        opt.step()
        total = torch.tensor([loss.item() if loss is not None else 0.0], dtype=torch.float64)
        grid.all_reduce(total, axis=None)
        losses.append(total.item() / dp)
        tokens_per_s.append(cfg["batch"] * cfg["seq"] / (time.perf_counter() - t0))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_s[-1]:.0f}")
            bar.update(1)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(out, step + 1, cfg, grid, model, layers, opt, losses)
    if bar is not None:
        bar.close()
    save_checkpoint(out, cfg["steps"], cfg, grid, model, layers, opt, losses)
    metrics = {"loss": losses, "tokens_per_s": tokens_per_s, "config": cfg, "grid": dict(grid.axes)}
    if grid.rank == 0:
        _atomic_save(metrics, out / "metrics.json", _json_writer)
        _plot(losses, out / "loss.png")
    gw.shutdown()
    return metrics


def _plot(losses, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.axhline(math.log(256), color="gray", ls=":", lw=1, label="uniform over bytes")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="gridweave train")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def export_dense(path) -> dict:
    """The whole model of a checkpoint as a dense torch state_dict (gw.models.GPT names)."""
    _, tensors, _ = load_checkpoint(Path(path))
    return {k: v["param"] for k, v in tensors.items()}
