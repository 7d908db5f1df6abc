"""The grid's axes and degrees: what a grid, a layout and the planner know of a parallel
split without knowing any layer. A tensor-parallel mode (gridweave/modes/) is a TensorAxes:
the axes it adds to dp, pp and sp."""
from __future__ import annotations

import math

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
