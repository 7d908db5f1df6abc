"""The tensor-parallel mode: one object per mode owns its grid axes, its linear pair and
norm, its attention, its activation layouts, how heads split, the placement of every
parameter it creates (through the modules it builds) and its per-layer schedule of
collectives (recorded from the very autograd code that runs them, recorder.py).

Layers, models, the command line and the planner ask the mode object; none compares mode
names. A new mode is one file with a Mode subclass decorated with @register.
"""
from __future__ import annotations

from ..errors import GridError
from ..nn.dense import Norm
from ..nn.sequence import replicated_norm
from ..nn.style import Style
from ..nn.style import register as register_style
from ..nn.style import registered
from ..nn.transformer import SelfAttention


def register(cls):
    """Make a Mode subclass known, in the layers' one registry (nn.style), by its layer name
    (e.g. "3d"); its keyword (e.g. "cube") must be its own too."""
    taken = next((c for c in known() if c.keyword == cls.keyword and c is not cls), None)
    if taken is not None:
        raise GridError(f"mode keyword {cls.keyword!r} is taken by {taken.__name__}")
    return register_style(cls)


class Mode(Style):
    """Base of gw.Row, gw.Square, gw.Cube, gw.SubGraph, gw.CSub and gw.Sequence: a Style (the
    grid facts and the pieces the layers read) that builds gw.nn's modules."""

    keyword = ""    # its written name's kind (none, row, square, cube, subgraph, csub): spec() and parse()
    planned = True   # gw.plan considers it

    def spec(self) -> str:
        """The mode written as text (none, row:N, square:Q, cube:P, subgraph:G, csub:G): how the
        command line, checkpoint indexes and the planner's rows name it; parse() reads it."""
        return f"{self.keyword}:{self.size}"

    # ---- a layer's pieces ----------------------------------------------------------------
    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        return replicated_norm(norm or Norm.LAYER, hidden, eps, dtype, device)

    def attention(self, hidden, heads, grid, causal, bias, dtype, device, overlap=False, attention="ring",
                  arch=None, ulysses_degree=1, **options):
        if options:
            raise GridError(f"{type(self).__name__} takes no attention options {sorted(options)}")
        return SelfAttention(hidden, heads, grid, self, bias, causal, overlap, dtype=dtype, attention=attention,
                             device=device, arch=arch, ulysses_degree=ulysses_degree)

    # ---- the pipeline -----------------------------------------------------------------
    def boundary_axis(self) -> str | None:
        """An axis over which a stage-boundary activation is replicated: each of its ranks then
        sends 1/size of it and the next stage all-gathers (Megatron's scatter/gather, seed
        003 §4 / Fig. 10); None: the activation is already split."""
        return None

    def __repr__(self):
        return f"gw.{type(self).__name__}({self.size})"


def parse(spec: str) -> Mode:
    """A mode written as text (Mode.spec: none | row:N | square:Q | cube:P | subgraph:G |
    csub:G) -> the mode object."""
    spec = (spec or "none").lower()
    kind, _, n = spec.partition(":")
    cls = next((c for c in known() if c.keyword == kind), None)
    keywords = sorted(f"{c.keyword}:N" if c.size_arg else c.keyword for c in known())
    if cls is None or (cls.size_arg and (not n.isdigit() or int(n) < 1)) or (not cls.size_arg and n):
        raise GridError(f"tp must be one of {keywords}; got {spec!r}")
    return cls(int(n)) if cls.size_arg else cls()


def known() -> list:
    """Every registered mode class, once."""
    return [c for c in registered() if issubclass(c, Mode)]
