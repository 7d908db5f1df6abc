"""The main job: train a Llama-style model (or the GPT) on a tokenized text corpus over
dp x pp x tp x sp ranks.

Data parallelism over "dp" (OffloadAdam sums each gradient over its placement's partial
axes, dp pre-divided so the sum is the mean), the message-driven pipeline (AxoNN) over "pp",
and in every stage the transformer layers in one tensor mode (row: Megatron 1-D with the
vocab-parallel embedding, head and loss; square: SUMMA 2-D; cube: 3-D; subgraph/csub: SUPER)
with the sequence split over "sp" (ring attention). The data: a byte-level BPE tokenizer
trained on the corpus, the corpus tokenized once into a memory-mapped file, a train /
validation split, each dp rank reading its own samples (data). The loop: warmup + cosine
learning rate, global-norm clipping, activation checkpointing, validation every K steps,
tokens/s and model-FLOPs utilisation. Checkpoints are sharded (checkpoint): each rank
writes its own shards, the index (with the reader's position) is written last, any grid
loads them, and nothing in them is executed.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import checkpoint, data, float8, launch, loggers, models, optim, pipeline, plan, runfolder
from .config import AUTO, TrainConfig
from .errors import Diverged, GridError
from .generate import sample
from .autogrid import chosen_grid
from .grid import Grid, init, rendezvous_store, shutdown
from .measure import HostReads, StepPhases, StragglerDetector, gemm_rate, probe_size, timed
from .models import ModelConfig
from .nn.moe import routed_tokens, set_aux_grad_scale, set_moe_overlap, update_expert_bias
from .precision import LossScaler, Precision
from .sharding import first_copy

# What a resumed run must share with its checkpoint (the model, the data order).
RESUME_KEYS = ("model", "tokenizer", "seq", "batch", "seed")

# Nominal dense peak FLOP/s per GPU and compute dtype (vendor data sheets), for MFU; fp8's is the
# float8 tensor cores' (the A100 has none: float8.check_device refuses it first)
GPU_PEAK = {"H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp64": 67e12, "fp8": 1979e12},
            "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp64": 67e12, "fp8": 1979e12},
            "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "fp64": 19.5e12}}


def save_checkpoint(out: Path, step, cfg, grid, stage, opt, losses, reader=None, model_cfg=None, val=None,
                    wait=True, scaler=None):
    """A sharded checkpoint (checkpoint): every rank writes the shards of the parameters
    and optimizer states it counts, no gathers; rank 0 writes the index last. wait=False:
    written in the background; returns the PendingSave to finish() (every rank) later."""
    held = opt.checkpoint_tensors()  # whole tensors, or the pieces of ZeRO shards this rank holds

    def tensors_of(p):
        return held[id(p)]

    # never a checkpoint holding a non-finite tensor: one decision on every rank before any write
    finite = all(bool(torch.isfinite(t.values if isinstance(t, checkpoint.FlatSlice) else t).all())
                 for v in held.values() for t in v.values())
    if grid.any(not finite):
        raise Diverged(f"not writing the checkpoint of step {step} to {out / 'checkpoint'}: "
                       f"{'this rank' if not finite else 'another rank'} holds non-finite parameters or optimizer "
                       "state (the previous checkpoint is untouched)")
    extra = {"optimizer_step": opt.step_count, "config": cfg.run_config(model_cfg), "losses": losses,
             "biases": _biases(stage, grid),
             "val": val or [], "reader": reader.state_dict() if reader else None,
             "loss_scaler": scaler.state_dict() if scaler is not None else None,
             "layout": "KIND/NAME: the dense model's names (models.GPT / Llama); KIND param or OffloadAdam's "
                       "master, exp_avg, exp_avg_sq; each chunk a block of the stored tensor (transposed and "
                       "row order as recorded)"}
    return checkpoint.save(out / "checkpoint", step, stage.sharded_items(), grid, tensors_of, extra, wait=wait)


def _biases(stage, grid) -> dict:
    """Every stage's balancing biases (DeepSeek-V3's) by dense name, as JSON numbers (a float32
    prints exactly; collective over pp): the index keeps them, being replicated and small."""
    mine = {name: b.tolist() for name, b in stage.balancing_biases()}
    if grid.axes.get("pp", 1) == 1:
        return mine
    return {k: v for part in grid.all_gather_json(mine, "pp") for k, v in part.items()}


def load_checkpoint(path: Path):
    """The run state of a run folder's newest complete checkpoint (its index), checked."""
    return checkpoint.open_index(Path(path) / "checkpoint")[1]


def load_model(run_dir, dtype=torch.float32, device="cpu"):
    """(dense model, tokenizer, index) of a run folder: the checkpoint of any grid, read in
    one process tensor by tensor."""
    run_dir = Path(run_dir)
    index = load_checkpoint(run_dir)
    cfg = ModelConfig.from_dict(index["config"]["model"])
    model = models.build(cfg, dtype=dtype, device=device)
    state = checkpoint.export_dense(run_dir / "checkpoint")
    state.update({name: torch.tensor(v, device=device) for name, v in index.get("biases", {}).items()})
    if cfg.tie:
        state.pop("head.out.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie and k == "head.out.weight")]
    if missing or unexpected:
        raise GridError(f"checkpoint {run_dir} does not match its model config: missing {missing}, "
                        f"unexpected {unexpected}")
    return model.to(dtype), data.load_tokenizer(run_dir / data.TOKENIZER_FILE), index


@dataclass
class StepState:
    """What a per-step hook sees: the grid, this rank's stage, its optimizer and loss scaler, and
    the configuration as it runs (grid auto's choice made, the schedule and offload decided)."""
    grid: "Grid"
    stage: torch.nn.Module
    optimizer: "optim.GridOptimizer"
    scaler: LossScaler | None
    config: TrainConfig | None = None


def model_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token of the model (ModelConfig.flops_per_token: MFU's numerator)."""
    return m.flops_per_token()


def peak_flops(grid, precision: str) -> tuple:
    """(this rank's share of its machine's peak FLOP/s, how it was found). A GPU: its datasheet's
    dense peak. A CPU: one thread's float32 GEMM rate, measured by one rank of each node while the
    node's other ranks wait (best of three windows: never under contention, so no step can beat
    it and MFU stays at most 1), times the threads the node's ranks can run at once (its cores),
    shared among its ranks."""
    n = probe_size(grid.device, "gemm")

    def best() -> float:  # the best of three windows: a rate no step beats
        return max(gemm_rate(n, 0.05, grid.device) for _ in range(3))

    if grid.device.type == "cuda":
        name = torch.cuda.get_device_name(grid.device)
        kind = "fp8" if Precision.parse(precision).float8 is not None else precision  # either recipe
        for key, peaks in GPU_PEAK.items():
            if key in name and kind in peaks:
                return peaks[kind], f"nominal {key} {kind}"
        grid.barrier()  # a GPU without a datasheet entry: its float32 GEMM, every rank on its own GPU
        return best(), f"measured float32 GEMM ({n}^3) of the GPU"
    node = grid.node_of(grid.rank)
    here = [r for r in range(grid.world_size) if grid.node_of(r) == node]
    threads = torch.get_num_threads()
    grid.barrier()
    rate = best() / threads if grid.rank == here[0] else 0.0
    # the node's measurement, made alone, and the cores its ranks may run on (each rank's may be pinned)
    every = grid.all_gather_json([rate, sorted(os.sched_getaffinity(0))])
    cores = set().union(*(every[r][1] for r in here))
    usable = min(len(here) * threads, len(cores))
    return every[here[0]][0] * usable / len(here), (f"float32 GEMM ({n}^3) of one thread, measured alone, x "
                                                    f"{usable} threads a node")


RESTARTS = "restarts.jsonl"  # in the run folder: one line a restart (metrics.json's restarts)
WORLD = "world.json"  # in the run folder: the world and grid of the job's latest start


def _degrees(axes) -> str:  # as a checkpoint records a grid (save_checkpoint's "grid")
    return ",".join(f"{k}={axes[k]}" for k in ("dp", "pp", "sp") if k in axes)


def note_world(out: Path, grid) -> None:
    """This start's world and grid, for the next start to compare with (rank 0, written whole)."""
    text = json.dumps({"world_size": grid.world_size, "grid": dict(grid.axes)})
    checkpoint.atomic_write(out / WORLD, lambda tmp: tmp.write_text(text))


def world_before(run: Path, manifest: dict) -> dict:
    """The world and grid the job last ran on: the run folder's latest start (note_world), else
    its checkpoint's. They differ when a world ended before it saved (an elastic job grown back
    before the shrunk world's first checkpoint)."""
    path = run / WORLD
    return json.loads(path.read_text()) if path.exists() else manifest


def note_restart(out: Path, grid, cfg: TrainConfig, manifest: dict, before: dict) -> dict:
    """A job resumed on another world than the one it last ran on (rank 0; an elastic restart):
    the change, appended to out/RESTARTS: torch's restart count, the step it continues from (the
    checkpoint's), the world and grid it ran on and runs on now, and the seconds since the last
    step logged before (the time lost, the redone steps aside)."""
    log = out / loggers.FOLDER / loggers.JSON_LOG
    record = {"restart": launch.restart_count(), "step": int(manifest["step"]),
              "previous_world": before.get("world_size"), "previous_grid": _degrees(before.get("grid") or {}),
              "world": grid.world_size, "grid": _degrees(grid.axes), "tp": cfg.mode.spec(),
              "seconds_lost": time.time() - log.stat().st_mtime if log.exists() else None}
    with open(out / RESTARTS, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def restarts(out: Path) -> list:
    """The restarts recorded in this run folder (note_restart), oldest first."""
    path = out / RESTARTS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def unlogged_restarts(out: Path, run_log, restarted: dict | None) -> list:
    """The recorded restarts (note_restart) the JSON log lacks, oldest first: this start's, and
    any whose start ended between recording and logging it (its world changed again at once,
    an elastic job's node back during the restart). Without a JSON log: this start's alone."""
    logged = run_log.logged_restarts()
    if logged is None:
        return [restarted] if restarted is not None else []
    return [r for r in restarts(out) if r not in logged]


def plan_job(cfg: TrainConfig, degrees: dict, cluster) -> dict:
    """gw.plan's prediction of this job (time, memory, bytes per axis) with the grid's degrees
    ({"dp", "pp", "sp"}) on `cluster`. The planner recomputes every layer or none: any activation
    checkpointing counts as every layer."""
    return plan.predict(plan.model_of(cfg), cfg.plan_shape(degrees["dp"], degrees["pp"]), cluster,
                        microbatches=cfg.microbatches, recompute=cfg.ac != 1, **cfg.planned_optimizer())


def predicted_step_s(cfg: TrainConfig, grid) -> float:
    """The planner's step time of this job on this grid, on this machine's calibrated preset
    (`gridweave bench --calibrate`'s "local"), to log beside the measured one."""
    return plan_job(cfg, grid.axes, plan.load_cluster("local", grid.ranks_per_node))["step_time_s"]


def token_share(predicted: float, losses: int) -> float:
    """The masked LM's normaliser: the count of the global batch's predicted tokens over the
    micro-batch losses summed to the reported mean (micro-batches a rank x dp ranks), so each
    micro-batch's sum over it averages to the mean over every predicted token."""
    if isinstance(predicted, torch.Tensor):  # the step's count, left on the device
        return predicted.clamp(min=1.0) / losses
    return max(predicted, 1.0) / losses


def evaluate(stage, grid, inputs: torch.Tensor, targets: torch.Tensor, cfg: TrainConfig, mb: int) -> float:
    """Mean validation loss over the predicted tokens of (inputs, targets) (the same on every
    grid): each dp rank takes its share in microbatches of `mb`, the pipeline runs forward only."""
    dp = grid.axes["dp"]
    per_rank = len(inputs) // dp // mb * mb
    if per_rank < 1:
        raise GridError(f"{len(inputs)} validation windows do not give each of {dp} dp ranks a microbatch of {mb}")
    rows = slice(grid.coords["dp"] * per_rank, (grid.coords["dp"] + 1) * per_rank)
    mine, mine_y = inputs[rows], targets[rows]
    xs = [mine[i:i + mb].to(grid.device) for i in range(0, len(mine), mb)]
    ys = [mine_y[i:i + mb].to(grid.device) for i in range(0, len(mine), mb)]
    # the masked LM: each micro-batch's sum over the predicted tokens of every rank's windows
    normalizer = token_share(float((targets[:dp * per_rank] != models.IGNORE).sum()), dp * per_rank // mb) \
        if cfg.masked_lm else None
    stage.eval()
    loss = pipeline.pipeline_forward(stage, grid, xs, ys, lambda out, t: stage.loss(out, t, normalizer),
                                     stage.activation_shape(mb, cfg.seq), dtype=cfg.compute.dtype)
    stage.train()
    # each dp rank's own windows, their loss summed over the sequence ranks' shares, counted once
    mine_loss = loss is not None and first_copy(grid, distinct=("dp",) + stage.loss_partial)
    mine_counts = loss is not None and first_copy(grid, distinct=("dp",))
    total = torch.tensor([loss.item() * len(mine) if mine_loss else 0.0, len(mine) if mine_counts else 0.0],
                         dtype=torch.float64, device=grid.device)
    grid.all_reduce(total, axis=None)
    return float(total[0] / total[1])


def build(cfg: TrainConfig, grid, model_cfg: ModelConfig) -> tuple:
    """This rank's part of the run's model: (dense model, stage, optimizer, loss scaler or None),
    the model initialised in fp32 from the current seed (the same weights whatever the
    precision), then cast."""
    model = models.build(model_cfg, device=grid.device) if cfg.init_from is None else \
        models.hf.from_pretrained(cfg.init_from, dtype=torch.float32).to(grid.device)  # its weights, on every rank
    model = model.to(cfg.compute.dtype)
    s, pp = grid.coords["pp"], grid.axes["pp"]
    options = dict(ac=cfg.ac, fused_loss=cfg.fused_loss, overlap=cfg.overlap, attention=cfg.attention,
                   ulysses_degree=cfg.ulysses_degree)
    if model_cfg.moe is not None:
        options["ep"] = cfg.expert_axis(grid)
    stage = models.ModelChunks(model, grid, cfg.mode, s, pp, cfg.chunks, pipeline.placement_of(cfg.schedule),
                               **options) \
        if cfg.chunks > 1 or cfg.schedule == "interleaved" else models.GPTStage(model, grid, cfg.mode, s, pp, **options)
    if cfg.compute.float8 is not None:  # the head's products stay bf16; grid_shape checked the rest
        float8.convert(stage, cfg.compute.float8)
    set_moe_overlap(stage, cfg.moe_overlap)
    if optim.uses_distributed(cfg.zero, cfg.offload):  # ZeRO, or the state on the device
        opt = optim.DistributedAdam(stage.parameters(), grid, lr=cfg.lr, weight_decay=cfg.weight_decay, zero=cfg.zero,
                                    offload=cfg.offload, bsize=cfg.bsize, max_grad_norm=cfg.max_grad_norm,
                                    decay=optim.matrices_only, units=stage.shard_units() if cfg.zero == 3 else None,
                                    shard_group=optim.ShardGroup(cfg.zero_shard_group),
                                    float8_params=float8.gathered_weights(stage) if cfg.zero == 3 else ())
    else:  # AxoNN: every replica's state offloaded, the chunks' all-reduces started in the backward that
        # completes them (overlap_grad_reduce, as DDP's buckets), or after the backward
        opt = optim.OffloadAdam(stage.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, bsize=cfg.bsize,
                                coarsening=cfg.coarsening, grid=grid, max_grad_norm=cfg.max_grad_norm,
                                decay=optim.matrices_only, overlap=cfg.overlap_grad_reduce)
    return model, stage, opt, LossScaler(device=grid.device) if cfg.compute.loss_scaling else None


def resolve_offload(cfg: TrainConfig, grid) -> bool:
    """Where the optimizer state lives, for offload=auto: host memory (OffloadAdam, AxoNN) where
    the device's memory is the host's (CPU ranks); on a GPU the device, measured ten times faster a
    step (the main job on an H100: 0.178 s against OffloadAdam's 1.74 s, its state crossing PCIe
    twice a step), unless the planner's memory of the job with the state on the device passes 90% of
    the GPU's memory: then the host's. An explicit true or false is kept."""
    if cfg.offload != "auto":
        return bool(cfg.offload)
    if grid.device.type != "cuda":
        return True
    try:
        need = plan_job(dataclasses.replace(cfg, offload=False), grid.axes,
                        plan.load_cluster("local", grid.ranks_per_node))["memory_bytes"]
    except Exception:  # noqa: BLE001 (a job the planner cannot predict keeps the faster optimizer)
        return False
    return need > 0.9 * torch.cuda.mem_get_info(grid.device)[1]


def connect(cfg: TrainConfig, grid, stage, opt) -> None:
    """Makes every communicator the steps will use now, in one global order (Grid.connect), and
    ends setup: one made later is counted in metrics.json's communicators.after_setup."""
    items = [None] + [a for a, n in grid.axes.items() if n > 1]
    schedule = cfg.resolved_schedule(grid.axes["dp"], grid.axes["pp"])
    items += stage.comm_lines() + opt.comm_lines() + pipeline.comm_lines(grid, schedule, chunks=cfg.chunks)
    grid.connect(items)
    grid.seal()


def train_step(cfg: TrainConfig, grid, stage, opt, scaler, x, y, documents=None, phases=None) -> tuple:
    """One step on this rank's (batch, seq) shard of tokens x and targets y (and, packed, their
    document ids): the pipeline's micro-batches forward and backward, the loss known on every
    rank, then (if it is finite) the optimizer's update. Returns (the step's mean loss, whether
    the weights were updated). plan.step_counters predicts this step's traffic (recorder.step_schedule).
    phases: a gw.measure.StepPhases this step's time is added to, phase by phase, or None."""
    if phases is None:
        return _train_step(cfg, grid, stage, opt, scaler, x, y, documents, None)
    opt.phases = phases
    try:  # what no phase inside claimed is bookkeeping
        return phases.timed("bookkeeping", _train_step, cfg, grid, stage, opt, scaler, x, y, documents, phases)
    finally:
        opt.phases = None
        phases.end_step()


def _train_step(cfg: TrainConfig, grid, stage, opt, scaler, x, y, documents, phases) -> tuple:
    m, dp, pp = cfg.microbatches, grid.axes["dp"], grid.axes["pp"]
    mb = x.shape[0] // m
    def micro(t):  # t's m micro-batches, on the grid's device
        return [t[i * mb:(i + 1) * mb].to(grid.device) for i in range(m)]

    xs, ys, ds = micro(x), micro(y), None
    if documents is not None:  # packed: each micro-batch's chunk order made from the host's ids
        ds = [stage.pack(documents[i * mb:(i + 1) * mb]) for i in range(m)] if cfg.balance_documents else \
            micro(documents)
    normalizer = None
    if cfg.masked_lm:  # the mean over the global batch's predicted tokens: their count summed over dp
        count = (y != models.IGNORE).sum().reshape(1).to(device=grid.device, dtype=torch.float64)
        grid.all_reduce(count, axis="dp")
        normalizer = token_share(count, m * dp)
    opt.zero_grad()
    opt.backwards_per_step = m  # gradients final after the m-th backward: buckets start then (GridOptimizer)
    loss_scale = scaler.tensor if scaler is not None else 1.0  # on the device: its update is the device's
    # the experts' auxiliary losses reach the gradients as the micro-batch losses do: over m,
    # scaled, and summed over the data ranks where the optimizer averages over dp
    set_aux_grad_scale(stage, loss_scale / m / optim.dp_mean_scale(grid))

    def loss_fn(logits, targets):  # in fp32 or wider whatever the model computes in; fp16 scaled up
        return stage.loss(logits, targets, normalizer) * loss_scale

    # the pipeline's wall time that is neither forward nor backward is waiting: receives, the schedule
    loss, _ = timed(phases, "waiting", lambda: pipeline.pipeline_step(
        stage, grid, xs, ys, loss_fn, stage.activation_shape(mb, cfg.seq), dtype=cfg.compute.dtype,
        schedule=cfg.resolved_schedule(dp, pp),
        pipeline_limit=cfg.pipeline_limit or max(pp, 2), documents=ds, phases=phases, microbatches=m))
    loss = loss / loss_scale if loss is not None else None
    # the last stage's loss, identical over its tp group, a share over sp: count one rank of each
    # tp group. Summed on the device and left there: a non-finite loss skips the update on every
    # rank by a flag the optimizer reads on the device (no host read; read_step reads the numbers once)
    mine = loss is not None and first_copy(grid, distinct=("dp",) + stage.loss_partial)
    total = loss.detach().to(torch.float64, copy=True).reshape(1) if mine else \
        torch.zeros(1, dtype=torch.float64, device=grid.device)
    grid.all_reduce(total, axis=None)
    mean = total[0] / dp
    # sums each gradient over its partial axes (dp averaged), clips, updates; its waits are the reduction's
    return mean, timed(phases, "optimizer", opt.step, scaler, ~torch.isfinite(mean))


class StepRead(NamedTuple):
    """A training step's numbers on the host: what the progress bar, the divergence guard, the
    logs and metrics.json show."""
    loss: float
    took: bool  # whether the weights were updated
    norm: float | None  # the gradient norm (None: no clipping, no norm)
    scale: float | None  # fp16: the loss scale the step ran with (None: no loss scaling)
    experts: list | None = None  # [layer][expert]: this stage's mixture-of-experts slots (routed_tokens)


def read_step(loss, taken, opt, scaler=None, experts=None) -> StepRead:
    """A step's loss, whether it was taken, its gradient norm, loss scale and routed slots per
    expert, in one host read."""
    norm = opt.grad_norm_tensor
    optional = [t for t in (norm, scaler.last_used if scaler is not None else None) if t is not None]
    parts = [loss.detach().reshape(1).to(torch.float64)]
    parts += [t.detach().reshape(-1).to(device=loss.device, dtype=torch.float64)
              for t in ([taken] if isinstance(taken, torch.Tensor) else []) + optional +
              ([experts] if experts is not None else [])]
    got = torch.cat(parts).tolist()  # the step's one read
    loss_value, rest = got[0], got[1:]
    took = bool(rest.pop(0)) if isinstance(taken, torch.Tensor) else bool(taken)
    norm_value = rest.pop(0) if norm is not None else None
    scale = rest.pop(0) if scaler is not None else None
    slots = None if experts is None else \
        [[int(c) for c in rest[i * experts.shape[1]:(i + 1) * experts.shape[1]]] for i in range(experts.shape[0])]
    return StepRead(loss_value, took, norm_value, scale, slots)


def setup_grid(cfg: TrainConfig, store=None) -> Grid:
    """The run's grid on the launched ranks, every check before the rendezvous. auto: init picks
    NCCL on one GPU per rank when it can, else Gloo on the CPU; cuda with fewer GPUs than ranks
    shares them through Gloo. store: the rendezvous store, where the ranks already met (else
    init's own)."""
    # every rank's flight recorder goes to the run folder when communication fails (gridweave flight)
    return init(**grid_options(cfg, launch.launched_world_size(cfg.backend)), flight_dir=str(Path(cfg.out) / "flight"),
                store=store)


def grid_options(cfg: TrainConfig, world: int) -> dict:
    """gw.init's arguments for cfg's grid on `world` ranks, every check made first."""
    shape = cfg.grid_shape(world)
    device = None if cfg.device == "auto" else cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        raise GridError("device=cuda was asked for but this process sees no CUDA GPU "
                        "(torch.cuda.is_available() is False); use device=cpu")
    if device == "cuda":
        cfg.compute.check_device(torch.device("cuda", torch.cuda.current_device()))
    return dict(dp=shape["dp"], pp=shape["pp"], tp=cfg.mode, sp=shape["sp"], timeout=cfg.timeout, device=device,
                backend=cfg.backend, placement=cfg.placement)


def resolve_resume(cfg: TrainConfig, grid) -> TrainConfig:
    """cfg with resume=auto decided, once for every rank: out when it holds a complete checkpoint
    (rank 0 looks; every rank must then see the same step, i.e. share out), else a fresh start."""
    if cfg.resume != AUTO:
        return cfg
    out = Path(cfg.out)

    def newest() -> int:
        try:
            return int(load_checkpoint(out)["step"])
        except GridError:  # none yet (or none complete)
            return -1

    mine = newest()
    step = grid.broadcast_ints([mine], axis=None)[0]
    if grid.any(mine != step):
        raise GridError(f"resume=auto: rank 0 found {'step ' + str(step) if step >= 0 else 'no checkpoint'} in "
                        f"{out / 'checkpoint'} but another rank did not see the same (out must be one folder every "
                        "node shares)")
    return dataclasses.replace(cfg, resume=str(out) if step >= 0 else None)


def _say(line: str) -> None:
    print(f"gridweave train: {line}", flush=True)


def prepare_data(cfg: TrainConfig, grid, out: Path) -> tuple:
    """(token file, tokenizer): the tokenizer made once by rank 0 into out (from the resumed run's);
    the token file by rank 0 into out too, or with data_cache by each node's first rank into that
    node-local folder. No two processes write one file, and no rank waits on a maker that gave up:
    see made_while_beating."""
    tok_from = str(Path(cfg.resume) / data.TOKENIZER_FILE) if cfg.resume else \
        (str(cfg.tokenizer_file) if cfg.tokenizer_file is not None else None)
    cache = Path(cfg.data_cache.replace("{host}", socket.gethostname())) if cfg.data_cache else None

    def made_by(maker: bool, folder: Path, tokenizer_from, tokenize=True) -> None:
        made_while_beating(grid, maker, lambda: data.prepare(
            folder, cfg.source, cfg.tokenizer, cfg.vocab, tokenizer_from=tokenizer_from, tokenize=tokenize,
            say=None if cfg.quiet else _say, warn=_say), cfg.data_timeout, f"the data in {folder}")

    made_by(grid.rank == 0, out, tok_from, tokenize=cache is None)
    if cache is None:
        return data.open_tokens(out), data.load_tokenizer(out / data.TOKENIZER_FILE)
    made_by(launch.local_rank() == 0, cache, str(out / data.TOKENIZER_FILE))
    return data.open_tokens(cache), data.load_tokenizer(cache / data.TOKENIZER_FILE)


HEARTBEAT_S = (0.02, 0.5)  # the first and the longest pause between made_while_beating's checks


def made_while_beating(grid, maker: bool, make: Callable[[], None], within: float, what: str) -> None:
    """make() run by the ranks where `maker` holds, on a thread, while every rank checks with the
    others, in small world all-reduces, whether the makers have finished or failed: the wait is
    bounded by `within` (one decision, every rank's), not by the grid's per-communication timeout,
    which a slow tokenizer would pass (torch's barrier after a rank-0 step is bounded by the
    collective timeout alone). What a maker meets is raised there; the others raise a GridError
    saying it failed."""
    import threading

    box: dict = {}

    def work():
        try:
            make()
        except BaseException as e:  # raised on the maker's main thread; the others hear it failed
            box["error"] = e
        finally:
            box["done"] = True

    if maker:
        threading.Thread(target=work, name="gridweave-prepare", daemon=True).start()
    t0, pause = time.monotonic(), HEARTBEAT_S[0]
    while True:
        over = time.monotonic() - t0 > within
        flags = torch.tensor([float(maker), float(box.get("done", False)), float("error" in box), float(over)],
                             dtype=torch.float64, device=grid.device)
        grid.all_reduce(flags, axis=None, op="sum")
        makers, done, failed, late = (int(v) for v in flags.tolist())
        if failed:
            if "error" in box:
                raise box["error"]
            raise GridError(f"{what} could not be prepared (the rank that made it says why)")
        if done == makers:
            return
        if late:
            raise GridError(f"{what} was not prepared within data_timeout={within:g} s")
        time.sleep(pause)
        pause = min(2 * pause, HEARTBEAT_S[1])


@dataclass
class History:
    """What a run has recorded so far (and a checkpoint carries on): the training loss of every
    step and [step, validation loss] pairs."""
    losses: list = field(default_factory=list)
    val: list = field(default_factory=list)
    start: int = 0  # the first step this process trains


class Checkpointer:
    """The run's checkpoints: resuming from one, one every checkpoint_every steps (in the
    background when async_save: committed at the next step's start, by every rank), the last."""

    def __init__(self, cfg: TrainConfig, grid, out: Path, model_cfg: ModelConfig, stage, opt, scaler, reader):
        self.cfg, self.grid, self.out, self.model_cfg = cfg, grid, out, model_cfg
        self.stage, self.opt, self.scaler, self.reader = stage, opt, scaler, reader
        self.pending = None
        self.restarted = None  # note_restart's record when this start changed the world (rank 0)

    def resume(self) -> History:
        """The history of cfg.resume's checkpoint, its weights, optimizer state, reader position
        and loss scale loaded into this rank's parts; an empty history without one."""
        cfg, opt = self.cfg, self.opt
        if not cfg.resume:
            return History()
        manifest = load_checkpoint(Path(cfg.resume))
        mine = cfg.run_config(self.model_cfg)
        theirs = dict(manifest["config"])
        # the model as a ModelConfig: a field added since the checkpoint was written takes its default
        theirs["model"] = ModelConfig.from_dict(theirs.get("model") or {}).to_dict()
        differ = [k for k in RESUME_KEYS if theirs.get(k) != mine[k]]
        if differ:
            raise GridError(f"checkpoint {cfg.resume} differs from this run in {differ}: "
                            f"{ {k: theirs.get(k) for k in differ} } vs { {k: mine[k] for k in differ} }")
        _, local = checkpoint.load(Path(cfg.resume) / "checkpoint", self.stage.sharded_items(), self.grid,
                                   ("param",) + opt.STATE_KEYS)
        with torch.no_grad(), opt.whole_parameters(writeback=True):  # zero 3: the shards taken from them
            for p in self.stage.parameters():
                p.copy_(local["param"][id(p)])
        opt_step = manifest["optimizer_step"]
        state = {i: {"step": torch.tensor(float(opt_step), device="cpu"),
                     **{kind: local[kind][id(p)] for kind in opt.STATE_KEYS}} for i, p in enumerate(opt.params)}
        group = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay,
                 "params": list(range(len(opt.params)))}
        opt.load_state_dict({"state": state, "param_groups": [group]})
        opt.weight_decay = cfg.weight_decay
        with torch.no_grad():
            for name, b in self.stage.balancing_biases():
                if name in manifest.get("biases", {}):  # (a checkpoint without: its model had none)
                    b.copy_(torch.tensor(manifest["biases"][name], dtype=b.dtype, device=b.device))
        if manifest.get("reader"):
            self.reader.load_state_dict(manifest["reader"])
        if self.scaler is not None and manifest.get("loss_scaler"):
            self.scaler.load_state_dict(manifest["loss_scaler"])
        if self.grid.rank == 0:  # a restarted job says where it continues (and when: the time to recover)
            again = f" (restart {launch.restart_count()})" if launch.restart_count() else ""
            before = world_before(Path(cfg.resume), manifest)
            if before.get("world_size") != self.grid.world_size:  # a world that changed: metrics' restarts
                r = self.restarted = note_restart(self.out, self.grid, cfg, manifest, before)
                which = f"restart {r['restart']}: " if r["restart"] else ""
                lost = f", {r['seconds_lost']:.1f} s after the last step logged" if r["seconds_lost"] else ""
                again = (f" ({which}{r['previous_world']} ranks {r['previous_grid']} -> {r['world']} ranks "
                         f"{r['grid']}{lost})")
            print(f"gridweave train: resumed from step {manifest['step']} of {cfg.resume}{again}", flush=True)
        return History(list(manifest["losses"]), list(manifest.get("val", [])), manifest["step"])

    def land(self) -> None:
        """The background checkpoint, if any, committed (every rank)."""
        if self.pending is not None:
            self.pending.finish()
            self.pending = None

    def save(self, step: int, history: History, wait: bool = True):
        return save_checkpoint(self.out, step, self.cfg, self.grid, self.stage, self.opt, history.losses,
                               self.reader, self.model_cfg, history.val, wait=wait, scaler=self.scaler)

    def after_step(self, step: int, history: History) -> None:
        """The periodic checkpoint after `step` (0-based), when one is due before the last step."""
        cfg = self.cfg
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            saved = self.save(step + 1, history, wait=not cfg.async_save)
            self.pending = saved if cfg.async_save else None


class DivergenceGuard:
    """Stops the run after max_bad_steps consecutive steps that did not update the weights for a
    non-finite loss or gradient norm (fp16: once the loss scaler cannot back off further)."""

    def __init__(self, cfg: TrainConfig, opt, scaler):
        self.cfg, self.opt, self.scaler, self.bad = cfg, opt, scaler, 0

    def check(self, step: int, read: StepRead, checkpoints: Checkpointer) -> None:
        # a skipped fp16 step is the loss scaler's business until the scale it ran with is the floor
        floor = read.scale is None or read.scale <= self.scaler.min_scale
        loss, self.bad = read.loss, self.bad + 1 if not read.took and floor else 0
        if self.bad < self.cfg.max_bad_steps:
            return
        checkpoints.land()  # the last good checkpoint lands; nothing after it is written
        bad, cfg = self.bad, self.cfg
        norm = read.norm if math.isfinite(loss) else None
        raise Diverged(f"training diverged: {bad} steps in a row (steps {step + 2 - bad}-{step + 1}) had a "
                       f"non-finite loss or gradient norm (the last: loss {loss:.4g}"
                       f"{'' if norm is None else f', gradient norm {norm:.4g}'}); none of them updated the "
                       f"weights, so every checkpoint holds weights from before them. Lower lr={cfg.lr:g}, "
                       f"or raise max_bad_steps={cfg.max_bad_steps} to ride out spikes")


class Validation:
    """The validation loss every val_every steps and at the last, on the same windows whatever
    the grid (evaluate); the masked LM's masked the same way on every grid too."""

    def __init__(self, cfg: TrainConfig, tokens, mb: int):
        self.cfg, self.mb = cfg, mb
        self.windows = data.validation_windows(tokens.val, cfg.seq, cfg.val_samples)
        self.inputs, self.targets = self.windows[:, :-1], self.windows[:, 1:]
        if cfg.masked_lm:
            self.inputs, self.targets = data.masked_lm(self.inputs, range(len(self.inputs)), cfg.seed,
                                                       tokens.vocab_size, tokens.vocab_size)

    def after_step(self, step: int, stage, grid, history: History) -> None:
        cfg = self.cfg
        if cfg.val_every and ((step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps):
            history.val.append([step + 1, evaluate(stage, grid, self.inputs, self.targets, cfg, self.mb)])


class Meter:
    """Per-step measurements (tokens/s, model-FLOPs utilisation, learning rate, gradient norm)
    and the progress bar on rank 0."""

    def __init__(self, cfg: TrainConfig, grid, model_cfg: ModelConfig, start: int, moe_layers: list = ()):
        """moe_layers: the model's indices of this stage's mixture-of-experts layers, in order."""
        self.cfg = cfg
        self.moe_layers = list(moe_layers)
        self.flops_token = model_flops_per_token(dataclasses.replace(model_cfg, seq=cfg.seq))  # the trained length
        peak, self.peak_source = peak_flops(grid, cfg.compute.name)
        total = torch.tensor([peak], dtype=torch.float64, device=grid.device)
        grid.all_reduce(total, axis=None)
        self.peak_total = float(total.item())
        self.tokens_per_s, self.mfu, self.lr, self.grad_norm = [], [], [], []
        self.experts = []  # a mixture of experts' slots per step: [layer][expert], every stage's layers
        self.bar = None
        if grid.rank == 0 and not cfg.quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step")
        self.run_log, self.predicted_s, self._traffic = None, None, {}
        if cfg.sinks and (grid.rank == 0 or cfg.log_all_ranks):
            try:
                self.predicted_s = predicted_step_s(cfg, grid)
            except Exception as e:  # noqa: BLE001 (the logs' optional prediction never stops training)
                print(f"gridweave train: the planner cannot predict this job ({type(e).__name__}: {e}); the logs "
                      "carry no predicted step time", flush=True)
            config = {**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init},
                      "tp": cfg.mode.spec(), "grid": dict(grid.axes), "backend": grid.backend, "device": str(grid.device)}
            self.run_log = loggers.RunLog(cfg.sinks, Path(cfg.out), grid.rank, config, Path(cfg.out).name)
            if grid.rank == 0 and not cfg.quiet:
                print(f"gridweave train: logging to {', '.join(s.value for s in cfg.sinks)} in {self.run_log.folder}",
                      flush=True)

    def record_experts(self, counts: list | None) -> None:
        """This step's slots per expert of this stage's mixture-of-experts layers (StepRead.experts)."""
        if counts is not None:
            self.experts.append(counts)

    def gather_experts(self, grid) -> None:
        """Every step's slots per expert of every stage's layers, in layer order (collective over
        pp, once at the end of the run)."""
        if self.experts and grid.axes.get("pp", 1) > 1:
            stages = grid.all_gather_json(self.experts, "pp")
            self.experts = [[row for stage in stages for row in stage[i]] for i in range(len(self.experts))]

    def record(self, seconds: float, lr: float, grad_norm) -> None:
        self.tokens_per_s.append(self.cfg.batch * self.cfg.seq / seconds)
        self.mfu.append(self.tokens_per_s[-1] * self.flops_token / self.peak_total)
        self.lr.append(lr)
        self.grad_norm.append(grad_norm)

    def log(self, step: int, history: History, grid, scale: float | None, phases: StepPhases | None = None) -> None:
        """This rank's numbers of `step` to its loggers: the training state, speed beside the
        planner's prediction, memory, and the bytes and messages its engine moved per axis; with
        phases timed, its forward and backward seconds (compute) and its waits for its peers
        (StepPhases.WAIT) in the step (every rank's with log_all_ranks)."""
        if self.run_log is None:
            return
        import resource

        values = {"train/loss": history.losses[-1], "train/lr": self.lr[-1], "train/grad_norm": self.grad_norm[-1],
                  "train/loss_scale": scale,
                  "perf/tokens_per_s": self.tokens_per_s[-1], "perf/mfu": self.mfu[-1],
                  "perf/step_time_s": self.cfg.batch * self.cfg.seq / self.tokens_per_s[-1],
                  "perf/predicted_step_time_s": self.predicted_s,
                  "memory/max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0}
        if self.experts:  # the busiest expert over an even share, the most unbalanced layer's (this stage's)
            values["moe/max_load_over_mean"] = max(max(c) * len(c) / max(sum(c), 1) for c in self.experts[-1])
            for layer, counts in zip(self.moe_layers, self.experts[-1]):  # and each layer's, with its histogram
                values[f"moe/layer{layer}/max_load_over_mean"] = max(counts) * len(counts) / max(sum(counts), 1)
                self.run_log.loads(step + 1, f"moe/layer{layer}/tokens_per_expert", counts)
        if phases is not None:
            values["perf/compute_s"], values["perf/wait_s"] = phases.split[-1]
        if grid.device.type == "cuda":
            values["memory/device_max_allocated_bytes"] = torch.cuda.max_memory_allocated(grid.device)
        if history.val and history.val[-1][0] == step + 1:
            values["val/loss"] = history.val[-1][1]
        for label, c in grid.stats().items():  # this step's traffic: the counters' growth
            now = (c["sent_intra"]["bytes"] + c["sent_inter"]["bytes"] + c["recv_intra"]["bytes"] +
                   c["recv_inter"]["bytes"], c["sent_intra"]["messages"] + c["sent_inter"]["messages"] +
                   c["recv_intra"]["messages"] + c["recv_inter"]["messages"])
            before = self._traffic.get(label, (0, 0))
            values[f"comm/{label}/bytes"], values[f"comm/{label}/messages"] = now[0] - before[0], now[1] - before[1]
            self._traffic[label] = now
        self.run_log.step(step + 1, values)

    def stragglers(self, step: int, named: list, grid) -> None:
        """Ranks the straggler detector named at `step`: a line (rank 0) and each one's time over
        its stage's median to the loggers."""
        for s in named if grid.rank == 0 and not self.cfg.quiet else ():
            _say(StragglerDetector.describe(s))
        if self.run_log is not None and named:
            self.run_log.step(step + 1, {f"straggler/rank{s['rank']}/over_median": s["compute_s"] / s["median_s"]
                                         for s in named})

    def show(self, history: History) -> None:
        if self.bar is None:
            return
        post = dict(loss=f"{history.losses[-1]:.3f}", tok_s=f"{self.tokens_per_s[-1]:.0f}",
                    mfu=f"{100 * self.mfu[-1]:.1f}%")
        if history.val:
            post["val"] = f"{history.val[-1][1]:.3f}"
        self.bar.set_postfix(**post)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run_log is not None:
            self.run_log.close()

    def as_dict(self) -> dict:
        out = {"lr": self.lr, "grad_norm": self.grad_norm, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
               "peak_flops_total": self.peak_total, "peak_flops_source": self.peak_source,
               "model_flops_per_token": self.flops_token}
        if self.experts:
            out["tokens_per_expert"] = self.experts
        return out


MEMORY_KINDS = ("parameters", "gradients", "optimizer", "optimizer_buffers")


def memory_per_rank(grid, stage, opt) -> dict:
    """Every rank's parameter bytes and the peak resident set of its process, and the bytes of
    parameters, gradients and optimizer state held by the rank that holds the most (optim.held_bytes)."""
    import resource

    held = optim.held_bytes(list(stage.parameters()), opt)
    mem = torch.tensor([sum(p.numel() * p.element_size() for p in stage.parameters()),
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0] +
                       [float(held[k]) for k in MEMORY_KINDS], dtype=torch.float64, device=grid.device)
    per_rank = grid.all_gather(mem.reshape(1, -1), axis=None)
    top = int(per_rank[:, 2:].sum(1).argmax())
    held = {k: int(v) for k, v in zip(MEMORY_KINDS, per_rank[top, 2:])}
    return {"param_bytes_per_rank": [int(v) for v in per_rank[:, 0]],
            "max_rss_bytes_per_rank": [int(v) for v in per_rank[:, 1]],
            "optimizer_buffer_bytes": held.pop("optimizer_buffers"),  # its bucket buffers, a constant
            "memory_bytes": held}


def traffic_by_node(grid) -> dict:
    """The engine's traffic counters summed over every rank (bytes sent per axis label, intra- and
    inter-node), each rank's hostname and the node the placement assumed it on (rank //
    ranks per node): on a cluster the two must group ranks alike for the counters to be true."""
    sent = {label: [c["sent_intra"]["bytes"], c["sent_inter"]["bytes"]] for label, c in grid.stats().items()}
    every = grid.all_gather_json([socket.gethostname(), sent])
    total = {}
    for _, mine in every:
        for label, (intra, inter) in mine.items():
            t = total.setdefault(label, {"intra": 0, "inter": 0})
            t["intra"] += intra
            t["inter"] += inter
    return {"sent_bytes": total, "hosts": [h for h, _ in every],
            "assumed_node": [grid.node_of(r) for r in range(grid.world_size)]}


def run(cfg: TrainConfig, on_step: Callable[[int, StepState], None] | None = None) -> dict:
    """Train as `cfg` says; on_step(step, state), if given, is called at the start of each step
    (progress hooks, profilers; the tests' fault injection)."""
    if not isinstance(cfg, TrainConfig):
        raise GridError(f"train.run takes a TrainConfig, got {type(cfg).__name__}")
    auto = cfg.grid == AUTO
    store = rendezvous_store(cfg.timeout) if auto else None  # where rank 0's plan is shared, then the grid's
    world, given = launch.launched_world_size(cfg.backend), cfg.microbatches
    cfg = chosen_grid(cfg, world, launch.local_world_size() or 1, store)
    if launch.elastic_world() and not auto:  # the global batch kept on the world this restart has
        cfg = cfg.fitted_microbatches(world)
    grid, out = setup_grid(cfg, store), Path(cfg.out)
    if grid.rank == 0 and cfg.microbatches != given:  # said as the restart is, quiet or not
        _say(f"{cfg.microbatches} micro-batches a step (given {given}: the batch of {cfg.batch} on dp "
             f"{grid.axes['dp']})")
    cfg = resolve_resume(cfg, grid)
    schedule = cfg.resolved_schedule(grid.axes["dp"], grid.axes["pp"])
    if grid.rank == 0 and not cfg.quiet and grid.axes["pp"] > 1:
        _say(f"schedule {schedule}" + (" (auto)" if cfg.schedule == pipeline.AUTO else ""))
    offload = resolve_offload(cfg, grid)
    if grid.rank == 0 and not cfg.quiet and cfg.offload == "auto" and grid.device.type == "cuda":
        _say(f"optimizer state {'in host memory (OffloadAdam)' if offload else 'on the device'} (offload auto)")
    cfg = dataclasses.replace(cfg, schedule=schedule, offload=offload)
    tokens, tokenizer = prepare_data(cfg, grid, out)
    if grid.rank == 0:  # the run folder records what ran
        checkpoint.atomic_write(out / "environment.json",
                                lambda t: t.write_text(json.dumps(runfolder.environment(grid), indent=1)))
    model_cfg = cfg.model_config(tokens.vocab_size)
    cfg.check_vocab(tokens.vocab_size)
    if grid.rank == 0:  # what an export writes back: the imported (or resumed run's) config and generation config
        resumed = Path(cfg.resume) / runfolder.HF_SOURCE if cfg.resume else None
        runfolder.keep_source(cfg.init_from or resumed, out)
    torch.manual_seed(cfg.seed)
    _, stage, opt, scaler = build(cfg, grid, model_cfg)  # initialised in fp32, then cast
    connect(cfg, grid, stage, opt)
    reader = data.Reader(tokens.train, cfg.seq, cfg.batch, cfg.seed, grid.coords["dp"], grid.axes["dp"],
                         microbatches=cfg.microbatches)
    checkpoints = Checkpointer(cfg, grid, out, model_cfg, stage, opt, scaler, reader)
    history = checkpoints.resume()
    if grid.rank == 0:
        note_world(out, grid)
    validation = Validation(cfg, tokens, cfg.batch // grid.axes["dp"] // cfg.microbatches)
    meter, guard = Meter(cfg, grid, model_cfg, history.start, stage.moe_layers()), DivergenceGuard(cfg, opt, scaler)
    if grid.rank == 0 and meter.run_log is not None:  # the changes of world in the logs too
        for r in unlogged_restarts(out, meter.run_log, checkpoints.restarted):
            meter.run_log.restart(r["step"], r)
    phases = StepPhases(grid.device) if cfg.phase_times or cfg.straggler_threshold else None
    stragglers = StragglerDetector(grid, phases, cfg.straggler_threshold, cfg.straggler_every,
                                   cfg.straggler_windows) if cfg.straggler_threshold else None
    census = HostReads() if cfg.host_reads else None  # the training steps' host reads (validation, checkpoints aside)
    host_reads = []
    for step in range(history.start, cfg.steps):
        checkpoints.land()
        if on_step is not None:
            on_step(step, StepState(grid, stage, opt, scaler, cfg))
        t0 = time.perf_counter()
        opt.lr = cfg.lr_at(step)
        if cfg.masked_lm:  # the mask token is the first id past the tokenizer's
            x, y, docs = *reader.next_masked(tokens.vocab_size, tokens.vocab_size), None
        else:
            x, y, docs = reader.next_packed(tokens.documents) if cfg.pack_documents else (*reader.next(), None)
        with census if census is not None else contextlib.nullcontext():
            loss, taken = train_step(cfg, grid, stage, opt, scaler, x, y, docs, phases)
            experts = routed_tokens(stage, grid)
            update_expert_bias(stage, experts)  # DeepSeek-V3's balancing, from the step's load over the token axes
            read = read_step(loss, taken, opt, scaler, experts)
        history.losses.append(read.loss)
        guard.check(step, read, checkpoints)
        meter.record(time.perf_counter() - t0, opt.lr, read.norm)
        if census is not None:
            host_reads.append(census.counts())
            census = HostReads()
        meter.record_experts(read.experts)
        validation.after_step(step, stage, grid, history)
        meter.log(step, history, grid, read.scale, phases)
        if stragglers is not None:
            meter.stragglers(step, stragglers.after_step(step), grid)
        meter.show(history)
        checkpoints.after_step(step, history)
    meter.close()
    meter.gather_experts(grid)
    checkpoints.land()
    checkpoints.save(cfg.steps, history)
    metrics = {"loss": history.losses, "val_loss": history.val,
               "unigram_entropy_val": data.unigram_entropy(tokens.val, tokens.vocab_size), **meter.as_dict(),
               "config": cfg.run_config(model_cfg), "grid": dict(grid.axes),
               "grid_shape": cfg.plan_shape(grid.axes["dp"], grid.axes["pp"]).spec(),
               "grid_policy": AUTO if auto else cfg.grid, "restarts": restarts(out), "backend": grid.backend,
               "device": str(grid.device), "precision": cfg.compute.name, "traffic": traffic_by_node(grid),
               **memory_per_rank(grid, stage, opt)}
    made = grid.communicators()
    metrics["communicators"] = grid.all_gather_json({k: made[k] for k in ("at_setup", "after_setup", "late")})
    if cfg.host_reads:  # every rank's census of each step
        metrics["host_reads"] = grid.all_gather_json(host_reads)
    if phases is not None:  # every rank's mean seconds a step in each phase
        per_step = phases.per_step()
        metrics["phase_seconds"] = grid.all_gather_json(per_step)
        if meter.experts and cfg.ep > 1:  # the rank whose experts were sent the most, and its share of the step
            metrics["expert_ranks"] = grid.all_gather_json(expert_rank_load(cfg, grid, meter.experts, per_step))
            metrics["busiest_expert_rank"] = runfolder.busiest_expert_rank(metrics["expert_ranks"])
    if stragglers is not None:  # every naming (the same on every rank: gathered)
        metrics["stragglers"] = stragglers.named
    shutdown()
    if grid.rank == 0:
        report(cfg, out, metrics, tokens, tokenizer, validation.windows, model_cfg)
    return metrics


def expert_rank_load(cfg: TrainConfig, grid, experts: list, per_step: dict) -> dict:
    """This rank's part of runfolder.busiest_expert_rank: its member of the expert line, the slots
    routed to that member's experts over the run (experts: [step][layer][expert], every layer's),
    its forward and backward over its step (per_step: its StepPhases.per_step())."""
    ep = cfg.expert_axis(grid)
    member, per = grid.index(ep), len(experts[0][0]) // cfg.ep
    compute = sum(per_step[k] for k in StepPhases.COMPUTE)
    return {"rank": grid.rank, "member": member,
            "slots": sum(sum(c[member * per:(member + 1) * per]) for step in experts for c in step),
            "compute_share": compute / per_step["step"] if per_step["step"] else 0.0}


def report(cfg: TrainConfig, out: Path, metrics: dict, tokens, tokenizer, windows, model_cfg: ModelConfig) -> None:
    """Rank 0, after the grid is gone: a sample from the saved model, metrics.json, the loss plot
    and the closing line."""
    if cfg.sample_tokens and model_cfg.causal:  # the encoder does not generate
        dense, tok, _ = load_model(out)
        prompt = cfg.prompt or tokenizer.decode(windows[0, :8].tolist())
        ids = data.check_encodable(tok, prompt, "the prompt")
        n = min(cfg.sample_tokens, model_cfg.seq - len(ids))
        metrics["sample"] = {"prompt": prompt,
                             "text": tok.decode(sample(dense, ids, n, 0.8, 40, cfg.seed, tok.vocab_size))}
    checkpoint.atomic_write(out / "metrics.json", lambda t: t.write_text(json.dumps(metrics, indent=1)))
    runfolder.plot_loss(metrics, out / "loss.png")
    runfolder.plot_run(metrics, out / "run.png")
    if "tokens_per_expert" in metrics:
        runfolder.plot_experts(metrics, out / "experts.png")
    if not cfg.quiet:
        val = metrics["val_loss"]
        print(f"validation loss {val[-1][1]:.3f} nats/token vs unigram entropy {metrics['unigram_entropy_val']:.3f} "
              f"({tokenizer.kind}, {tokens.vocab_size} tokens)" if val else "")
        if "sample" in metrics:
            print(f"sample: {metrics['sample']['text']!r}")
        if "phase_seconds" in metrics:  # the slowest rank's phases (it sets the step's pace)
            slowest = max(metrics["phase_seconds"], key=lambda p: p["step"])
            print("step phases (slowest rank): " + StepPhases.describe(slowest))
        if "busiest_expert_rank" in metrics:
            b = metrics["busiest_expert_rank"]
            print(f"busiest expert rank {b['rank']} (expert-line member {b['member']}, {b['slots_over_even']:.2f}x an "
                  f"even share of the slots): {100 * b['compute_share']:.0f}% of its step computing, the mean rank "
                  f"{100 * b['mean_compute_share']:.0f}%")
        print(closing_line(cfg, out), flush=True)


def closing_line(cfg: TrainConfig, out: Path) -> str:
    """What a finished run says last: where it is and what to run next."""
    return (f"gridweave train: done; the run is in {out} (metrics.json, run.png, checkpoint/). Next: "
            f"gridweave generate --run {out} --prompt \"...\" | gridweave export --run {out} --out {out}-hf | "
            f"gridweave train --config {out / 'config.toml'} --resume auto --steps {2 * cfg.steps}")


def export_dense(path) -> dict:
    """The whole model of a checkpoint as a dense torch state_dict (models.GPT names), in one
    process, shard by shard."""
    return checkpoint.export_dense(Path(path) / "checkpoint")
