"""The main job: train a GPT on byte-level English text over dp x pp x tp x sp CPU ranks.

Data parallelism over "dp" (OffloadAdam averages the gradients), the message-driven
pipeline (AxoNN) over "pp", and in every stage the transformer layers in one tensor mode
(row: Megatron 1-D, square: SUMMA 2-D, cube: 3-D, subgraph/csub: SUPER) with the sequence
split over "sp" (ring attention). The embedding and head are replicated (gw.models.GPTStage).
Checkpoints hold dense tensors (parameters and optimizer states) under the dense GPT's
names, one file per pipeline stage and a manifest written last, so they load into any grid.
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


def _state_views(stage, opt):
    """OffloadAdam's flat fp32 buffers, viewed per parameter: {kind: {id(p): tensor}}."""
    views, off = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}, 0
    for p in opt.params:
        n = p.numel()
        for kind in views:
            views[kind][id(p)] = getattr(opt, kind)[off:off + n].view(p.shape)
        off += n
    return views


def save_checkpoint(out: Path, step, cfg, grid, stage, opt, losses):
    """Every rank of a stage helps assemble its dense tensors (collectives over tp/sp); the
    stage's first rank writes them (temporary name, then rename); rank 0 writes the manifest
    last, after a barrier, so a manifest always points at complete files."""
    ck = out / "checkpoint"
    if grid.rank == 0:
        ck.mkdir(parents=True, exist_ok=True)
    grid.barrier()
    s = grid.coords["pp"]
    views = _state_views(stage, opt)
    tensors = {"param": stage.dense_state(False)}
    for kind, v in views.items():
        tensors[kind] = stage.dense_state(lambda p, v=v: v[id(p)])
    writer = all(c == 0 for a, c in grid.coords.items() if a != "pp")
    if writer:
        _atomic_save({"stage": s, "tensors": tensors, "optimizer_step": opt.step_count}, ck / f"stage{s}.pt",
                     torch.save)
    grid.barrier()
    if grid.rank == 0:
        manifest = {"step": step, "config": {k: cfg[k] for k in CONFIG_KEYS}, "grid": dict(grid.axes),
                    "files": [f"stage{k}.pt" for k in range(grid.axes["pp"])], "losses": losses,
                    "layout": "dense tensors under the dense GPT's names (gw.models.GPT), for parameters "
                              "and OffloadAdam's master weights and states; one file per pipeline stage"}
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
        for kind, d in blob["tensors"].items():
            tensors.setdefault(kind, {}).update(d)
        step = blob["optimizer_step"]
    return manifest, tensors, step


def run(args) -> dict:
    cfg = dict(vocab=256, hidden=args.hidden, heads=args.heads, layers=args.layers, seq=args.seq, batch=args.batch,
               microbatches=args.microbatches, lr=args.lr, seed=args.seed, steps=args.steps)
    mode, tp = gw.models.parse_tp(args.tp)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp_size = 1 if tp is None else math.prod(n for _, n in tp.axes())
    sp = args.sp
    if sp < 1 or world % (tp_size * sp):
        raise GridError(f"--tp {args.tp} ({tp_size} ranks) x --sp {sp} does not divide the world of {world} ranks")
    rest = world // (tp_size * sp)
    pp = args.pp or (2 if rest % 2 == 0 and cfg["layers"] % 2 == 0 and rest > 1 else 1)
    dp = args.dp or rest // pp
    grid = gw.init(dp=dp, pp=pp, tp=tp, sp=sp, timeout=args.timeout)
    if cfg["layers"] % pp:
        raise GridError(f"{cfg['layers']} layers do not split over {pp} pipeline stages")
    if cfg["batch"] % (dp * cfg["microbatches"]):
        raise GridError(f"batch {cfg['batch']} does not split into {dp} dp shards of {cfg['microbatches']} "
                        "microbatches")
    corpus = gw.data.load_corpus(args.data)
    torch.manual_seed(cfg["seed"])
    model = gw.models.GPT(cfg["vocab"], cfg["hidden"], cfg["heads"], cfg["layers"], cfg["seq"])
    s = grid.coords["pp"]
    stage = gw.models.GPTStage(model, grid, mode, s, pp)
    opt = gw.optim.OffloadAdam(stage.parameters(), lr=cfg["lr"], weight_decay=0.01, bsize=1 << 14, coarsening=4,
                               grid=grid, dp_axis="dp")
    start, losses = 0, []
    if args.resume:
        manifest, tensors, opt_step = load_checkpoint(Path(args.resume))
        if any(manifest["config"][k] != cfg[k] for k in CONFIG_KEYS if k != "steps"):
            raise GridError(f"checkpoint config {manifest['config']} differs from this run's {cfg}")
        stage.load_dense_state(tensors["param"])  # resharded for this grid by each module
        views = _state_views(stage, opt)
        with torch.no_grad():
            for kind, v in views.items():
                local = stage.local_from_dense(tensors[kind])
                for pid, t in v.items():
                    t.copy_(local[pid])
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
    # Fault injection for resilience tests: GRIDWEAVE_FAULT="rank:step" makes that rank
    # die (as a killed process would) when it reaches that step.
    fault = os.environ.get("GRIDWEAVE_FAULT")
    fault_rank, fault_step = (int(v) for v in fault.split(":")) if fault else (-1, -1)
    for step in range(start, cfg["steps"]):
        if grid.rank == fault_rank and step == fault_step:
            os._exit(9)
        t0 = time.perf_counter()
        x, y = gw.data.batch(corpus, step, cfg["seed"], cfg["batch"], cfg["seq"])
        lo = grid.coords["dp"] * shard
        xs = [x[lo + i * mb:lo + (i + 1) * mb] for i in range(cfg["microbatches"])]
        ys = [y[lo + i * mb:lo + (i + 1) * mb] for i in range(cfg["microbatches"])]
        opt.zero_grad()
        loss, _ = gw.pipeline.pipeline_step(stage, grid, xs, ys, model.loss, stage.activation_shape(mb, cfg["seq"]),
                                            schedule=args.schedule, pipeline_limit=max(pp, 2))
        stage.reduce_gradients()
        opt.step()
        # the last stage's loss, identical over its tp/sp group: count one rank of each group
        mine = loss is not None and all(c == 0 for a, c in grid.coords.items() if a not in ("pp", "dp"))
        total = torch.tensor([loss.item() if mine else 0.0], dtype=torch.float64)
        grid.all_reduce(total, axis=None)
        losses.append(total.item() / dp)
        tokens_per_s.append(cfg["batch"] * cfg["seq"] / (time.perf_counter() - t0))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_s[-1]:.0f}")
            bar.update(1)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(out, step + 1, cfg, grid, stage, opt, losses)
    if bar is not None:
        bar.close()
    save_checkpoint(out, cfg["steps"], cfg, grid, stage, opt, losses)
    import resource

    # per-rank memory: parameters held and the peak resident set of the process
    mem = torch.tensor([sum(p.numel() * p.element_size() for p in stage.parameters()),
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    per_rank = grid.all_gather(mem.reshape(1, 2), axis=None)
    metrics = {"loss": losses, "tokens_per_s": tokens_per_s, "config": cfg, "grid": dict(grid.axes),
               "param_bytes_per_rank": [int(v) for v in per_rank[:, 0]],
               "max_rss_bytes_per_rank": [int(v) for v in per_rank[:, 1]]}
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
    return dict(tensors["param"])
