"""Performance model and planner: predicted step time, memory and traffic of a grid.

The step costed is the step gw.train runs, recorded from its code (recorder.py,
step_schedule): every GEMM and its FLOPs, every other kernel and its bytes, every collective
and pipeline message (Megatron-LM 1-D, SUMMA 2-D, Bian et al. 3-D, Li et al. ring, SUPER
split/join, AxoNN's pipeline), the optimizer's chunked all-reduces and own work, the
activations kept. Collectives are alpha-beta costed (ring, halving-doubling, pairwise, tree)
over the links a grid line uses under the engine's placement (cpp/placement.h): inside a
node the intra-node link; across nodes each node's network links, shared by the lines
leaving it (SUPER eqs. 4-7). step_counters predicts the engine's traffic counters exactly.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from . import _C, pipeline
from .checkpoint import open_index
from .errors import GridError
from .grid import Span, part_members
from .models import ModelConfig
from .axes import AxesView, ParallelDims
from .modes import Mode, Sequence, known
from .modes import parse as parse_mode
from .nn.sequence import SeqAttention
from .recorder import GROUPED_SEND, Experts, optimizer_census, step_schedule, tally_of

PRESETS = Path(__file__).parent / "clusters"


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra_alpha_s: float
    intra_bandwidth_Bps: float
    inter_alpha_s: float
    inter_bandwidth_Bps: float  # per network link (nics_per_node of them per node)
    gemm_flops: float
    memory_bytes: float
    about: str = ""
    vector_bandwidth_Bps: float = 0.0  # memory-bound element-wise work (0: not counted)
    launch_s: float = 0.0  # fixed cost of each kernel or collective call
    nics_per_node: int = 1  # network links per node; lines leaving a node share them
    cores_per_node: int = 0  # CPU ranks: the cores they share (0: each rank has its own device)
    collective_s: float = 0.0  # fixed cost of each collective or message beyond alpha (threads handing off)
    step_s: float = 0.0  # fixed cost of each training step (its own bookkeeping: micro-batch cuts, loss, hooks)
    attention_flops: float = 0.0  # FLOP/s of the fused attention kernels, forward and backward (0: gemm_flops)
    attention_row_s: float = 0.0  # and their seconds per query row (batch x heads x sequence; 0: none)
    gemm_bandwidth_Bps: float = 0.0  # bytes/s of the GEMMs' operands and outputs, read from memory (0: not counted)
    # measured seconds of a one-element all-reduce (the loss, the norm, the micro-batch count) over
    # every rank, its fixed costs included (0: alpha-beta). Gloo's ring sends only the non-empty
    # chunks: one element over 8 CPU ranks took 0.7 ms where alpha-beta says 2 (g - 1) alpha = 11
    scalar_all_reduce_s: float = 0.0
    # measured all-reduces inside a node: (members, seconds, seconds per byte of the buffer) of
    # the engine's all-reduce over lines of that many members, every line of the size busy at
    # once (calibrate.all_reduce_lines); such an all-reduce is costed from its row alone, every
    # other by alpha-beta. Where ranks share cores a ring step is a turn of the cores, not a wire's
    # latency: an 8-member all-reduce's 14 steps took what the all-gather's 7 (alpha's fit) did
    all_reduce_s: tuple = ()

    def __post_init__(self):  # a preset's JSON lists, hashable (the lines' cache keys on the cluster)
        object.__setattr__(self, "all_reduce_s", tuple(tuple(row) for row in self.all_reduce_s))

    @classmethod
    def of(cls, preset: dict) -> "Cluster":
        """The cluster of a preset's fields (a calibration's extra keys, its measurements, left out)."""
        return cls(**{k: v for k, v in preset.items() if k in cls.__dataclass_fields__})

    def measured_all_reduce(self, members: int, nbytes: float) -> float | None:
        """Seconds of an all-reduce of nbytes over a line of `members` inside a node, as
        measured (all_reduce_s), or None where no line of that size was."""
        for g, fixed, per_byte in self.all_reduce_s:
            if g == members:
                return fixed + per_byte * nbytes
        return None


def load_cluster(name_or_path: str, gpus_per_node: int | None = None) -> Cluster:
    """A preset by name (clusters/NAME.json) or a JSON file of the same fields."""
    p = Path(name_or_path)
    if not p.exists():
        p = PRESETS / f"{name_or_path}.json"
    if not p.exists():
        known = sorted(f.stem for f in PRESETS.glob("*.json"))
        raise GridError(f"unknown cluster {name_or_path!r}: use one of {known} or a JSON file path")
    d = json.loads(p.read_text())
    if gpus_per_node:
        d["gpus_per_node"] = gpus_per_node
    missing = {f.name for f in dataclasses.fields(Cluster) if f.default is dataclasses.MISSING} - set(d)
    if missing:
        raise GridError(f"cluster file {p} lacks {sorted(missing)}")
    return Cluster.of(d)


@dataclass(frozen=True)
class Model:
    """The planner's workload: a model (gw.models.ModelConfig, the one model configuration
    train, hf, calibrate and checkpoints share) at a global batch, in a precision."""
    config: ModelConfig
    batch: int  # global batch (sequences per step)
    bytes_per_value: int = 2  # bf16 (2) or fp32 (4) weights, activations and gradients
    embedding: bool = True  # False: the layer stack alone (no embedding, head, loss or optimizer)
    # the attention core as one fused kernel (flash / memory-efficient attention: q, k, v, the
    # output and the log-sum-exp kept), else materialised scores kept for backward (Megatron's
    # 2022 runs, which selective recomputation was made for)
    fused_attention: bool = True
    attention: str = "ring"  # how attention runs over sp (a gw.nn.sequence.SeqAttention value)
    ulysses_degree: int = 1  # attention "usp": the sp ranks of each Ulysses block
    # a mixture of experts: the most loaded expert's slots over the mean (1: balanced routing).
    # The busiest expert's rank sets the step (its grouped GEMM and the rows it receives)
    expert_imbalance: float = 1.0

    hidden = property(lambda self: self.config.hidden)
    layers = property(lambda self: self.config.layers)
    heads = property(lambda self: self.config.heads)
    seq = property(lambda self: self.config.seq)

    @property
    def vocab(self) -> int:
        """The vocabulary the step computes: 0 for the layer stack alone."""
        return self.config.vocab if self.embedding else 0


def model_of(cfg) -> Model:
    """The planner's Model of a gw.train.TrainConfig: the model `gridweave train` builds from
    it, in its precision, at its global batch."""
    # the trained sequence (an imported model's config holds its longest)
    return Model(dataclasses.replace(cfg.model_config(cfg.vocab), seq=cfg.seq), cfg.batch, cfg.compute.dtype.itemsize,
                 attention=cfg.attention, ulysses_degree=cfg.ulysses_degree)


def model_from(source, batch: int, seq: int | None = None, **sizes) -> Model:
    """The planner's Model of a config: a Hugging Face config.json (or the folder holding it) or
    a gridweave model config (a run folder's checkpoint index, an export's model_config.json),
    read by ModelConfig.fields_of. seq defaults to the config's context length; `sizes`
    (hidden, layers, heads, vocab) override it; a config without a vocabulary plans GPT-2's
    padded 51200."""
    p = Path(source)
    candidates = [p] if p.is_file() else [p / "config.json", p / "model_config.json", p / "checkpoint" / "latest"]
    path = next((c for c in candidates if c.exists()), None)
    if path is None:
        raise GridError(f"model {source}: not a config.json or a folder holding one")
    if path.name == "latest":  # a run folder: its newest checkpoint's index
        d = open_index(p / "checkpoint")[1]["config"]["model"]
    else:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise GridError(f"model {path}: not a readable JSON config ({e})") from None
    found = {"family": "gpt", "vocab": 51200, **ModelConfig.fields_of(d)}
    found.update({k: v for k, v in sizes.items() if v})
    if seq:
        found["seq"] = seq
    missing = [k for k in ("hidden", "layers", "heads", "seq") if k not in found]
    if missing:
        raise GridError(f"model {source}: no {', '.join(missing)} in the config; give {', '.join(missing)}")
    return Model(ModelConfig(**{k: v for k, v in found.items() if k in ModelConfig.__dataclass_fields__}), batch)


def step_counters(schedule, axes: dict, placement, rank: int) -> dict:
    """The engine's traffic counters (gw.Grid.stats: ops, messages and bytes sent per axis label)
    that one step of `schedule` (recorder.step_schedule for this rank's stage) leaves on
    `rank` of a grid of `axes` placed by `placement` (gw.Grid.placement or _C.Placement): each op's
    messages are the engine's own (_C.message_schedule), so equal counters mean the planner
    costs the algorithms that ran."""
    names, sizes = list(axes), dict(axes)
    out = {}
    for c, times in schedule.collectives:
        line, part = _label_line(c.axis)  # "pp:control": the host channel over the pp line
        axes = names if line == "world" else line.split(",")
        g = math.prod(sizes[a] for a in axes)
        member = placement.index_in_line(rank, axes)
        if part is not None:  # a line part: blocks of q consecutive members (within), or one of each (across)
            members = part_members(g, member, *part)
            g, member = len(members), members.index(member)
        op = "send" if c.op == GROUPED_SEND else c.op
        sent = [b for _, b, send in _C.message_schedule(op, g, member, int(c.member_bytes), c.root, c.elem) if send]
        d = out.setdefault(c.axis, {"ops": 0, "sent_messages": 0, "sent_bytes": 0})
        d["ops"] += times
        d["sent_messages"] += times * len(sent)
        d["sent_bytes"] += times * sum(sent)
    return out


_PART = re.compile(r"(within|across)(\d+)")


def _label_line(label: str) -> tuple:
    """(the line's axes as the label names them, its part: (Span, block) of a line part's label,
    "dp,sp:within4" (grid.LinePart.label), else None)."""
    line, _, rest = label.partition(":")
    m = _PART.fullmatch(rest)
    return line, (None if m is None else (Span(m.group(1)), int(m.group(2))))


def explain(rows: list, n: int) -> list:
    """Why plan row n (0-based) ranks above row n+1: the parts of their step times and memory
    that differ, largest first, as lines of text."""
    if not 0 <= n < len(rows) - 1:
        raise GridError(f"explain: row {n} (0-based) has no next row to compare with; "
                        f"n goes from 0 to {len(rows) - 2}")
    a, b = rows[n], rows[n + 1]

    def name(r):
        zero = f", zero {r['zero']}" if r.get("zero") else ""
        return f"dp {r['dp']} x pp {r['pp']} x tp {r['tp']} x sp {r['sp']} ({r['placement']}{zero})"

    def parts(r):
        t = r["time_breakdown_s"]
        out = {"compute": t["compute"], "recomputation": t["recompute"], "pipeline bubble": t["bubble"]}
        out.update({f"communication on {k}": v for k, v in t["communication"].items()})
        return out

    pa, pb = parts(a), parts(b)
    diffs = sorted(((pb.get(k, 0.0) - pa.get(k, 0.0), k) for k in set(pa) | set(pb)), key=lambda d: -abs(d[0]))
    lines = [f"#{n + 1} {name(a)}: {a['step_time_s'] * 1e3:.2f} ms per step, {a['memory_bytes'] / 2 ** 30:.2f} GiB",
             f"#{n + 2} {name(b)}: {b['step_time_s'] * 1e3:.2f} ms per step, {b['memory_bytes'] / 2 ** 30:.2f} GiB"]
    if a.get("fits", True) != b.get("fits", True):
        lines.append(f"#{n + 2} does not fit in memory; #{n + 1} does")
    lines.append(f"#{n + 1} is {(b['step_time_s'] - a['step_time_s']) * 1e3:+.2f} ms faster; by part "
                 f"(#{n + 2} minus #{n + 1}):")
    for d, k in diffs:
        if abs(d) > 1e-12:
            lines.append(f"  {k:32s} {d * 1e3:+10.3f} ms")
    ma, mb = a["memory_breakdown_bytes"], b["memory_breakdown_bytes"]
    lines.append("memory per GPU (#" + f"{n + 2} minus #{n + 1}): " +
                 ", ".join(f"{k} {(mb[k] - ma[k]) / 2 ** 20:+.1f} MiB" for k in ma))
    return lines


# ---- alpha-beta costs ------------------------------------------------------------------


def collective_time(op: str, g: int, nbytes: float, link: tuple, cluster: Cluster, algorithm: str = "ring") -> float:
    """Seconds for one collective over g ranks. nbytes: the full buffer (all-gather output,
    reduce-scatter / all-reduce input, broadcast payload). link = (alpha, bandwidth)."""
    if g <= 1 or nbytes <= 0:
        return 0.0
    alpha, bw = link
    frac = (g - 1) / g
    if op in ("all_gather", "reduce_scatter"):
        if algorithm == "pairwise":
            return (g - 1) * alpha + frac * nbytes / bw
        steps = math.ceil(math.log2(g)) if algorithm == "halving_doubling" else g - 1
        return steps * alpha + frac * nbytes / bw
    if op == "all_reduce":
        steps = 2 * math.ceil(math.log2(g)) if algorithm == "halving_doubling" else 2 * (g - 1)
        return steps * alpha + 2 * frac * nbytes / bw
    if op == "all_to_all":
        return (g - 1) * alpha + frac * nbytes / bw
    if op in ("broadcast", "reduce"):  # pipelined: a chain (NCCL's ring) or a binomial tree
        steps = math.ceil(math.log2(g)) if algorithm == "tree" else g - 1
        return steps * alpha + nbytes / bw
    if op == "send":
        return alpha + nbytes / bw
    raise GridError(f"no cost model for {op!r}")


def _measured(op: str, nbytes: float, line: tuple, cluster: Cluster) -> float | None:
    """Seconds of a collective the calibration measured whole (a one-element all-reduce over
    every rank; an all-reduce over a line inside a node of a measured size), else None: it is
    costed alpha-beta plus collective_s. line: plan._Lines' (alpha, bandwidth, nodes, inter, size)."""
    if op != "all_reduce":
        return None
    if nbytes <= 8 and cluster.scalar_all_reduce_s:
        return cluster.scalar_all_reduce_s
    return cluster.measured_all_reduce(line[4], nbytes) if line[2] == 1 else None


def bubble_fraction(stages: int, microbatches: int) -> float:
    """AxoNN / 003: the pipeline's idle time relative to its busy time, (p-1)/m."""
    return (stages - 1) / microbatches


def transformer_flops(model: Model, recompute: bool = False) -> float:
    """AxoNN eq. (3): 96 b s l h^2 (1 + s/6h + V/16lh) with activation recomputation,
    72 (...) without."""
    b, s, l, h, v = model.batch, model.seq, model.layers, model.hidden, model.vocab
    if model.config.moe is not None:  # the active parameters' 6 N per token (PaLM's), plus the scores
        return (4 / 3 if recompute else 1) * b * s * model.config.flops_per_token()
    return (96 if recompute else 72) * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


# ---- a grid ------------------------------------------------------------------------------


PLACEMENTS = ("topology", "naive")  # the engine's placement policies (cpp/placement.h)


@dataclass(frozen=True)
class GridShape:
    """A candidate grid: degrees, the tensor mode object, the placement policy, the optimizer's
    ZeRO stage and the pipeline's schedule. `check` is `gridweave train`'s rule for a grid
    (TrainConfig.grid_shape calls it), so every grid the planner ranks is one train accepts."""
    dp: int = 1
    pp: int = 1
    tp: Mode = Sequence()
    sp: int = 1
    placement: str = "topology"
    zero: int = 0  # the ZeRO stage of the optimizer (gw.optim.DistributedAdam above 0)
    schedule: str = pipeline.AUTO  # the pipeline's schedule (a gw.pipeline.SCHEDULES key, or auto)
    chunks: int = 1  # model chunks per pipeline stage (the interleaved schedule)
    ep: int = 1  # a mixture of experts: expert parallelism, carved out of dp x sp (nn.moe.expert_line)

    def __post_init__(self):
        if not isinstance(self.tp, Mode):
            raise GridError(f"tp must be a mode object (gw.Row(n), gw.Cube(p), ...), got {self.tp!r}")
        self.dims()  # the degrees' own checks
        if self.placement not in PLACEMENTS:
            raise GridError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.zero not in (0, 1, 2, 3):
            raise GridError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.zero and self.dp * self.sp == 1:
            raise GridError(f"zero={self.zero} shards the optimizer state over the data axes; this grid has dp 1 "
                            "and sp 1 (zero=0, or more ranks for dp)")
        if self.schedule not in pipeline.SCHEDULES and self.schedule != pipeline.AUTO:
            raise GridError(f"schedule must be one of {sorted([*pipeline.SCHEDULES, pipeline.AUTO])}, got "
                            f"{self.schedule!r}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise GridError(f"chunks must be a positive integer, got {self.chunks!r}")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise GridError(f"chunks={self.chunks} needs schedule=interleaved")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise GridError(f"ep must be a positive integer, got {self.ep!r}")

    def check(self, model: Model, microbatches: int, ac=1) -> None:
        """A GridError unless `gridweave train` runs `model` on this grid in `microbatches`
        micro-batches with activation checkpointing `ac`: the model's layers, heads and sequence
        split over the degrees, the batch into dp shards of whole micro-batches in the mode's
        layout, the attention over sp, the schedule's and ZeRO's needs. One rule: train checks
        a job with it before any rank starts, the planner every grid it ranks."""
        cfg, dims = model.config, self.dims()
        attn = SeqAttention(model.attention)
        zigzag = attn.zigzag(cfg.causal)
        dims.check_model(cfg.layers, cfg.heads, cfg.hidden, cfg.seq, cfg.kv_heads, zigzag=zigzag, chunks=self.chunks)
        dims.check_batch(model.batch, microbatches)
        self.tp.check_attention(model.attention)
        attn.check(self.sp, model.ulysses_degree, cfg.heads // self.tp.head_groups_count())
        # a micro-batch in the layer's input layout: every sequence split at once (the zigzag's
        # chunks, tp's pieces), the replica's rows split as the mode splits them
        view = AxesView(dict(dims.axes()))
        self.tp.layout(view, zigzag, attn.ring(self.sp, model.ulysses_degree)).without("dp").local_shape(
            (model.batch // self.dp // microbatches, cfg.seq, cfg.hidden), view)
        if self.schedule == "interleaved" and (self.pp < 2 or microbatches % self.pp):
            raise GridError(f"the interleaved schedule needs pp >= 2 and microbatches a multiple of pp, got pp "
                            f"{self.pp}, microbatches {microbatches}")
        if cfg.tie and self.pp > 1:
            raise GridError("tie needs the embedding and the head on one pipeline stage (pp 1)")
        why = pipeline.fixed_order_reason(self.pp, self.dp, self.zero, cfg.moe is not None)
        if why and self.schedule == "message_driven":
            raise GridError(f"schedule=message_driven on pp {self.pp} x dp {self.dp}: {why}, and the message-driven "
                            "schedule runs micro-batches as their messages arrive, so a stage's replicas could take "
                            "them in different orders; use schedule auto (1F1B here), 1f1b or interleaved")
        pipeline.resolve_ac(ac, cfg.layers // (self.pp * self.chunks), cfg.layers)
        self.check_experts(cfg)

    def resolved_schedule(self, cfg) -> str:
        """The schedule this grid runs model config `cfg` with (auto decided: pipeline.resolve_schedule)."""
        return pipeline.resolve_schedule(self.schedule, self.pp, self.dp, self.zero, cfg.moe is not None)

    def check_experts(self, cfg) -> None:
        """A mixture of experts' needs: whole tokens at the MLP or experts split as the MLP is
        (tp none or row:N), ep dividing dp x sp (its line is carved out of them) and the experts,
        tp dividing each expert's width."""
        if cfg.moe is None:
            if self.ep > 1:
                raise GridError(f"ep={self.ep} splits a mixture of experts; this model has none")
            return
        if self.tp.moe_token_axes() is None:
            raise GridError(f"a mixture of experts: tp {self.tp.spec()} splits each token's hidden vector at the MLP; "
                            "experts run whole tokens or split as the MLP (tp none or row:N)")
        if (self.dp * self.sp) % self.ep:
            raise GridError(f"ep={self.ep} does not divide dp x sp = {self.dp} x {self.sp} (experts are split over "
                            "data-parallel ranks)")
        if cfg.moe.experts % self.ep:
            raise GridError(f"{cfg.moe.experts} experts do not split over ep={self.ep}")
        if self.tp.moe_tensor_axis()[0] is not None and cfg.moe.ffn % self.tp.ranks():
            raise GridError(f"experts of width {cfg.moe.ffn} do not split over tp {self.tp.ranks()} (expert tensor "
                            "parallelism splits each expert as the MLP)")

    def spec(self) -> str:
        """The grid as `--grid` writes it (GridShape.parse reads it back)."""
        return (f"dp={self.dp},pp={self.pp},tp={self.tp.spec()},sp={self.sp},zero={self.zero},"
                f"placement={self.placement},schedule={self.schedule},chunks={self.chunks}"
                + (f",ep={self.ep}" if self.ep > 1 else ""))

    @classmethod
    def parse(cls, spec: str) -> "GridShape":
        """A grid written as `gridweave plan --grid` takes it: comma-separated key=value of dp, pp,
        sp, zero, chunks, ep (integers), tp (a mode's spec: row:8, cube:4, ...), placement and
        schedule, e.g. "dp=32,pp=8,tp=row:8"; a key left out takes GridShape's default."""
        keys = ("dp", "pp", "sp", "zero", "chunks", "ep", "tp", "placement", "schedule")
        fields = {}
        for item in filter(None, (p.strip() for p in str(spec).split(","))):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key not in keys:
                raise GridError(f"grid {spec!r}: {item!r} is not one of {', '.join(k + '=' for k in keys)}")
            if key in fields:
                raise GridError(f"grid {spec!r}: {key} given twice")
            if key == "tp":
                fields[key] = parse_mode(value)
            elif key in ("placement", "schedule"):
                fields[key] = value  # checked by the constructor
            else:
                try:
                    fields[key] = int(value)
                except ValueError:
                    raise GridError(f"grid {spec!r}: {key} must be an integer, got {value!r}") from None
        try:
            return cls(**fields)
        except GridError as e:
            raise GridError(f"grid {spec!r}: {e}") from None

    def dims(self) -> ParallelDims:
        return ParallelDims(dp=self.dp, pp=self.pp, sp=self.sp, tp=self.tp)

    def tp_ranks(self) -> int:
        return self.tp.ranks()

    def axes(self):
        return self.dims().axes()


def _links(grid: GridShape, cluster: Cluster):
    """For each line a collective runs on, by its label (an axis, axes joined by commas: the
    optimizer's gradient chunks over dp and sp, or "world"): (alpha, effective bandwidth, nodes
    the line spans, the share of its bytes that cross nodes, its size), from the engine's
    placement and its SUPER traffic model (eqs. 4-7); lines of one rank are left out. A lazy
    mapping: a label's line is worked out when first asked for, once for every grid of these
    axes, placement and cluster (the engine's traffic model over thousands of ranks is most of
    a large plan's costing otherwise)."""
    return _lines_of(tuple(grid.axes()), grid.placement, cluster)


@lru_cache(maxsize=256)
def _lines_of(axes: tuple, placement_name: str, cluster: Cluster):
    placement = _C.Placement(list(axes), placement_name, cluster.gpus_per_node)
    return _Lines(placement, dict(axes), cluster), placement


class _Lines(dict):
    """plan._links' mapping: label -> the line's (alpha, bandwidth, nodes, inter share, size), or None."""

    def __init__(self, placement, sizes: dict, cluster: Cluster):
        super().__init__()
        self.placement, self.sizes, self.cluster = placement, sizes, cluster
        for name, size in sizes.items():
            if size > 1:
                self[name] = self._line([name])

    def __missing__(self, label):
        axes, part = _label_line(label)
        names = [a for a, n in self.sizes.items() if n > 1] if label == "world" else axes.split(",")
        if (":" in label and part is None) or any(a not in self.sizes for a in names) or \
                math.prod(self.sizes[a] for a in names) == 1:
            return None  # a host control channel (a few bytes, uncosted), or a line of one rank
        line = self._line(names, part)
        self[label] = line = line if line[4] > 1 else None  # a part of one member (ep 1)
        return line

    def _line(self, names: list, part=None) -> tuple:
        placement, cluster = self.placement, self.cluster
        line = placement.line(0, names)
        if part is not None:  # the part member 0 of the line is in
            line = [line[m] for m in part_members(len(line), 0, *part)]
        nodes = {placement.node_of(r) for r in line}
        t = placement.traffic(names, "all_gather", 1 << 10)
        inter = 0.0 if len(nodes) == 1 else t["inter_bytes"] / t["bytes"]
        if len(nodes) == 1:
            return cluster.intra_alpha_s, cluster.intra_bandwidth_Bps, 1, inter, len(line)
        # the node's network link is shared by every line leaving it
        here = sum(1 for r in line if placement.node_of(r) == 0)
        flows = max(1, min(placement.world_size, cluster.gpus_per_node) // max(here, 1))
        share = max(1, -(-flows // cluster.nics_per_node))
        return cluster.inter_alpha_s, cluster.inter_bandwidth_Bps / share, len(nodes), inter, len(line)


# Gradient all-reduce bucket (elements) of a fused device optimizer (Megatron's DDP buckets are
# tens of millions of elements)
FUSED_BUCKET = 1 << 24


def _dtype(model: Model):
    import torch

    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[model.bytes_per_value]


def schedule_of(model: Model, grid: GridShape, microbatches: int, stage: int = 0, bsize: int = 1 << 14,
                coarsening: int = 4, clip: bool = True, overlap: bool = False):
    """The recorded step (recorder.step_schedule) of `model` on `grid`, on a rank of
    pipeline stage `stage`; a model of vocab 0 is its layer stack alone (Bian et al.'s and SUPER's
    measurements: no embedding, head, loss or optimizer)."""
    b = model.batch // grid.dp
    return step_schedule(model.config, grid.tp, grid.dp, grid.pp, grid.sp, (("pp", stage),), microbatches,
                         b / microbatches, _dtype(model), bsize, coarsening, clip, False, bool(model.vocab),
                         model.fused_attention, zero=grid.zero if model.vocab else 0,
                         attention=(model.attention, model.ulysses_degree), agreed=grid.resolved_schedule(model.config) == "message_driven",
                         overlap=overlap,
                         experts=None if model.config.moe is None else Experts(grid.ep, model.expert_imbalance))


def work_ops(micro) -> list:
    """A recorded micro-batch as costed work: ("gemm", flops, calls), ("vector", bytes, kernels)
    and (collective, axis, bytes) in issue order (receives cost nothing: their time is the send's)."""
    ops = [("gemm", micro.flops, micro.gemm_calls), ("vector", micro.kernel_bytes, micro.kernels)]
    return ops + [(c.op, c.axis, c.nbytes) for c in micro.collectives if c.op != "recv"]


def layer_ops(model: Model, grid: GridShape, tokens: float) -> list:
    """One transformer layer's work on one rank for `tokens` tokens of its replica, forward and
    backward, as the mode's layer runs it (recorded)."""
    one = dataclasses.replace(model, config=dataclasses.replace(model.config, layers=1), embedding=False,
                              batch=tokens / model.seq * grid.dp)
    return work_ops(schedule_of(one, dataclasses.replace(grid, pp=1), 1).microbatch)


def _check_recompute(recompute) -> None:
    if recompute not in (False, True, "selective"):
        raise GridError(f"recompute must be False, True or 'selective', got {recompute!r}")


def _at(rate: float):
    """Seconds of n units at `rate` units a second (a rate of 0: not counted)."""
    return (lambda n: n / rate) if rate else (lambda n: 0.0)


def predict(model: Model, grid: GridShape, cluster: Cluster, microbatches: int | None = None,
            offload_bsize: int | None = None, recompute: bool | str = False, coarsening: int = 4,
            clip: bool = True, overlap_grad_reduce: bool = False) -> dict:
    """Predicted step time (s), memory per GPU (bytes) and bytes per axis for one gw.train step:
    the step recorded from the code that runs it (recorder.step_schedule: every GEMM and
    its FLOPs, every other kernel and its bytes, every collective and message, the activations
    kept, the optimizer's own work), costed on `cluster` (alpha-beta links from the engine's
    placement, GEMM rate, memory bandwidth, a per-kernel and per-collective cost).
    recompute: False, True (every layer's forward again in backward) or "selective" (the
    attention core's, Korthikanti et al. 2022). The grid's chunks: model chunks per pipeline
    stage (Megatron's interleaved schedule: the bubble is (p-1)/(v m), v times the messages).
    offload_bsize: gw.optim.OffloadAdam's bsize (what gw.train runs: states in host memory,
    updated bsize elements at a time, its kernels and bytes recorded); None: a fused Adam on
    the device, its states there too (Megatron's: 20 phi with half-precision weights).
    overlap_grad_reduce: OffloadAdam's chunks start in the last micro-batch's backward (gw.train's
    default); only what outlasts that backward is exposed, at least the last chunk."""
    _check_recompute(recompute)
    chunks = grid.chunks
    if chunks > 1 and grid.pp < 2:
        raise GridError(f"chunks={chunks} needs pp > 1")

    e = model.bytes_per_value
    dims = grid.dims()
    dims.check_batch(model.batch)
    dims.check_layers(model.layers)
    grid.check_experts(model.config)
    b = model.batch // grid.dp  # sequences per data-parallel replica
    m = microbatches or (min(b, 4 * grid.pp) if grid.pp > 1 else 1)
    links, _ = _links(grid, cluster)
    launch = cluster.launch_s
    vector, gemm_bytes = (_at(cluster.vector_bandwidth_Bps), _at(cluster.gemm_bandwidth_Bps))

    def cost(op, nbytes, line) -> tuple:
        """(seconds of one collective on `line`, whether they hold collective_s)."""
        measured = _measured(op, nbytes, line, cluster)  # the whole call, as timed
        if measured is not None:
            return measured, False
        if op == GROUPED_SEND:  # in its group's launch: its link's latency and bandwidth alone
            return collective_time("send", line[4], nbytes, line[:2], cluster), False
        return launch + cluster.collective_s + collective_time(op, line[4], nbytes, line[:2], cluster), True

    def fixed_cost(op, axis, nbytes) -> bool:  # comm charges it collective_s
        return links[axis] is not None and cost(op, nbytes, links[axis])[1]

    def comm(tally, per_axis, repeat):
        """Seconds of the collectives of `tally` (((op, axis, nbytes), times issued), each of them
        issued `repeat` times again); per axis too. Each distinct collective is costed once."""
        t = 0.0
        for (op, axis, nbytes), n in tally:
            line = links[axis]
            if line is None:
                continue
            c, _ = cost(op, nbytes, line)
            acc = per_axis.setdefault(axis, [0.0, 0.0])
            acc[0] += c * n * repeat
            acc[1] += nbytes * n * repeat
            t += c * n
        return t

    stages = {}
    for s in sorted({0, grid.pp - 1}):  # the middle stages do what these do, without embedding or head
        sched = schedule_of(model, grid, m, s, offload_bsize or FUSED_BUCKET, coarsening, clip,
                            overlap_grad_reduce and bool(offload_bsize))
        def busy(w):  # GEMMs at the GEMM rate and their operands' bandwidth (fused attention at its rate and
            # row cost), the other kernels at memory bandwidth, each a launch
            return ((w.flops - w.fused_attention_flops) / cluster.gemm_flops + gemm_bytes(w.gemm_bytes)
                    + w.fused_attention_flops / (cluster.attention_flops or cluster.gemm_flops)
                    + w.attention_rows * cluster.attention_row_s
                    + (w.gemm_calls + w.kernels) * launch + vector(w.kernel_bytes))

        mb = sched.microbatch
        compute = busy(mb)
        # recomputation: each layer's forward again in backward, a third of its work (AxoNN eq. 3)
        redo = sched.layers * (busy(sched.layer) / 3 if recompute is True else
                               sched.layer.attention_flops / cluster.gemm_flops if recompute else 0.0)
        per_axis = {}
        tally = mb.tally + tuple((k, n * (chunks - 1)) for k, n in mb.tally if k[:2] == ("send", "pp") and chunks > 1)
        t = compute + redo + comm(tally, per_axis, m)  # the sends again: each chunk's boundary
        stages[s] = (t, compute, redo, sched, per_axis)
    s_star = max(stages, key=lambda k: stages[k][0])
    t_stage, compute, redo, sched, per_axis = stages[s_star]
    bubble = bubble_fraction(grid.pp, m) / chunks if grid.pp > 1 else 0.0
    # (m + p - 1) micro-batch slots; where ranks share cores (cores_per_node), the ones idle in
    # the bubble lend theirs to the busy ones (the rates are calibrated with every rank busy), so
    # the bubble costs only what the shared cores cannot absorb
    share = max(1.0, cluster.gpus_per_node / cluster.cores_per_node) if cluster.cores_per_node else 1.0
    pipeline = m * t_stage * max(1.0, (1 + bubble) / share)
    step_comm = comm(sched.step_tally, per_axis, 1)
    if sched.in_backward:  # overlapped chunks (DDP's buckets): they travel during the last backward (2/3 of a
        # micro-batch's work), the last chunk after it; each axis is charged its share of what is exposed
        alone = {}
        reduce_s = comm(tally_of(sched.in_backward), alone, 1)
        # where ranks share cores the chunks' transport threads take the cores the backward computes
        # on: nothing is hidden (the overlap then only saves the wait for the last chunk's peers)
        hidden = 2 / 3 * compute if share <= 1.0 else 0.0
        exposed = max(comm(tally_of(sched.in_backward[-1:]), {}, 1), reduce_s - hidden)
        for k, (sec, nbytes) in alone.items():
            acc = per_axis.setdefault(k, [0.0, 0.0])
            acc[0] += sec * exposed / reduce_s
            acc[1] += nbytes
        step_comm += exposed
    phi_local = sched.shard  # the elements this rank updates: its parameters, or its ZeRO shard of them
    if model.vocab and offload_bsize:  # OffloadAdam's own work (AxoNN §V-B: bsize-element buckets)
        census = optimizer_census(offload_bsize, coarsening, clip, True)
        kernels = census["fixed"] + census["per_tensor"] * sched.parameter_tensors + \
            census["per_bucket"] * -(-phi_local // offload_bsize)
        optimizer_s = kernels * launch + vector(census["bytes_per_element"] * phi_local)
    elif model.vocab:  # a fused Adam: weights and gradient read, fp32 master and two states read and written
        optimizer_s = vector((3 * e + 2 * 12) * phi_local)
    else:
        optimizer_s = 0.0
    step = pipeline + step_comm + optimizer_s + cluster.step_s
    phi = model.config.matrix_parameters(embedding=model.embedding)
    compute_paper = (transformer_flops(model, recompute) / (grid.dp * grid.pp * grid.tp_ranks() * grid.sp)
                     / cluster.gemm_flops)

    # ZeRO-3 in fp32 on the device: the parameter shard is the fp32 master (one copy, not two)
    aliased = grid.zero == 3 and not offload_bsize and e == 4

    def memory(s: int, sched) -> dict:
        """Stage s's memory per rank: its parameters as its modules place them, their gradients
        and the flat gradient buffer in the model's dtype; AxoNN's 16 bsize of device buckets
        (offload) or the fp32 master, exp_avg and exp_avg_sq here (12 phi, with the fp32 gradient
        16: 20 phi with half-precision weights and gradients); the kept activations of the
        micro-batches in flight (recorded). Stage s holds pp - s of them at most (1F1B's bound,
        Megatron-LM §2.2; the message-driven schedule's pipeline_limit max(pp, 2) is not lower):
        the last stage runs each micro-batch's backward as soon as its forward. A pipeline
        stage also holds the engine's messages."""
        phi_here = sched.parameters
        in_flight = min(m, grid.pp - s) if grid.pp > 1 else 1
        # the recorded peak of one micro-batch (its kept activations, their gradients and the
        # temporaries, the gradients made) beside the gradients, plus the others in flight
        mb = sched.microbatch
        act = max(mb.peak_bytes - e * phi_here, mb.saved_bytes) + mb.saved_bytes * (in_flight - 1)
        if recompute is True:  # only each layer's input is kept, and one layer's activations at a time
            layers_here = model.layers // grid.pp
            act = (2 * b / m * model.seq / grid.sp * model.hidden * e * layers_here * in_flight
                   + mb.saved_bytes / max(layers_here, 1))
        if grid.pp > 1:  # the pipeline engine's messages (cpp/pipeline.cpp): two receives posted
            # (double buffers), the message being sent, and the tensor it was copied from
            payload = max((c.nbytes for c in mb.collectives if c.op == "send" and c.axis == "pp"), default=0)
            act += (2 + 1 + 1) * payload
        # OffloadAdam's bucket buffers and the flat gradient it sums (model dtype), or fused Adam's
        # states and fp32 gradient (of this rank's ZeRO shard). The gradients are whole until the
        # step (its reduce-scatter runs after the backward), so zero 2 saves them after the step only.
        optimizer = 16 * offload_bsize + e * phi_here if offload_bsize else (16 - 4 * aliased) * sched.shard
        # ZeRO-3: the shard, and the units gathered whole at once (the one computing, the one prefetched,
        # the ones kept from forward to backward)
        params = e * (sched.shard + sched.gathered) if grid.zero == 3 else e * phi_here
        return {"parameters": params, "gradients": e * phi_here, "optimizer": optimizer, "activations": act}

    by_stage = {s: memory(s, v[3]) for s, v in stages.items()}
    s_mem = max(by_stage, key=lambda k: sum(by_stage[k].values()))
    memory_breakdown = by_stage[s_mem]
    top = stages[s_mem][3]
    # the offloaded fp32 master and two states
    host = 12 * (top.shard if grid.zero else top.parameters) if offload_bsize else 0
    # the ZeRO paper's accounting after a step (Rajbhandari et al. 2020, Fig. 1), as gw.train's
    # metrics.json memory_bytes measures it: each term over N_d where the stage shards it
    held = {"parameters": e * (top.shard if grid.zero == 3 else top.parameters),
            "gradients": e * (top.shard if grid.zero >= 2 else top.parameters),
            "optimizer": (12 - 4 * aliased) * top.shard}
    return {**{k: v for k, v in asdict(grid).items() if k != "tp"}, "tp": grid.tp.spec(),
            "step_time_s": step, "compute_s": compute_paper, "bubble": bubble, "microbatches": m,
            "memory_bytes": sum(memory_breakdown.values()), "parameters": phi,
            "host_bytes": host, "state_bytes": held, "memory_stage": s_mem, "critical_stage": s_star,
            "pipeline_s": pipeline,
            # what the critical rank issues in the step: kernels and collectives (with messages)
            "kernels": m * (sched.microbatch.kernels + sched.microbatch.gemm_calls),
            "collectives": m * sum(n for _, n in sched.microbatch.tally) +
            len(sched.step) + len(sched.in_backward),
            # of them, those charged collective_s (the rest measured whole, or a group's later sends)
            "fixed_cost_collectives": m * sum(n for k, n in sched.microbatch.tally if fixed_cost(*k)) +
            sum(n for k, n in sched.step_tally + tally_of(sched.in_backward) if fixed_cost(*k)),
            # where the step time goes (they add up to step_time_s) and the memory (to memory_bytes)
            "time_breakdown_s": {"compute": compute * m + optimizer_s + cluster.step_s, "recompute": redo * m,
                                 "communication": {k: v[0] for k, v in per_axis.items()},
                                 "bubble": pipeline - m * t_stage},
            "memory_breakdown_bytes": memory_breakdown,
            "bytes_per_axis": {k: {"intra": v[1] * (1 - links[k][3]), "inter": v[1] * links[k][3]}
                               for k, v in per_axis.items()},
            "seconds_per_axis": {k: v[0] for k, v in per_axis.items()},
            # the grid's axes and the lines this step uses (the lines' cache holds other grids' too)
            "axis_links": {k: ("intra" if v[2] == 1 else f"inter ({v[2]} nodes)") for k, v in links.items()
                           if k in per_axis or k in dict(grid.axes())}}


def tensor_modes(n: int, model: Model) -> list:
    """Every tensor mode of at most n ranks that the model's sizes split over, asked of each
    registered mode class that takes part in planning (Mode.planned)."""
    out = []
    for cls in known():
        if not cls.planned:
            continue
        if not cls.size_arg:
            out.append(cls())
            continue
        for size in range(2, n + 1):
            m = cls(size)
            if m.ranks() > n:
                break
            if n % m.ranks() == 0 and m.accepts(model.heads, model.hidden, model.config.arch.kv(model.heads)):
                out.append(m)
    return out


# Sequence-parallel degrees are considered while each rank keeps at least this many tokens:
# below it the ring's per-step latency dwarfs its blocks (Megatron-LM's context parallelism
# and Li et al. use thousands per rank), and every ring step costs the recording a step too.
MIN_TOKENS_PER_SP_RANK = 64


def enumerate_grids(n: int, model: Model, placements=PLACEMENTS, zeros=(0, 1, 2, 3),
                    min_sp_tokens: int = MIN_TOKENS_PER_SP_RANK):
    """Every grid of n ranks that `gridweave train` accepts for the model (GridShape.check, train's
    rule, at one micro-batch; the planner adds only its floor of min_sp_tokens tokens per
    sequence-parallel rank), at each ZeRO stage where it has data axes, with the auto schedule
    (pipeline.resolve_schedule: 1F1B's fixed order where a micro-batch needs it); a mixture of
    experts at every expert-parallel degree."""
    out = []
    for mode in tensor_modes(n, model):
        rest = n // mode.ranks()
        for sp in (d for d in range(1, rest + 1) if rest % d == 0
                   and (d == 1 or model.seq // d >= min_sp_tokens)):
            for pp in (d for d in range(1, rest // sp + 1) if (rest // sp) % d == 0):
                dp = rest // (sp * pp)
                # a mixture of experts: every expert-parallel degree its experts and dp x sp split into
                eps = (1,) if model.config.moe is None else \
                    [e for e in range(1, dp * sp + 1) if (dp * sp) % e == 0 and model.config.moe.experts % e == 0]
                for pl, zero, ep in itertools.product(placements, zeros if dp * sp > 1 else (0,), eps):
                    grid = GridShape(dp=dp, pp=pp, tp=mode, sp=sp, placement=pl, zero=zero, ep=ep)
                    try:
                        grid.check(model, 1)
                    except GridError:
                        continue
                    out.append(grid)
    return out


def microbatch_counts(model: Model, grid: GridShape, sizes=(1, 2, 4, 8, 16)) -> list:
    """The micro-batch counts of the micro-batch sizes (sequences per micro-batch, Megatron's
    --micro-batch-size) that `gridweave train` accepts on this grid (GridShape.check); where it
    accepts none of `sizes` (a mode that splits each micro-batch's rows over many ranks), the
    smallest size it accepts."""
    b = model.batch // grid.dp if grid.dp and model.batch % grid.dp == 0 else 0

    def accepted(mbs):
        try:
            grid.check(model, b // mbs)
        except GridError:
            return False
        return True

    out = [b // mbs for mbs in sizes if b and b % mbs == 0 and accepted(mbs)]
    if not out and b:
        out = [b // mbs for mbs in range(1, b + 1) if b % mbs == 0 and accepted(mbs)][:1]
    return out


def best_microbatching(model: Model, grid: GridShape, cluster: Cluster, sizes=(1, 2, 4, 8, 16), **kw) -> dict:
    """predict() at the micro-batch size (sequences per micro-batch, Megatron's
    --micro-batch-size) that is fastest among those train accepts and that fit in memory, else
    the smallest in memory. A GridError when train accepts none of them."""
    counts = microbatch_counts(model, grid, sizes)
    if not counts:
        grid.check(model, 1)  # its reason
        raise GridError(f"no micro-batch size of {sizes} splits the batch of {model.batch} on {grid.spec()}")
    rows = [predict(model, grid, cluster, microbatches=m, **kw) for m in counts]
    fits = [r for r in rows if r["memory_bytes"] <= cluster.memory_bytes]
    return min(fits, key=lambda r: r["step_time_s"]) if fits else min(rows, key=lambda r: r["memory_bytes"])


def _predicted(grids: list, model: Model, cluster: Cluster, microbatches: int | None, kw: dict) -> list:
    """plan's rows of `grids` (those train accepts), in their order."""
    rows = []
    for g in grids:
        try:
            rows.append(predict(model, g, cluster, microbatches=microbatches, **kw) if microbatches
                        else best_microbatching(model, g, cluster, **kw))
        except GridError:
            continue
    return rows


def _in_workers(grids: list, model: Model, cluster: Cluster, microbatches: int | None, kw: dict, workers: int) -> list:
    """_predicted over `workers` processes (python -m gridweave._plan_worker), each given runs of
    GRIDS_PER_TASK consecutive grids, run i to worker i mod workers, as JSON (grids as their specs);
    the rows taken back in the grids' order. Each worker is its own Python (spawned, not forked:
    a fork would inherit torch's thread pools mid-state)."""
    import subprocess
    import sys
    import tempfile

    runs = [[g.spec() for g in grids[i:i + GRIDS_PER_TASK]] for i in range(0, len(grids), GRIDS_PER_TASK)]
    job = {"model": dataclasses.asdict(model), "cluster": dataclasses.asdict(cluster), "microbatches": microbatches,
           "kw": kw}
    texts = [json.dumps(dict(job, runs=runs[w::workers])) for w in range(workers)]  # bad options fail here
    done, failed = [None] * len(runs), []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for w, text in enumerate(texts):  # outputs to files: no pipe fills while another worker is read
                out, err = (open(Path(tmp) / f"{w}.{k}", "w+") for k in ("out", "err"))
                procs.append((subprocess.Popen([sys.executable, "-m", "gridweave._plan_worker"], stdin=subprocess.PIPE,
                                               stdout=out, stderr=err, text=True), out, err))
                procs[-1][0].stdin.write(text)
                procs[-1][0].stdin.close()
            for w, (p, out, err) in enumerate(procs):
                p.wait()  # no timeout: a worker only computes (no peer to wait for) and ends with its runs
                out.seek(0)
                err.seek(0)
                if p.returncode != 0:
                    failed.append(f"worker {w} exited {p.returncode}: {err.read().strip()[-2000:]}")
                else:
                    done[w::workers] = json.load(out)["rows"]
        finally:  # an error here (or ^C) leaves no worker behind
            for p, out, err in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                out.close()
                err.close()
    if failed:
        raise GridError("plan's workers failed: " + "; ".join(failed))
    return [r for run in done for r in run]


def _worker_main(job: dict) -> dict:
    """_plan_worker's job: {"model", "cluster", "microbatches", "kw", "runs": lists of grid specs}
    -> {"rows": _predicted's rows of each run}."""
    m = dict(job["model"])
    model = Model(ModelConfig(**m.pop("config")), **m)
    cluster = Cluster(**job["cluster"])
    return {"rows": [_predicted([GridShape.parse(s) for s in run], model, cluster, job["microbatches"], job["kw"])
                     for run in job["runs"]]}


# Grids a worker process takes at a time: consecutive grids share their recordings (the same
# mode, sp and pp under the other placement and ZeRO stages), so a worker keeps them together.
GRIDS_PER_TASK = 256
RUNS_PER_WORKER = 1  # the fewest runs worth a worker (it takes seconds to start: torch's import)


def plan(n: int, model: Model, cluster: Cluster, top: int | None = None, microbatches: int | None = None,
         workers: int | None = None, **kw) -> list:
    """Grids (with their ZeRO stage) ranked by predicted step time, the ones that fit in memory
    first, then by memory; of two placements that predict the same, the first. microbatches: the
    job's count (default: the fastest micro-batch size that fits, per grid). workers: processes that predict the grids
    (consecutive runs of GRIDS_PER_TASK each, the rows taken back in order: the same ranking as one
    process); None: one per core this process may use, as long as each has RUNS_PER_WORKER runs
    (a worker takes seconds to start and holds its own recordings), else this process alone."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise GridError(f"workers must be a positive integer (or None: one per core), got {workers!r}")
    _check_recompute(kw.get("recompute", False))  # predict's GridErrors below only skip a grid
    grids = enumerate_grids(n, model)
    tasks = -(-len(grids) // GRIDS_PER_TASK)
    if workers is None:
        workers = max(1, min(len(os.sched_getaffinity(0)), tasks // RUNS_PER_WORKER))
    if workers == 1:
        rows = _predicted(grids, model, cluster, microbatches, kw)
    else:
        rows = _in_workers(grids, model, cluster, microbatches, kw, workers)
    seen, unique = set(), []
    for r in rows:  # a placement that changes nothing (one node) is listed once
        key = (r["dp"], r["pp"], r["tp"], r["sp"], r["zero"], r["step_time_s"], r["memory_bytes"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    rows = unique
    for r in rows:
        r["fits"] = r["memory_bytes"] <= cluster.memory_bytes
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"], r["memory_bytes"]))  # equal speed: less memory
    return rows[:top] if top else rows


# The ranking table's columns (gridweave plan's text output, its --help and the planner guide).
TABLE_COLUMNS = {
    "#": "the grid's place: grids that fit the memory first, then by predicted step time, then by memory",
    "dp": "data-parallel replicas", "pp": "pipeline stages",
    "tp": "the tensor-parallel mode and its size (none, row:n Megatron 1-D, square:n SUMMA, cube:n 3-D, "
          "subgraph:n SUPER)",
    "sp": "sequence-parallel ranks", "ep": "the ranks each mixture-of-experts layer's experts split over",
    "zero": "the ZeRO stage (0: each replica keeps the whole optimizer state)",
    "placement": "how the grid's axes map to nodes", "schedule": "the pipeline schedule",
    "mb": "micro-batches a step (each replica's batch split into this many)",
    "step ms": "predicted time a step", "compute": "forward, backward and recomputation (ms)",
    "bubble": "pipeline idle time (ms)", "comm per axis ms": "communication not hidden, per grid axis",
    "mem GiB": "predicted device memory per rank", "(param/grad/optim/act)": "its parts (GiB)",
}
FOLDED = ("zero", "placement", "schedule")  # a row's values that can fold when they change nothing
SHOWN = ("dp", "pp", "tp", "sp", "ep", "zero", "placement", "schedule", "microbatches")


def fold_equal(rows: list) -> list:
    """The ranking as the table shows it: rows that differ in one of FOLDED only, with equal step time
    and memory (ZeRO 1 and 2 without gradients to drop, a placement that changes nothing), as one row
    at the first one's place, its field listing the values ("1|2"). rows: plan()'s, left as they are."""
    for field in FOLDED:
        kept, at = [], {}
        for r in rows:
            key = tuple(r[k] for k in SHOWN if k != field) + (r["step_time_s"], r["memory_bytes"])
            if key in at:
                first = kept[at[key]]
                values = set(str(first[field]).split("|")) | {str(r[field])}
                kept[at[key]] = {**first, field: "|".join(sorted(values))}  # sorted: folds compare alike
                continue
            at[key] = len(kept)
            kept.append(r)
        rows = kept
    return rows

