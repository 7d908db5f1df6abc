"""Alpha-beta costs of collectives over the links a grid line uses under the engine's placement
(SUPER eqs. 4-7), the pipeline bubble and the transformer's FLOPs."""
from __future__ import annotations

import math
import re
from functools import lru_cache

from .. import _C
from ..pipeline import TABLES, table_for
from ..errors import GridError
from ..grid import Span, part_members
from ..schedules import simulate
from .cluster import Cluster
from .shape import GridShape, Model


_PART = re.compile(r"(within|across)(\d+)")


def _label_line(label: str) -> tuple:
    """(the line's axes as the label names them, its part: (Span, block) of a line part's label,
    "dp,sp:within4" (grid.LinePart.label), else None)."""
    line, _, rest = label.partition(":")
    m = _PART.fullmatch(rest)
    return line, (None if m is None else (Span(m.group(1)), int(m.group(2))))


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


def _measured(op: str, nbytes: float, line: tuple, cluster: Cluster) -> tuple | None:
    """(seconds, whether measured_call_s is among them) of a collective the calibration measured
    whole (a one-element all-reduce over every rank, timed as a step issues it; an all-reduce over
    a line inside a node of a measured size, timed in lockstep, so amid a step measured_call_s
    more), else None: it is costed alpha-beta plus collective_s. line: plan._Lines' (alpha,
    bandwidth, nodes, inter, size)."""
    if op != "all_reduce":
        return None
    if nbytes <= 8 and cluster.scalar_all_reduce_s:
        return cluster.scalar_all_reduce_s, False
    row = cluster.measured_all_reduce(line[4], nbytes) if line[2] == 1 else None
    return None if row is None else (row + cluster.measured_call_s, True)


def bubble_fraction(stages: int, microbatches: int, schedule: str = "1f1b", chunks: int = 1) -> float:
    """The pipeline's idle time relative to its busy time: (p-1)/m (AxoNN; Megatron-LM's 1F1B),
    (p-1)/(v m) interleaved over v chunks (Megatron-LM §2.2); a zero-bubble schedule's from its
    table's simulated step (gw.schedules.simulate) with T_F = T_B = T_W (Qi et al. §3's setting)."""
    if stages < 2:
        return 0.0
    if schedule in TABLES:
        share = 1 / chunks  # each op is one chunk's: that share of a stage's work
        line = simulate(table_for(schedule, stages, microbatches, chunks), share, share, share)
        return line.bubble / (1 - line.bubble)
    return (stages - 1) / microbatches / chunks


def transformer_flops(model: Model, recompute: bool = False) -> float:
    """AxoNN eq. (3): 96 b s l h^2 (1 + s/6h + V/16lh) with activation recomputation,
    72 (...) without."""
    b, s, l, h, v = model.batch, model.seq, model.layers, model.hidden, model.vocab
    if model.config.moe is not None:  # the active parameters' 6 N per token (PaLM's), plus the scores
        return (4 / 3 if recompute else 1) * b * s * model.config.flops_per_token()
    return (96 if recompute else 72) * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


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
