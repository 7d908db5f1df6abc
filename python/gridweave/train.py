"""The main job: train a GPT on byte-level English text over dp x pp x tp x sp CPU ranks.

Data parallelism over "dp" (OffloadAdam sums each gradient over its placement's partial
axes, dp pre-divided so the sum is the mean), the message-driven
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import gridweave as gw

from .errors import GridError
from .modes import Mode, parse
from .precision import LossScaler, Precision

CONFIG_KEYS = ("vocab", "hidden", "heads", "layers", "seq", "batch", "microbatches", "lr", "seed", "steps")


@dataclass
class TrainConfig:
    """Everything the main job takes (the command line fills one: gridweave train --help).
    dp / pp of 0: chosen from the world size (pp 2 when it divides, the rest dp)."""
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 64
    batch: int = 16
    microbatches: int = 2
    lr: float = 3e-3
    seed: int = 0
    steps: int = 50
    vocab: int = 256
    dp: int = 0
    pp: int = 0
    tp: Mode | str | None = None
    sp: int = 1
    data: str | None = None
    out: str = "runs/latest"
    resume: str | None = None
    schedule: str = "message_driven"
    precision: str = "fp32"
    device: str = "auto"
    backend: str = "auto"
    checkpoint_every: int = 0
    max_grad_norm: float | None = None
    timeout: float = 120.0
    quiet: bool = False
    mode: Mode = field(init=False, repr=False)
    compute: Precision = field(init=False, repr=False)

    def __post_init__(self):
        self.mode = self.tp if isinstance(self.tp, Mode) else parse(self.tp or "none")
        self.compute = Precision.parse(self.precision)
        if self.device not in ("auto", "cpu", "cuda"):
            raise GridError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.backend not in ("auto", "gloo", "nccl", "mpi"):
            raise GridError(f"backend must be auto, gloo, nccl or mpi, got {self.backend!r}")
        for name in ("hidden", "heads", "layers", "seq", "batch", "microbatches", "steps", "vocab", "sp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"{name} must be a positive integer, got {v!r}")
        for name in ("dp", "pp", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise GridError(f"{name} must be a non-negative integer, got {v!r}")
        if not self.lr > 0 or not self.timeout > 0:
            raise GridError(f"lr and timeout must be positive, got {self.lr!r} and {self.timeout!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise GridError(f"max_grad_norm must be positive, got {self.max_grad_norm!r}")
        if self.schedule not in gw.pipeline.SCHEDULES:
            raise GridError(f"schedule must be one of {sorted(gw.pipeline.SCHEDULES)}, got {self.schedule!r}")

    def model_config(self) -> dict:
        return {k: getattr(self, k) for k in CONFIG_KEYS}


def _atomic_save(obj, path: Path, writer):
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    writer(obj, tmp)
    os.replace(tmp, path)  # readers see the whole file or none of it


def _json_writer(obj, path):
    Path(path).write_text(json.dumps(obj, indent=1))


def _state_views(opt):
    """OffloadAdam's state per parameter (its state_dict): {kind: {id(p): tensor}}."""
    state = opt.state_dict()["state"]
    return {kind: {id(p): state[i][kind] for i, p in enumerate(opt.params)} for kind in opt.STATE_KEYS}


def save_checkpoint(out: Path, step, cfg, grid, stage, opt, losses):
    """Every rank of a stage helps assemble its dense tensors (collectives over tp/sp); the
    stage's first rank writes them (temporary name, then rename); rank 0 writes the manifest
    last, after a barrier, so a manifest always points at complete files."""
    ck = out / "checkpoint"
    if grid.rank == 0:
        ck.mkdir(parents=True, exist_ok=True)
    grid.barrier()
    s = grid.coords["pp"]
    views = _state_views(opt)
    tensors = {"param": stage.dense_state(False)}
    for kind, v in views.items():
        tensors[kind] = stage.dense_state(lambda p, v=v: v[id(p)])
    writer = all(c == 0 for a, c in grid.coords.items() if a != "pp")
    if writer:
        _atomic_save({"stage": s, "tensors": tensors, "optimizer_step": opt.step_count}, ck / f"stage{s}.pt",
                     torch.save)
    grid.barrier()
    if grid.rank == 0:
        manifest = {"step": step, "config": cfg.model_config(), "grid": dict(grid.axes),
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


@dataclass
class StepState:
    """What a per-step hook sees: the grid, this rank's stage, its optimizer and loss scaler."""
    grid: "gw.Grid"
    stage: torch.nn.Module
    optimizer: "gw.optim.OffloadAdam"
    scaler: LossScaler | None


def run(cfg: TrainConfig, on_step: Callable[[int, StepState], None] | None = None) -> dict:
    """Train as `cfg` says; on_step(step, state), if given, is called at the start of each step
    (progress hooks, profilers; the tests' fault injection)."""
    if not isinstance(cfg, TrainConfig):
        raise GridError(f"train.run takes a gw.train.TrainConfig, got {type(cfg).__name__}")
    mode = cfg.mode
    world = gw.launch.launched_world_size(cfg.backend)
    tp_size = mode.ranks()
    sp = cfg.sp
    if world % (tp_size * sp):
        raise GridError(f"--tp {mode.spec()} ({tp_size} ranks) x --sp {sp} does not divide the world of {world} "
                        "ranks")
    rest = world // (tp_size * sp)
    pp = cfg.pp or (2 if rest % 2 == 0 and cfg.layers % 2 == 0 and rest > 1 else 1)
    dp = cfg.dp or rest // pp
    # auto: gw.init picks NCCL on one GPU per rank when it can, else Gloo on the CPU; cuda with
    # fewer GPUs than ranks shares them through Gloo. Every check is before the rendezvous.
    device = None if cfg.device == "auto" else cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        raise GridError("--device cuda was asked for but this process sees no CUDA GPU "
                        "(torch.cuda.is_available() is False); use --device cpu")
    if device == "cuda":
        cfg.compute.check_device(torch.device("cuda", torch.cuda.current_device()))
    grid = gw.init(dp=dp, pp=pp, tp=mode, sp=sp, timeout=cfg.timeout, device=device, backend=cfg.backend)
    if cfg.layers % pp:
        raise GridError(f"{cfg.layers} layers do not split over {pp} pipeline stages")
    if cfg.batch % (dp * cfg.microbatches):
        raise GridError(f"batch {cfg.batch} does not split into {dp} dp shards of {cfg.microbatches} microbatches")
    corpus = gw.data.load_corpus(cfg.data)
    torch.manual_seed(cfg.seed)
    # initialised in fp32 (the same weights whatever the precision), then cast
    model = gw.models.GPT(cfg.vocab, cfg.hidden, cfg.heads, cfg.layers, cfg.seq, device=grid.device)
    model = model.to(cfg.compute.dtype)
    s = grid.coords["pp"]
    stage = gw.models.GPTStage(model, grid, mode, s, pp)
    opt = gw.optim.OffloadAdam(stage.parameters(), lr=cfg.lr, weight_decay=0.01, bsize=1 << 14, coarsening=4,
                               grid=grid, max_grad_norm=cfg.max_grad_norm)
    scaler = LossScaler() if cfg.compute.loss_scaling else None
    start, losses = 0, []
    if cfg.resume:
        manifest, tensors, opt_step = load_checkpoint(Path(cfg.resume))
        mine = cfg.model_config()
        if any(manifest["config"][k] != mine[k] for k in CONFIG_KEYS if k != "steps"):
            raise GridError(f"checkpoint config {manifest['config']} differs from this run's {mine}")
        stage.load_dense_state(tensors["param"])  # resharded for this grid by each module
        state = {i: {"step": torch.tensor(float(opt_step), device="cpu")} for i in range(len(opt.params))}
        for kind in opt.STATE_KEYS:
            local = stage.local_from_dense(tensors[kind])
            for i, p in enumerate(opt.params):
                state[i][kind] = local[id(p)]
        opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
        start, losses = manifest["step"], list(manifest["losses"])
    out = Path(cfg.out)
    if grid.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    shard = cfg.batch // dp
    mb = shard // cfg.microbatches
    bar = None
    if grid.rank == 0 and not cfg.quiet:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step")
    tokens_per_s = []
    for step in range(start, cfg.steps):
        if on_step is not None:
            on_step(step, StepState(grid, stage, opt, scaler))
        t0 = time.perf_counter()
        x, y = gw.data.batch(corpus, step, cfg.seed, cfg.batch, cfg.seq)
        lo = grid.coords["dp"] * shard
        xs = [x[lo + i * mb:lo + (i + 1) * mb].to(grid.device) for i in range(cfg.microbatches)]
        ys = [y[lo + i * mb:lo + (i + 1) * mb].to(grid.device) for i in range(cfg.microbatches)]
        opt.zero_grad()
        loss_scale = scaler.scale_value if scaler is not None else 1.0

        def loss_fn(logits, targets):  # in fp32 whatever the model computes in; fp16 scaled up
            return model.loss(logits.float(), targets) * loss_scale

        loss, _ = gw.pipeline.pipeline_step(stage, grid, xs, ys, loss_fn, stage.activation_shape(mb, cfg.seq),
                                            dtype=cfg.compute.dtype, schedule=cfg.schedule,
                                            pipeline_limit=max(pp, 2))
        loss = loss / loss_scale if loss is not None else None
        opt.step(scaler)  # sums each gradient over its partial axes (dp averaged), then updates
        # the last stage's loss, identical over its tp/sp group: count one rank of each group
        mine = loss is not None and all(c == 0 for a, c in grid.coords.items() if a not in ("pp", "dp"))
        total = torch.tensor([loss.item() if mine else 0.0], dtype=torch.float64, device=grid.device)
        grid.all_reduce(total, axis=None)
        losses.append(total.item() / dp)
        tokens_per_s.append(cfg.batch * cfg.seq / (time.perf_counter() - t0))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_s[-1]:.0f}")
            bar.update(1)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(out, step + 1, cfg, grid, stage, opt, losses)
    if bar is not None:
        bar.close()
    save_checkpoint(out, cfg.steps, cfg, grid, stage, opt, losses)
    import resource

    # per-rank memory: parameters held and the peak resident set of the process
    mem = torch.tensor([sum(p.numel() * p.element_size() for p in stage.parameters()),
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64,
                       device=grid.device)
    per_rank = grid.all_gather(mem.reshape(1, 2), axis=None)
    metrics = {"loss": losses, "tokens_per_s": tokens_per_s, "config": cfg.model_config(), "grid": dict(grid.axes),
               "backend": grid.backend, "device": str(grid.device), "precision": cfg.compute.name,
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
