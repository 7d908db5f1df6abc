"""The grid's axes and degrees: what a grid, a layout and the planner know of a parallel
split without knowing any layer. A tensor-parallel mode (gridweave/modes/) is a TensorAxes:
the axes it adds to dp, pp and sp."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import GridError


def positive(kind: str, n) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise GridError(f"{kind} size must be a positive integer, got {n!r}")
    return n


class AxesView:
    """Just the axis sizes of a grid: what a mode's layouts read (for callers without a grid)."""

    def __init__(self, axes: dict):
        self.axes = dict(axes)


class TensorAxes:
    """The grid axes of a tensor-parallel split (a mode object: gw.Row(n), gw.Cube(p), ...)."""

    outer = False   # its axes come before dp/pp/sp in naive order (SUPER numbers sub-grids contiguously)

    def axes(self) -> list:
        """(name, size) of the grid axes this split adds, outermost first."""
        return []

    def ranks(self) -> int:
        return math.prod(s for _, s in self.axes())

    def head_groups_count(self) -> int:
        """Groups the attention heads split into (each group's heads stay on its ranks)."""
        return 1

    def accepts(self, model_heads: int, hidden: int, kv_heads: int | None = None) -> bool:
        """Whether a model of these sizes (kv_heads: None for as many as heads) splits over this
        split's ranks (key/value heads are not replicated, Megatron-Core's rule)."""
        groups = self.head_groups_count()
        return model_heads % groups == 0 and (kv_heads or model_heads) % groups == 0 and hidden % self.ranks() == 0


def grid_axes(dp: int, pp: int, sp: int, tp) -> list:
    """Axes in naive order (row-major, last fastest).

    Tensor axes come last, inside data, pipeline and sequence axes, as in Megatron-LM's
    TP x PP x DP layout; a mode with `outer` (SubGraph) comes first: SUPER's naive layout
    numbers the sub-grids contiguously (Fig. 11), and "topology" placement then moves it
    innermost.
    """
    for name, v in (("dp", dp), ("pp", pp), ("sp", sp)):
        positive(name, v)
    if tp is not None and not isinstance(tp, TensorAxes):
        raise GridError(f"tp must be gw.Row(n), gw.Square(q), gw.Cube(p), gw.SubGraph(g), gw.CSub(g), "
                        f"gw.Sequence() or None, got {tp!r}")
    outer = [("dp", dp), ("pp", pp), ("sp", sp)]
    if tp is None:
        return outer
    return tp.axes() + outer if tp.outer else outer + tp.axes()


def stage_axes(axes, pipeline: str = "pp") -> tuple:
    """The axes a pipeline stage's ranks span (every axis of more than one rank but the
    pipeline's and dp): they run collectives together inside the stage's forward and backward,
    so the message-driven schedule makes them take their messages in one order."""
    return tuple(a for a, n in dict(axes).items() if a not in (pipeline, "dp") and n > 1)


def sequence_chunks(sp: int, zigzag: bool) -> int:
    """The pieces a sequence splits into over sp, the one sequence-split rule: 2 sp for causal
    ring attention's zigzag order (rank r holds chunks r and 2 sp - 1 - r), sp otherwise."""
    return 2 * sp if zigzag and sp > 1 else sp


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a grid, validated once (torchtitan's ParallelDims): gw.init, the
    planner's grids, the main job and the command line all ask this object which grids are
    valid. dp, pp, sp: positive integers; tp: a tensor-parallel mode (gw.Row(n), ...) or None."""

    dp: int = 1
    pp: int = 1
    sp: int = 1
    tp: TensorAxes | None = None

    def __post_init__(self):
        grid_axes(self.dp, self.pp, self.sp, self.tp)  # the checks of each degree

    @property
    def tp_ranks(self) -> int:
        return self.tp.ranks() if self.tp is not None else 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.sp * self.tp_ranks

    def axes(self) -> list:
        """(name, size) of the grid's axes in naive order."""
        return grid_axes(self.dp, self.pp, self.sp, self.tp)

    @classmethod
    def for_world(cls, world: int, tp=None, sp: int = 1, dp: int = 0, pp: int = 0,
                  layers: int | None = None) -> "ParallelDims":
        """The degrees on `world` ranks, those given as 0 derived from the others: pp from dp
        when dp is given, else 2 where it divides (and `layers` split in two), dp the rest."""
        tp_ranks = tp.ranks() if tp is not None else 1
        positive("world", world)
        positive("sp", sp)
        if world % (tp_ranks * sp):
            raise GridError(f"tp={tp!r} ({tp_ranks} ranks) x sp={sp} does not divide the world of {world} ranks")
        rest = world // (tp_ranks * sp)
        if dp and pp and dp * pp != rest:
            raise GridError(f"dp={dp} x pp={pp} x tp={tp!r} x sp={sp} needs {dp * pp * tp_ranks * sp} ranks, "
                            f"the world has {world}")
        for name, v in (("dp", dp), ("pp", pp)):
            if v and rest % v:
                raise GridError(f"{name}={v} does not divide the {rest} ranks left by tp={tp!r} x sp={sp} "
                                f"(world {world})")
        even = layers is None or layers % 2 == 0
        pp = pp or (rest // dp if dp else 2 if rest % 2 == 0 and even and rest > 1 else 1)
        return cls(dp=dp or rest // pp, pp=pp, sp=sp, tp=tp)

    def check_model(self, layers: int, heads: int, hidden: int, seq: int, kv_heads: int | None = None,
                    zigzag: bool = True, chunks: int = 1) -> None:
        """A GridError unless a model of these sizes splits over these degrees: its layers over
        pp stages (x chunks each), its heads, key/value heads and hidden size over the tensor
        mode, its sequence into sequence_chunks(sp, zigzag) pieces."""
        self.check_layers(layers, chunks)
        if self.tp is not None and not self.tp.accepts(heads, hidden, kv_heads):
            raise GridError(f"{heads} heads ({kv_heads or heads} key/value heads) and hidden {hidden} do not split "
                            f"over tp={self.tp!r}")
        pieces = sequence_chunks(self.sp, zigzag)
        if seq % pieces:
            raise GridError(f"seq={seq} does not split into the {pieces} chunks sp={self.sp} needs")

    def check_layers(self, layers: int, chunks: int = 1) -> None:
        """A GridError unless `layers` split over pp stages of `chunks` model chunks each."""
        if layers % (self.pp * chunks):
            raise GridError(f"{layers} layers do not split over {self.pp} pipeline stages x {chunks} chunks")

    def check_batch(self, batch: int, microbatches: int = 1) -> None:
        """A GridError unless `batch` sequences split into dp shards of `microbatches` each."""
        if batch % (self.dp * microbatches):
            raise GridError(f"batch {batch} does not split into {self.dp} dp shards of {microbatches} microbatches")
