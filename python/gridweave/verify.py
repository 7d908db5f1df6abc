"""gridweave verify: does a job's exact parallel configuration compute what one process computes?

A scaled-down replica keeps what can go wrong (the tensor mode, every axis of 2 or more, the
schedule, the attention, the ZeRO stage and its shard group, experts and routing, packing,
activation checkpointing, tying, the key/value heads ratio) and reduces what only costs time
(each degree as far as the ranks allow, never below 2 where it was 2 or more; layers, widths,
vocabulary and sequence to the smallest sizes the grid's divisibility rules accept). It trains
a few steps in float64 on the replica's grid and, on every rank, the dense model in one process
from the same weights and micro-batches, and compares per step each module's output (forward
hooks on both, the dense one cut to this rank's block by the stage's layouts), the loss, every
parameter's gradient (read from Adam's first moment: m_t = b1 m_(t-1) + (1 - b1) g_t, so
g_t = (m_t - b1 m_(t-1)) / (1 - b1), exact in float64 whatever ZeRO shards), the gradient norm,
Adam's states and the weights after the step, each against this rank's block of the dense tensor
(the checkpoints' chunk of it: the placement's gather, with the rank that differs known).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import data, launch, models, optim, pipeline, train
from .checkpoint import FlatSlice, block_of, chunk_of
from .config import MOE_MODELS, TrainConfig
from .errors import GridError
from .grid import init as gw_init
from .grid import shutdown
from .layout import Layout, scatter
from .modes import parse as parse_mode
from .nn.moe import set_aux_grad_scale
from .nn.sequence import SeqAttention, shard_positions
from .sharding import placement_of

RTOL = 1e-9  # float64: the suite's ops agree within 1e-10; a few Adam steps on top
STEPS = 2
RANKS = 8  # the CPU ranks a replica may take (gridweave verify --ranks)
VOCAB = 61  # the replica's synthetic tokens (padded as the job pads its vocabulary)
# The order divergences are reported in, within a step: where the computation meets them first.
PHASES = ("forward", "loss", "backward", "norm", "optimizer", "weights")
STATES = ("exp_avg", "exp_avg_sq", "master")


@dataclass(frozen=True)
class Divergence:
    """Where the replica first differs from one process."""
    step: int
    phase: str    # one of PHASES
    module: str   # the dense model's name of the module ("layers.1", "layers.1.attn.qkv", "embed"; "" for the loss)
    tensor: str   # what differs there ("output of micro-batch 0", "weight's gradient", "exp_avg of weight")
    rank: int
    coords: dict
    error: float  # relative: |parallel - dense| / |dense| (Frobenius)
    after: str    # the collective this rank issued before it ("" where none)

    def describe(self) -> str:
        where = ", ".join(f"{a} {c}" for a, c in self.coords.items())
        after = f"; after {self.after}" if self.after else ""
        return (f"step {self.step}, {self.phase}: {self.module + ' ' if self.module else ''}{self.tensor} on rank "
                f"{self.rank} ({where}) differs by {self.error:.3g} relative{after}")


@dataclass(frozen=True)
class Report:
    ok: bool
    first: Divergence | None
    steps: int
    world: int
    replica: str     # the replica's grid and sizes, in one phrase
    scaled: tuple    # how each reduced quantity was reduced ("dp 64 -> 2", ...)
    compared: int    # tensors compared, summed over ranks
    rtol: float
    worst: float     # the largest relative error met (over the ranks)

    def line(self) -> str:
        if self.ok:
            return (f"verify: ok ({self.steps} steps on {self.world} ranks, {self.replica}: {self.compared} blocks of "
                    "module outputs, gradients, Adam states and weights, the loss and the gradient norm within "
                    f"{self.rtol:g} of one process; the largest difference {self.worst:.1e})")
        return f"verify: diverged at {self.first.describe()}"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["line"] = self.line()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        d = {k: v for k, v in d.items() if k != "line"}
        first = d.pop("first")
        return cls(first=Divergence(**first) if first else None, **{**d, "scaled": tuple(d["scaled"])})


# ---- the replica ---------------------------------------------------------------------

def _tp_ranks(mode, size: int) -> int:
    return parse_mode(f"{mode.keyword}:{size}").ranks() if mode.size_arg else 1


def _size(mode) -> int:
    """A tensor mode's degree (row:N's N, square:Q's Q, ...); 1 for none."""
    return mode.size if mode.size_arg else 1


def _degrees(cfg: TrainConfig, shape: dict, ranks: int) -> tuple:
    """(degrees, lines): the job's dp, pp, sp and tensor-mode size reduced, the largest first,
    each halving at a time and never below 2 where it was 2 or more (USP keeps a ring of two
    Ulysses blocks: sp 4), until the replica fits `ranks`."""
    mode = cfg.mode
    deg = {"dp": shape["dp"], "pp": shape["pp"], "sp": shape["sp"], "tp": _size(mode)}
    floor = {k: min(v, 2) for k, v in deg.items()}
    usp_ring = cfg.attention == "usp" and 1 < cfg.ulysses_degree < shape["sp"]
    if usp_ring:
        floor["sp"] = 4
    # experts over a part of the data line keep a line of 4 at least, so 2 of them stay a part
    line_floor = 4 if 1 < cfg.ep < shape["dp"] * shape["sp"] else 1

    def world(d):
        return d["dp"] * d["pp"] * d["sp"] * _tp_ranks(mode, d["tp"])

    def halved(d, k):
        return {**d, k: max(floor[k], d[k] // 2)}

    while world(deg) > ranks:
        over = [k for k in ("dp", "pp", "sp", "tp") if deg[k] > floor[k] and
                (k not in ("dp", "sp") or halved(deg, k)["dp"] * halved(deg, k)["sp"] >= line_floor)]
        if not over:
            raise GridError(f"verify: the replica keeps each degree of 2 or more at 2 at least (USP's ring of "
                            f"Ulysses blocks at 4): {world(deg)} ranks, more than ranks={ranks}")
        k = max(over, key=lambda a: deg[a])
        deg = halved(deg, k)
    lines = [f"{k} {shape[k] if k != 'tp' else mode.spec()} -> {deg[k] if k != 'tp' else _spec(mode, deg['tp'])}"
             for k in ("dp", "pp", "sp", "tp")
             if (shape[k] if k != "tp" else _size(mode)) != deg[k]]
    return deg, lines, world(deg)


def _spec(mode, size: int) -> str:
    return f"{mode.keyword}:{size}" if mode.size_arg else mode.spec()


def scale_down(cfg: TrainConfig, job_world: int, ranks: int = RANKS) -> tuple:
    """(replica, lines, world): the job of `cfg` on `job_world` ranks as a float64 replica on
    `world` <= `ranks` CPU ranks, and what was reduced. The job's own checks first (train's
    errors); the replica is the smallest candidate the one validity rule (TrainConfig and its
    grid_shape) accepts."""
    if not isinstance(cfg, TrainConfig):
        raise GridError(f"verify takes a TrainConfig, got {type(cfg).__name__}")
    shape = cfg.grid_shape(job_world)
    deg, lines, world = _degrees(cfg, shape, ranks)
    # experts over the whole data line stay so; over a part of it, the job's part where it still
    # is one, else 2 (the line keeps 4 at least: _degrees)
    data_line = deg["dp"] * deg["sp"]
    ep = 1 if cfg.ep == 1 else data_line if cfg.ep == shape["dp"] * shape["sp"] else \
        cfg.ep if data_line % cfg.ep == 0 and cfg.ep < data_line else 2
    # Ulysses over all of sp stays so; USP's blocks inside a ring keep their size where sp still
    # holds two of them, else blocks of 2 (sp 4 at least)
    ud = cfg.ulysses_degree
    ulysses = 1 if ud == 1 else deg["sp"] if ud == shape["sp"] else \
        ud if deg["sp"] % ud == 0 and ud < deg["sp"] else 2
    lines += [f"{name} {old} -> {new}" for name, old, new in (("ep", cfg.ep, ep), ("ulysses_degree", ud, ulysses))
              if old != new]
    chunks = min(cfg.chunks, 2)
    per_chunk = 2  # two layers a (virtual) stage: one hands over to the next (ZeRO-3's prefetch, 3-D's overlap)
    ac = cfg.ac if cfg.ac in (1, "auto") else 2
    layers = deg["pp"] * chunks * per_chunk
    kv = cfg.model_config(VOCAB).kv_heads or cfg.heads  # the family's default where the job leaves it out (MLA: none)
    ratio = max(1, cfg.heads // kv)
    moe = cfg.model in MOE_MODELS
    experts = ep * 2 if ep > 1 else min(cfg.experts, 4)
    # routing still chooses among the experts (top_k below their count) unless the job routes to all
    top_k = min(cfg.top_k, experts if cfg.top_k >= cfg.experts else experts - 1)
    # key/value heads a tensor rank holds: the job's, up to 2 (a grouping inside a shard stays one)
    kv_here = min(2, max(1, kv // _size(cfg.mode))) * (deg["tp"] if cfg.mode.keyword == "row" else 1)
    common = dict(dp=deg["dp"], pp=deg["pp"], sp=deg["sp"], tp=_spec(cfg.mode, deg["tp"]) if cfg.mode.size_arg
                  else cfg.tp, ep=ep, ulysses_degree=ulysses, chunks=chunks, ac=ac, layers=layers, precision="fp64",
                  device="cpu", backend="auto", init_from=None, data=None,
                  tokenizer="bytes", resume=None, val_every=0, checkpoint_every=0, log="none", quiet=True,
                  phase_times=False, host_reads=False, straggler_threshold=0.0, bsize=64,
                  coarsening=min(cfg.coarsening, 4), experts=experts, top_k=top_k)
    last = None
    micro = dict.fromkeys((min(cfg.microbatches, max(4, 2 * deg["pp"])), deg["pp"], 2 * deg["pp"]))
    # the smallest first: sequence, rows a micro-batch per dp rank (3-D splits them), micro-batches, widths
    kvs = dict.fromkeys((kv_here, 1, 2, 4, 8))  # the job's per-rank grouping first
    for seq, rows, m, kv_r, head_dim in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), micro, kvs, (8, 16)):
        heads = kv_r * ratio
        hidden = heads * head_dim
        changes = dict(common, seq=seq, microbatches=m, batch=deg["dp"] * m * rows, heads=heads, kv_heads=kv_r,
                       hidden=hidden, ffn_hidden=0 if not cfg.ffn_hidden else 2 * hidden,
                       moe_ffn=0 if not cfg.moe_ffn else hidden, shared_ffn=0 if not cfg.shared_ffn else hidden,
                       linformer_k=seq // 2 if cfg.linformer_k else 0)
        if not moe:
            changes.update(experts=cfg.experts, top_k=cfg.top_k)
        try:
            replica = dataclasses.replace(cfg, **changes)
            replica.grid_shape(world)
        except GridError as e:
            last = e
            continue
        sizes = [f"layers {cfg.layers} -> {layers}", f"hidden {cfg.hidden} -> {hidden}",
                 f"heads {cfg.heads}/{kv} -> {heads}/{kv_r}", f"seq {cfg.seq} -> {seq}",
                 f"batch {cfg.batch}/{cfg.microbatches} micro-batches -> {replica.batch}/{m}",
                 f"vocabulary -> {VOCAB} synthetic tokens"]
        if moe:
            sizes.append(f"experts {cfg.experts} (top {cfg.top_k}) -> {experts} (top {replica.top_k})")
        return replica, tuple(lines + sizes), world
    raise GridError(f"verify: no replica of this job on {world} ranks passes the grid's rules: {last}")


def describe(replica: TrainConfig, world: int) -> str:
    """A configuration's grid and the options that change what runs, in one phrase."""
    grid = [f"{a} {getattr(replica, a)}" for a in ("dp", "pp", "sp", "ep") if getattr(replica, a) > 1]
    grid += [f"tp {replica.tp}"] if replica.mode.size_arg else []
    extras = [f"zero {replica.zero}" + (" hybrid" if replica.zero_shard_group != "all" else "")] if replica.zero else []
    extras += [f"schedule {replica.schedule}"] if replica.pp > 1 else []
    extras += [f"attention {replica.attention}"] if replica.sp > 1 else []
    flags = (("packed documents", replica.pack_documents), ("Megatron-SP", replica.tp_sp), ("tied", replica.tie),
             ("fused loss", replica.fused_loss), ("state on the device", replica.offload is False),
             (f"ac {replica.ac}", replica.ac != 1), (f"kv heads {replica.kv_heads}", bool(replica.kv_heads)))
    extras += [name for name, on in flags if on]
    return f"{replica.model} on {' x '.join(grid) or 'one rank'}" + (f" ({', '.join(extras)})" if extras else "")


# ---- the fuzzer ----------------------------------------------------------------------

# What a drawn configuration chooses among: every composition train accepts.
FAMILIES = ("llama", "gpt", "bert", *MOE_MODELS)
MODES = ("none", "row:2", "row:4", "square:2", "cube:2", "subgraph:2", "csub:2")


def draw(rng: random.Random, ranks: int = RANKS, tries: int = 10_000) -> tuple:
    """(TrainConfig, world): a random configuration train accepts on at most `ranks` ranks, drawn
    over every axis of the grid and every option that changes what runs (family, tensor mode,
    dp, pp, sp, ep, ZeRO stage and shard group, schedule and chunks, attention and Ulysses
    degree, packing, key/value heads, tying, checkpointing, Megatron-SP, the fused loss, where
    the optimizer state lives, overlapped reductions, expert capacity), kept only where the one
    validity rule (TrainConfig, grid_shape) takes it: the fuzzer explores what users can ask for."""
    for _ in range(tries):
        family = rng.choice(FAMILIES)
        moe = family in MOE_MODELS
        mode = parse_mode(rng.choice(MODES))
        sp = rng.choice((1, 1, 2, 4))
        pp = rng.choice((1, 2))
        dp = rng.choice((1, 2, 4))
        world = dp * pp * sp * mode.ranks()
        if world > ranks or world < 2:
            continue
        schedule = rng.choice(("auto", *sorted(pipeline.SCHEDULES))) if pp > 1 else "auto"
        attention = rng.choice([a.value for a in SeqAttention]) if sp > 1 else "ring"
        kw = dict(model=family, tp=mode.spec(), dp=dp, pp=pp, sp=sp, schedule=schedule, attention=attention,
                  chunks=2 if schedule == "interleaved" else 1, layers=pp * 2 * (2 if schedule == "interleaved" else 1),
                  ep=rng.choice([e for e in (1, 2, 4) if (dp * sp) % e == 0]) if moe else 1,
                  ulysses_degree=2 if attention == "usp" and sp == 4 else (sp if attention == "usp" else 1),
                  zero=rng.choice((0, 0, 1, 2, 3)), kv_heads=rng.choice((0, 2, 4, 8)), heads=8, hidden=64,
                  tie=pp == 1 and rng.random() < 0.3, ac=rng.choice((1, 1, 2, "auto")),
                  pack_documents=family != "bert" and rng.random() < 0.3,
                  tp_sp=mode.keyword == "row" and rng.random() < 0.4, fused_loss=rng.random() < 0.3,
                  offload=rng.choice((True, False)), overlap_grad_reduce=rng.random() < 0.7,
                  linformer_k=8 if attention == "linformer" else 0, seq=64, batch=dp * 16, microbatches=2,
                  capacity_factor=rng.choice((0.0, 1.0)) if moe else 0.0, experts=4, top_k=2,
                  max_grad_norm=rng.choice((1.0, 0.0)), seed=rng.randrange(1000))
        if kw["zero"]:
            kw["zero_shard_group"] = rng.choice([g.value for g in optim.ShardGroup])
        try:
            cfg = TrainConfig(**kw)
            cfg.grid_shape(world)
            scale_down(cfg, world, ranks)
        except GridError:
            continue
        return cfg, world
    raise GridError(f"verify: no configuration train accepts on {ranks} ranks in {tries} draws")


# ---- what is compared ------------------------------------------------------------------

def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if tuple(actual.shape) != tuple(expected.shape):
        return math.inf
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    den = float(torch.linalg.vector_norm(e))
    num = float(torch.linalg.vector_norm(a - e))
    return num / den if den > 0 else num


def _top(name: str) -> str:
    """A parameter's (or module's) block of the model: embed, layers.N or head."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _stages(stage) -> list:
    return list(stage.chunks) if hasattr(stage, "chunks") else [stage]


def _last_collective(grid) -> str:
    """The newest op this rank's engine issued (its flight recorder), as a phrase; "" where the
    recorder is off."""
    records = grid.flight_records()
    if not records:
        return ""
    r = records[-1]
    peer = f" with rank {r['peer']}" if r.get("peer", -1) >= 0 else ""
    return f"{r['kind']} #{r['seq']} over {r['line']}{peer} ({r['bytes']} bytes)"


class _Outputs:
    """Module outputs of each micro-batch in a step, by dense name: a parallel stage's (recorded
    while the stage's forward runs, so activation checkpointing's recomputations are left out)
    or the dense model's."""

    def __init__(self, grid=None):
        self.grid, self.out, self.after, self.orders, self.handles = grid, {}, {}, {}, []
        self._mb, self._active = {}, {}

    def watch_stage(self, key, stage, modules):
        self._mb[key], self._active[key] = -1, False

        def start(_m, _args):
            self._mb[key] += 1
            self._active[key] = True

        def stop(_m, _args, _out):
            self._active[key] = False
            self.orders[(key, self._mb[key])] = getattr(stage, "_order", None)

        self.handles += [stage.register_forward_pre_hook(start), stage.register_forward_hook(stop)]
        for name, mod in modules:
            self.handles.append(mod.register_forward_hook(self._keeper(key, name)))

    def _keeper(self, key, name):
        def keep(_m, _args, out):
            if self._active[key] and isinstance(out, torch.Tensor):
                mb = self._mb[key]
                self.out[(name, mb)] = (key, out.detach().clone())
                self.after[(name, mb)] = _last_collective(self.grid) if self.grid is not None else ""
        return keep

    def reset(self):
        self.out, self.after, self.orders = {}, {}, {}
        self._mb = {k: -1 for k in self._mb}

    def close(self):
        for h in self.handles:
            h.remove()


def _parallel_modules(stage) -> list:
    """(key, GPTStage, [(dense name, module)]) of this rank's stage (each chunk of the interleaved one)."""
    out = []
    for key, c in enumerate(_stages(stage)):
        mods = [("embed", c.embed)] if c.embed is not None else []
        mods += [(f"layers.{i}", layer) for i, layer in zip(c.first, c.layers)]
        if c.head is not None and not c.fused_loss:  # fused: the head runs inside the loss, on features
            mods.append(("head", c.head))
        out.append((key, c, mods))
    return out


def _seq_shard(stage, t: torch.Tensor, order) -> torch.Tensor:
    """This rank's sequence positions of a (batch, seq, ...) tensor: the layers' sequence layout,
    or packed documents' chunk order (made here from the layout, not by the stage's own method:
    a wrong shard there is what this finds)."""
    if stage.seq is None:
        return t
    length = t.shape[1]
    if order is None:
        pos = scatter(torch.arange(length, device=t.device).expand(1, length), stage.seq, stage.grid)[0]
    else:
        pos = shard_positions(order, length // stage.grid.axes["sp"], stage.grid.index("sp"), t.device)
    return t.index_select(1, pos)


def _expected_output(stage, name: str, dense_out: torch.Tensor, order) -> torch.Tensor:
    """This rank's block of a dense module output (a micro-batch of this dp rank's rows)."""
    t = _seq_shard(stage, dense_out, order)
    if name == "embed":
        return t
    if name == "head":
        if stage.vocab_axis is None:
            return t
        return scatter(t, Layout(*([()] * (t.dim() - 1)), (stage.vocab_axis,)), stage.grid)
    return scatter(t, stage.inner, stage.grid)


class _Dense:
    """The dense model on one process, stepping as the job does: micro-batch i of the step is the
    global batch's i-th (every dp rank's rows of it), the loss their mean (the masked LM: the sum
    over the step's predicted tokens), AdamW with decay on matrices, torch's clipping."""

    def __init__(self, replica: TrainConfig, model_cfg, opt_like):
        torch.manual_seed(replica.seed)
        self.model = models.build(model_cfg, device="cpu").to(torch.float64)
        self.cfg, self.m = replica, replica.microbatches
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if optim.matrices_only(p)], "weight_decay": replica.weight_decay},
                  {"params": [p for p in params if not optim.matrices_only(p)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=replica.lr, betas=opt_like.betas, eps=opt_like.eps)
        self.named = dict(self.model.named_parameters(remove_duplicate=False))
        self.outputs = _Outputs()
        mods = [("embed", self.model.embed)] + [(f"layers.{i}", l) for i, l in enumerate(self.model.layers)]
        self.outputs.watch_stage(0, self.model, mods + [("head", self.model.head)])

    def step(self, lr: float, x, y, docs) -> dict:
        """One step on the global batch; returns loss, norm and the unclipped gradients."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=False)
        set_aux_grad_scale(self.model, 1.0 / self.m)
        self.outputs.reset()
        rows = x.shape[0] // self.m
        predicted = float((y != models.IGNORE).sum())
        total = 0.0
        for i in range(self.m):
            sl = slice(i * rows, (i + 1) * rows)
            logits = self.model(x[sl], documents=None if docs is None else docs[sl])
            if self.cfg.masked_lm:
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[sl].reshape(-1),
                                       ignore_index=models.IGNORE, reduction="sum") / predicted
            else:
                loss = models.GPT.loss(logits, y[sl]) / self.m
            loss.backward()
            total += float(loss.detach())
        unique = list(self.model.parameters())
        for p in unique:  # a parameter no token reached (an expert): its gradient is zero, as the grid's
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = {n: p.grad.detach().clone() for n, p in self.named.items()}
        if self.cfg.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(unique, self.cfg.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in unique])))
        self.opt.step()
        return {"loss": total, "norm": norm, "grads": grads}

    def state(self, name: str, kind: str) -> torch.Tensor:
        p = self.named[name]
        return p.detach() if kind in ("param", "master") else self.opt.state[p][kind]


def _pieces(stage, opt, grid) -> list:
    """(dense name, kind, chunk, this rank's tensor or FlatSlice) of every parameter and state it holds."""
    held = opt.checkpoint_tensors()
    out = []
    for name, p, shape in stage.sharded_items():
        if p.numel() == 0:
            continue
        chunk = chunk_of(name, shape, p, grid)
        out += [(name, kind, chunk, t) for kind, t in held[id(p)].items()]
    return out


def _local(dense_t: torch.Tensor, chunk: dict, t) -> tuple:
    """(this rank's values, the dense tensor's same values)."""
    block = block_of(dense_t, chunk)
    if isinstance(t, FlatSlice):
        return t.values, block.reshape(-1)[t.lo:t.hi]
    return t, block


def _reduction(p, grid) -> str:
    """The collective a parameter's gradient last went through: its sum over its partial axes."""
    axes = placement_of(p).reduce_axes(grid)
    return f"the gradient's reduction over {', '.join(str(a) for a in axes)}" if axes else ""


# ---- the run ---------------------------------------------------------------------------

def synthetic_tokens(seq: int, batch: int, steps: int, seed: int) -> tuple:
    """(tokens, document starts): enough windows for `steps` batches, documents of seq/4 to seq tokens."""
    rng = np.random.default_rng(seed)
    n = (batch * (steps + 1) + 1) * seq + 1
    tokens = rng.integers(0, VOCAB, size=n).astype(np.int64)
    lengths = rng.integers(max(1, seq // 4), seq + 1, size=n // max(1, seq // 4) + 1)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return tokens, starts[starts < n].astype(np.int64)


def run(cfg: TrainConfig, steps: int = STEPS, *, job_world: int | None = None, rtol: float = RTOL,
        world: int | None = None, init=None) -> Report:
    """Verify `cfg` in a world already launched (every rank calls it, e.g. under torchrun): its
    replica (scale_down of the job on job_world ranks, default this world's) must take exactly
    this world's ranks. world: this world's size (default: the launcher's environment's); init:
    makes the replica's grid from gw.init's keyword arguments (default gw.init, from the
    environment). Returns the same Report on every rank."""
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise GridError(f"verify: steps must be a positive integer, got {steps!r}")
    if not isinstance(cfg, TrainConfig):
        raise GridError(f"verify takes a TrainConfig, got {type(cfg).__name__}")
    world = world or launch.launched_world_size(cfg.backend)
    replica, scaled, need = scale_down(cfg, job_world or world, ranks=world)
    if need != world:
        raise GridError(f"verify: the replica of this job takes {need} ranks ({describe(replica, need)}); this world "
                        f"has {world}: launch {need}")
    replica = dataclasses.replace(replica, steps=steps)
    options = train.grid_options(replica, world)
    if replica.zero and replica.zero_shard_group != optim.ShardGroup.ALL.value and world % 2 == 0:
        options["ranks_per_node"] = world // 2  # hybrid sharding across two "nodes": the replica's halves
    grid = (init or gw_init)(**options)
    try:
        return _verify(grid, replica, steps, rtol, scaled, need)
    finally:
        shutdown()


class _Findings:
    """One rank's comparisons of a run: how many, the largest error, and the step's divergences
    with where in the step each was met (PHASES order, then the phase's own)."""

    def __init__(self, grid, rtol: float):
        self.grid, self.rtol = grid, rtol
        self.compared, self.worst, self.step, self.found = 0, 0.0, 0, []

    def check(self, phase: str, module: str, tensor: str, error: float, after: str, where: tuple) -> None:
        self.compared += 1
        self.worst = max(self.worst, error) if error == error else math.inf
        if not error <= self.rtol:  # NaN differs too
            self.found.append([[PHASES.index(phase), *where], Divergence(
                self.step, phase, module, tensor, self.grid.rank, dict(self.grid.coords), error, after)])

    def first(self) -> Divergence | None:
        """The step's first divergence over the ranks (collective): the earliest in the step, then
        the largest error."""
        mine = min(self.found, key=lambda kv: (kv[0], -kv[1].error)) if self.found else None
        every = self.grid.all_gather_json([mine[0], dataclasses.asdict(mine[1])] if mine else None)
        if not any(every):
            return None
        _, d = min((e for e in every if e), key=lambda e: (e[0], -e[1]["error"], e[1]["rank"]))
        return Divergence(**d)


def _check_outputs(findings: _Findings, outputs: _Outputs, dense: "_Dense", chunks: dict, order: dict,
                   rows: int, r: int) -> None:
    """Each module output this rank's stage made against its block of the dense one's."""
    for (name, mb), (key, out) in sorted(outputs.out.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        dense_out = dense.outputs.out[(name, mb)][1][r * rows:(r + 1) * rows]  # this dp rank's rows
        expected = _expected_output(chunks[key], name, dense_out, outputs.orders.get((key, mb)))
        findings.check("forward", name, f"output of micro-batch {mb}", _rel(out, expected), outputs.after[(name, mb)],
                       (mb, order[name]))


def _check_states(findings: _Findings, stage, opt, grid, ref: dict, dense: "_Dense", previous: dict, coef: float,
                  order: dict) -> None:
    """Every parameter's gradient (from Adam's first moment: g_t = (m_t - b1 m_(t-1)) / (1 - b1),
    unclipped by coef), Adam's states and the weights, this rank's pieces against the dense blocks."""
    kinds = {"param": "weights", "master": "optimizer", "exp_avg": "optimizer", "exp_avg_sq": "optimizer"}
    b1 = opt.betas[0]
    params = {name: p for name, p, _ in stage.sharded_items()}
    for name, kind, chunk, t in _pieces(stage, opt, grid):
        module, leaf = name.rsplit(".", 1)
        actual, expected = _local(dense.state(name, kind), chunk, t)
        findings.check(kinds[kind], module, leaf if kind == "param" else f"{kind} of {leaf}", _rel(actual, expected),
                       "", (order[_top(name)], name))
        if kind == "exp_avg":
            grad = (actual - b1 * previous.get(name, torch.zeros_like(actual))) / (1 - b1) / coef
            previous[name] = actual.detach().clone()
            _, want = _local(ref["grads"][name], chunk, t)
            # the backward meets the modules nearest the loss first
            findings.check("backward", module, f"{leaf}'s gradient", _rel(grad, want), _reduction(params[name], grid),
                           (-order[_top(name)], name))


def _verify(grid, replica: TrainConfig, steps: int, rtol: float, scaled: tuple, world: int) -> Report:
    schedule = replica.resolved_schedule(grid.axes["dp"], grid.axes["pp"])
    replica = dataclasses.replace(replica, schedule=schedule, offload=train.resolve_offload(replica, grid))
    model_cfg = replica.model_config(VOCAB)
    torch.manual_seed(replica.seed)
    _, stage, opt, _ = train.build(replica, grid, model_cfg)
    train.connect(replica, grid, stage, opt)
    dense = _Dense(replica, model_cfg, opt)
    outputs = _Outputs(grid)
    watched = _parallel_modules(stage)
    for key, c, mods in watched:
        outputs.watch_stage(key, c, mods)
    chunks = {key: c for key, c, _ in watched}
    tokens, starts = synthetic_tokens(replica.seq, replica.batch, steps, replica.seed)
    dp, r = grid.axes["dp"], grid.coords["dp"]
    mine = data.Reader(tokens, replica.seq, replica.batch, replica.seed, r, dp, microbatches=replica.microbatches)
    whole = data.Reader(tokens, replica.seq, replica.batch, replica.seed, 0, 1, microbatches=replica.microbatches)
    order = {n: i for i, n in enumerate(["embed"] + [f"layers.{i}" for i in range(model_cfg.layers)] + ["head"])}
    findings, previous, first = _Findings(grid, rtol), {}, None
    for step in range(steps):
        findings.step, findings.found = step, []
        lr = replica.lr_at(step)
        opt.lr = lr
        x, y, docs = _batch(replica, mine, starts)
        outputs.reset()
        loss, _ = train.train_step(replica, grid, stage, opt, None, x, y, docs)
        ref = dense.step(lr, *_batch(replica, whole, starts))
        unseen = [(name, mb) for _, _, mods in watched for name, _ in mods for mb in range(replica.microbatches)
                  if (name, mb) not in outputs.out]
        if unseen:  # a module whose hook never fired would never be compared
            raise GridError(f"internal: verify recorded no output of {unseen[0][0]} for micro-batch {unseen[0][1]}")
        _check_outputs(findings, outputs, dense, chunks, order, replica.batch // replica.microbatches // dp, r)
        findings.check("loss", "", "loss", abs(float(loss) - ref["loss"]) / max(abs(ref["loss"]), 1e-300), "", (0,))
        norm = opt.grad_norm_tensor
        coef = 1.0
        if norm is not None:
            findings.check("norm", "", "gradient norm", abs(float(norm) - ref["norm"]) / max(ref["norm"], 1e-300),
                           "", (0,))
            if replica.max_grad_norm is not None:  # torch's clipping coefficient, from the grid's own norm
                coef = min(1.0, replica.max_grad_norm / (float(norm) + 1e-6))
        _check_states(findings, stage, opt, grid, ref, dense, previous, coef, order)
        first = findings.first()
        if first is not None:
            break
    every = grid.all_gather_json([findings.compared, findings.worst])
    for o in (outputs, dense.outputs):
        o.close()
    return Report(first is None, first, steps, world, describe(replica, world), scaled, sum(c for c, _ in every),
                  rtol, max(w for _, w in every))


def _batch(replica: TrainConfig, reader, starts) -> tuple:
    if replica.masked_lm:  # the mask token is the first id past the vocabulary's
        return (*reader.next_masked(VOCAB, VOCAB), None)
    if replica.pack_documents:
        return reader.next_packed(starts)
    return (*reader.next(), None)


def report_path(folder) -> str:
    return os.path.join(folder, "verify.json")
