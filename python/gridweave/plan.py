"""Performance model and planner: predicted step time, memory and traffic of a grid.

Collectives are alpha-beta costed (ring, halving-doubling, pairwise, tree) over the links a
grid line actually uses under the engine's placement (cpp/placement.h): a line inside a node
uses the intra-node link; a line across nodes shares each node's network link with the
other lines leaving that node. Per-layer traffic follows the papers' algorithms (seed 003
1-D, SUMMA 2-D, seed 000 3-D, seed 004 ring, seed 002 split/join, seed 001 pipeline);
compute follows seed 001 eq. (3); memory the mixed-precision 20 phi (or AxoNN's
4 phi + 16 bsize) and the activations per layer.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from . import _C
from .errors import GridError

PRESETS = Path(__file__).parent / "clusters"


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra_alpha_s: float
    intra_bandwidth_Bps: float
    inter_alpha_s: float
    inter_bandwidth_Bps: float  # per node
    gemm_flops: float
    memory_bytes: float
    about: str = ""


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
    fields = set(Cluster.__dataclass_fields__)
    missing = fields - set(d) - {"about"}
    if missing:
        raise GridError(f"cluster file {p} lacks {sorted(missing)}")
    return Cluster(**{k: v for k, v in d.items() if k in fields})  # extra keys (measurements) are kept out


@dataclass(frozen=True)
class Model:
    hidden: int
    layers: int
    heads: int
    seq: int
    batch: int  # global batch (sequences per step)
    vocab: int = 51200
    bytes_per_value: int = 2  # fp16/bf16 activations and gradients


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
    if op in ("broadcast", "reduce"):  # pipelined tree
        return math.ceil(math.log2(g)) * alpha + nbytes / bw
    if op == "send":
        return alpha + nbytes / bw
    raise GridError(f"no cost model for {op!r}")


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Seed 001 / 003: the pipeline's idle time relative to its busy time, (p-1)/m."""
    return (stages - 1) / microbatches


def transformer_flops(model: Model, recompute: bool = False) -> float:
    """Seed 001 eq. (3): 96 b s l h^2 (1 + s/6h + V/16lh) with activation recomputation,
    72 (...) without."""
    b, s, l, h, v = model.batch, model.seq, model.layers, model.hidden, model.vocab
    return (96 if recompute else 72) * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


# ---- a grid ------------------------------------------------------------------------------

TP_KINDS = ("none", "row", "square", "cube", "subgraph")


@dataclass(frozen=True)
class Grid:
    dp: int = 1
    pp: int = 1
    tp: str = "none"  # none | row | square | cube | subgraph
    tp_size: int = 1  # N (row), q (square), p (cube), g (subgraph)
    sp: int = 1
    placement: str = "topology"

    def tp_ranks(self) -> int:
        return {"none": 1, "row": self.tp_size, "square": self.tp_size ** 2, "cube": self.tp_size ** 3,
                "subgraph": self.tp_size}[self.tp]

    def axes(self):
        from .topology import grid_axes, Cube, Row, Square, SubGraph

        tp = {"none": None, "row": Row, "square": Square, "cube": Cube, "subgraph": SubGraph}[self.tp]
        return grid_axes(self.dp, self.pp, self.sp, tp(self.tp_size) if tp else None)

    def label(self) -> str:
        t = "none" if self.tp == "none" else f"{self.tp}:{self.tp_size}"
        return f"dp{self.dp} pp{self.pp} tp {t} sp{self.sp} ({self.placement})"


def _links(grid: Grid, cluster: Cluster):
    """For each axis: (alpha, effective bandwidth, nodes a line spans), from the placement."""
    placement = _C.Placement(grid.axes(), grid.placement, cluster.gpus_per_node)
    out = {}
    for name, size in grid.axes():
        if size == 1:
            continue
        line = placement.line(0, [name])
        nodes = {placement.node_of(r) for r in line}
        if len(nodes) == 1:
            out[name] = (cluster.intra_alpha_s, cluster.intra_bandwidth_Bps, 1)
        else:  # the node's network link is shared by every line leaving it
            node0 = [r for r in range(min(placement.world_size, cluster.gpus_per_node))]
            here = sum(1 for r in line if placement.node_of(r) == 0)
            flows = max(1, len(node0) // max(here, 1))
            out[name] = (cluster.inter_alpha_s, cluster.inter_bandwidth_Bps / flows, len(nodes))
    return out, placement


def predict(model: Model, grid: Grid, cluster: Cluster, microbatches: int | None = None,
            offload_bsize: int | None = None, recompute: bool = False) -> dict:
    """Predicted step time (s), memory per GPU (bytes) and bytes per axis for one step."""
    n = grid.dp * grid.pp * grid.tp_ranks() * grid.sp
    h, s, L, e = model.hidden, model.seq, model.layers, model.bytes_per_value
    if model.batch % grid.dp:
        raise GridError(f"batch {model.batch} does not split over dp={grid.dp}")
    if L % grid.pp:
        raise GridError(f"{L} layers do not split over pp={grid.pp}")
    b = model.batch // grid.dp  # sequences per data-parallel replica
    m = microbatches or (min(b, 4 * grid.pp) if grid.pp > 1 else 1)
    links, _ = _links(grid, cluster)

    def cost(op, axis, nbytes, algorithm="ring"):
        if axis not in links:
            return 0.0, 0.0
        a, bw, nodes = links[axis]
        g = dict(grid.axes())[axis]
        return collective_time(op, g, nbytes, (a, bw), cluster, algorithm), nbytes

    tokens = b * s / grid.sp  # this rank's tokens of its replica, per step
    per_axis = {}

    def add(axis, t_bytes):
        t, nb = t_bytes
        acc = per_axis.setdefault(axis, [0.0, 0.0])
        acc[0] += t
        acc[1] += nb

    layers_here = L // grid.pp
    lin = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]
    for _ in range(layers_here):
        if grid.tp == "row":  # Megatron: 4 all-reduces of the layer's activations
            for _k in range(4):
                add("tp", cost("all_reduce", "tp", tokens * h * e))
        elif grid.tp == "square":  # SUMMA: q steps of row/column broadcasts per product
            q = grid.tp_size
            for N, K in lin:
                A, B, C = tokens / q * N / q * e, N / q * K / q * e, tokens / q * K / q * e
                for _t in range(q):
                    for axis, nb in (("c", A), ("r", B), ("r", B), ("c", C), ("c", A), ("r", C)):
                        add(axis, cost("broadcast", axis, nb))
        elif grid.tp == "cube":  # seed 000: Algorithms 1-2 per linear, directions swapping
            p = grid.tp_size
            for i, (N, K) in enumerate(lin):
                a, c = ("y", "z") if i % 2 == 0 else ("z", "y")
                A, B, C = tokens * N / p ** 2 * e, N * K / p ** 2 * e, tokens * K / p ** 2 * e
                for op, axis, nb in (("all_gather", a, A), ("all_gather", "x", B), ("reduce_scatter", c, C),
                                     ("all_gather", c, C), ("all_gather", "x", B), ("all_gather", a, A),
                                     ("reduce_scatter", a, A), ("reduce_scatter", "x", B)):
                    add(axis, cost(op, axis, nb))
        elif grid.tp == "subgraph":  # SUPER D&SP: split and join, and their conjugates
            g = grid.tp_size
            for op in ("all_gather", "reduce_scatter", "reduce_scatter", "all_gather"):
                add("sg", cost(op, "sg", tokens * g * h * e / g if op == "all_gather" else tokens * h * e))
        if grid.sp > 1:  # blockwise ring: K, V around the ring forward; K, V and dK, dV backward
            blk = tokens / grid.tp_ranks() * 2 * h * e if grid.tp != "subgraph" else tokens * 2 * h * e
            steps = 2 * (grid.sp - 1) + grid.sp
            for _k in range(steps):
                add("sp", cost("send", "sp", blk))
    if grid.pp > 1:  # activations forward and gradients backward at each stage boundary
        act = tokens / max(grid.tp_ranks() if grid.tp in ("square", "cube") else 1, 1) * h * e
        add("pp", cost("send", "pp", 2 * act))
    phi = 12 * L * h * h + model.vocab * h
    phi_local = 12 * L * h * h / (grid.pp * grid.tp_ranks()) + model.vocab * h
    if grid.tp == "subgraph":
        phi_local = 12 * L * h * h / grid.pp + model.vocab * h  # common layers replicated
    add("dp", cost("all_reduce", "dp", phi_local * e))

    compute = transformer_flops(model, recompute) / n / cluster.gemm_flops
    comm_pipe = sum(v[0] for k, v in per_axis.items() if k not in ("dp", "pp"))
    stage_time = compute + comm_pipe
    bubble = bubble_fraction(grid.pp, m) if grid.pp > 1 else 0.0
    step = stage_time * (1 + bubble) + per_axis.get("pp", [0, 0])[0] + per_axis.get("dp", [0, 0])[0]

    # memory per GPU: weights, gradients and Adam (20 phi mixed precision, or AxoNN's 4 phi + 16 bsize)
    state = (4 * phi_local + 16 * offload_bsize) if offload_bsize else 20 * phi_local
    b_mb = b / m
    act_layer = s / grid.sp * b_mb * h * (34 + 5 * model.heads * s / h)  # bytes, fp16 (Korthikanti et al.)
    if grid.tp == "row":
        act_layer = s / grid.sp * b_mb * h * (10 + 24 / grid.tp_size + 5 * model.heads * s / (h * grid.tp_size))
    elif grid.tp in ("square", "cube"):
        act_layer /= grid.tp_ranks()
    in_flight = min(m, grid.pp)
    act = (2 * s / grid.sp * b_mb * h * layers_here + act_layer) * in_flight if recompute else \
        act_layer * layers_here * in_flight
    return {**asdict(grid), "tp": grid.tp if grid.tp == "none" else f"{grid.tp}:{grid.tp_size}",
            "step_time_s": step, "compute_s": compute, "bubble": bubble, "microbatches": m,
            "memory_bytes": state + act, "parameters": phi,
            "bytes_per_axis": {k: v[1] for k, v in per_axis.items()},
            "seconds_per_axis": {k: v[0] for k, v in per_axis.items()},
            "axis_links": {k: ("intra" if v[2] == 1 else f"inter ({v[2]} nodes)") for k, v in links.items()}}


def enumerate_grids(n: int, model: Model, placements=("topology", "naive")):
    """Every grid of n ranks the model's sizes allow."""
    out = []
    for tp, sizes in (("none", [1]), ("row", range(2, n + 1)), ("square", range(2, int(n ** .5) + 1)),
                      ("cube", range(2, round(n ** (1 / 3)) + 2)), ("subgraph", range(2, n + 1))):
        for t in sizes:
            g = Grid(tp=tp, tp_size=t)
            tr = g.tp_ranks()
            if n % tr or (tp != "none" and model.heads % t) or (tp in ("square", "cube") and model.hidden % (t * t)):
                continue
            rest = n // tr
            for sp in (d for d in range(1, rest + 1) if rest % d == 0 and model.seq % (2 * d) == 0):
                for pp in (d for d in range(1, rest // sp + 1) if (rest // sp) % d == 0 and model.layers % d == 0):
                    dp = rest // (sp * pp)
                    if model.batch % dp:
                        continue
                    for pl in placements:
                        out.append(Grid(dp=dp, pp=pp, tp=tp, tp_size=t, sp=sp, placement=pl))
    return out


def plan(n: int, model: Model, cluster: Cluster, top: int | None = None) -> list:
    """Grids ranked by predicted step time, the ones that fit in memory first."""
    rows = []
    for g in enumerate_grids(n, model):
        try:
            rows.append(predict(model, g, cluster))
        except GridError:
            continue
    rows.sort(key=lambda r: (r["memory_bytes"] > cluster.memory_bytes, r["step_time_s"]))
    return rows[:top] if top else rows
