"""Tensor-parallel shapes accepted by gw.init(tp=...) and the axes each one adds."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import GridError


def _positive(kind: str, n) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise GridError(f"{kind} size must be a positive integer, got {n!r}")
    return n


@dataclass(frozen=True)
class Row:
    """1-D tensor parallelism (Megatron-LM): one axis "tp" of n ranks."""
    n: int

    def __post_init__(self):
        _positive("Row", self.n)

    def axes(self):
        return [("tp", self.n)]


@dataclass(frozen=True)
class Square:
    """2-D SUMMA: a q x q grid, axes "r" (rows) and "c" (columns)."""
    q: int

    def __post_init__(self):
        _positive("Square", self.q)

    def axes(self):
        return [("r", self.q), ("c", self.q)]


@dataclass(frozen=True)
class Cube:
    """3-D (Bian et al.): a p x p x p cube with the paper's directions z, y, x.

    x varies fastest in naive placement: the weights are stored along x (seed 000 §3).
    """
    p: int

    def __post_init__(self):
        _positive("Cube", self.p)

    def axes(self):
        return [("z", self.p), ("y", self.p), ("x", self.p)]


@dataclass(frozen=True)
class SubGraph:
    """SUPER sub-graph parallelism: g sub-grids; axis "sg" joins the i-th rank of each."""
    g: int

    def __post_init__(self):
        _positive("SubGraph", self.g)

    def axes(self):
        return [("sg", self.g)]


def grid_axes(dp: int, pp: int, sp: int, tp) -> list[tuple[str, int]]:
    """Axes in naive order (row-major, last fastest).

    Tensor axes come last, inside data, pipeline and sequence axes, as in Megatron-LM's
    TP x PP x DP layout. A SubGraph axis comes first: SUPER's naive layout numbers the
    sub-grids contiguously (Fig. 11), and "topology" placement then moves it innermost.
    """
    for name, v in (("dp", dp), ("pp", pp), ("sp", sp)):
        _positive(name, v)
    if tp is not None and not isinstance(tp, (Row, Square, Cube, SubGraph)):
        raise GridError(f"tp must be gw.Row(n), gw.Square(q), gw.Cube(p), gw.SubGraph(g) or None, got {tp!r}")
    outer = [("dp", dp), ("pp", pp), ("sp", sp)]
    if tp is None:
        return outer
    if isinstance(tp, SubGraph):
        return tp.axes() + outer
    return outer + tp.axes()
