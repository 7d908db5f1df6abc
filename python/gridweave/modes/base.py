"""The tensor-parallel mode: one object per mode owns its grid axes, its linear pair and
norm, its attention, its activation layouts, how heads split, the placement of every
parameter it creates (through the modules it builds) and its per-layer schedule of
collectives (recorded from the very autograd code that runs them, modes/schedule.py).

Layers, models, the command line and the planner ask the mode object; none compares mode
names. A new mode is one file with a Mode subclass decorated with @register.
"""
from __future__ import annotations

import math

from ..errors import GridError
from ..layout import Layout

_REGISTRY: dict = {}  # written once per class at import, by @register; read-only after


class AxesView:
    """Just the axis sizes of a grid: what a mode's layouts read (for callers without a grid)."""

    def __init__(self, axes: dict):
        self.axes = dict(axes)


def register(cls):
    """Make a Mode subclass known by its layer name (e.g. "3d") and --tp keyword (e.g. "cube")."""
    for key in (cls.name, cls.keyword):
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise GridError(f"mode name {key!r} is taken by {_REGISTRY[key].__name__}")
        _REGISTRY[key] = cls
    return cls


def positive(kind: str, n) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise GridError(f"{kind} size must be a positive integer, got {n!r}")
    return n


class Mode:
    """Base of gw.Row, gw.Square, gw.Cube, gw.SubGraph, gw.CSub and gw.Sequence."""

    name = ""       # the layer mode ("1d", "2d", "3d", "sp", "dsp", "csub")
    keyword = ""    # the command line's --tp keyword (none, row, square, cube, subgraph, csub)
    outer = False   # its axes come before dp/pp/sp in naive order (SUPER numbers sub-grids contiguously)
    size_arg = True  # the constructor takes a size: the dataclass field named size_field
    size_field = ""  # the paper's name of that size (n, q, p, g)
    size_axis = ""   # the grid axis whose length is that size (from_grid reads it)
    planned = True   # gw.plan considers it

    def __post_init__(self):
        if self.size_arg:
            positive(type(self).__name__, self.size)

    @property
    def size(self) -> int:
        """The constructor's argument (N, q, p or g; 1 for Sequence)."""
        return getattr(self, self.size_field) if self.size_arg else 1

    # ---- the grid ----------------------------------------------------------------------
    def axes(self) -> list:
        """(name, size) of the grid axes this mode adds, outermost first."""
        return []

    def ranks(self) -> int:
        return math.prod(s for _, s in self.axes())

    def spec(self) -> str:
        """The command line's spelling: none, row:N, square:Q, cube:P, subgraph:G, csub:G."""
        return f"{self.keyword}:{self.size}"

    @classmethod
    def from_grid(cls, grid):
        """This mode over the axes `grid` has (the layers' mode="1d" etc.)."""
        return cls(grid.axes.get(cls.size_axis, 1)) if cls.size_arg else cls()

    def check_grid(self, grid) -> None:
        for a, s in self.axes():
            if grid.axes.get(a) != s:
                raise GridError(f"{type(self).__name__} needs axis {a!r} of size {s}; the grid has "
                                f"{dict(grid.axes)}: gw.init(tp={self!r})")

    def accepts(self, model_heads: int, hidden: int, kv_heads: int | None = None) -> bool:
        """Whether a model of these sizes (kv_heads: None for as many as heads) splits over this
        mode: the planner's filter and the launcher's check."""
        groups = self.head_groups_count()
        return model_heads % groups == 0 and (kv_heads or model_heads) % groups == 0 and hidden % self.ranks() == 0

    # ---- a layer's pieces ----------------------------------------------------------------
    def head_groups_count(self) -> int:
        """Groups the attention heads split into (each group's heads stay on its ranks)."""
        return 1

    def base_layout(self, grid) -> Layout:
        """(batch, seq, hidden) of a layer's input and output, without the sequence axis."""
        return Layout()

    def layout(self, grid, zigzag: bool = False) -> Layout:
        """The activation layout, the sequence split over "sp" when the grid has it (zigzag:
        the causal ring attention's load-balanced order)."""
        base = self.base_layout(grid)
        if grid.axes.get("sp", 1) <= 1:
            return base
        dims = list(base.dims) + [()] * (3 - len(base.dims))
        dims[1] = ("sp",)
        return Layout(*dims, zigzag=1 if zigzag else None, only=base.only)

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        """Constructors (in, out) -> module of a block's first (in -> wide) and second
        (wide -> in) linear; the second's output layout is the first's input layout."""
        raise NotImplementedError

    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        """The block's LayerNorm or RMSNorm (norm: a gw.nn.Norm; None: LayerNorm)."""
        from ..nn.dense import Norm
        from ..nn.sequence import replicated_norm

        return replicated_norm(norm or Norm.LAYER, hidden, eps, dtype, device)

    def attention(self, hidden, heads, grid, causal, bias, dtype, device, overlap=False, attention="ring",
                  arch=None, **options):
        from ..nn.transformer import SelfAttention

        if options:
            raise GridError(f"{type(self).__name__} takes no attention options {sorted(options)}")
        return SelfAttention(hidden, heads, grid, self, bias, causal, overlap, dtype=dtype, attention=attention,
                             device=device, arch=arch)

    def vocab_axis(self) -> str | None:
        """The axis that splits the vocabulary of the embedding and head (Megatron's vocab
        parallelism), or None: they are replicated over the tensor ranks."""
        return None

    # ---- the planner ------------------------------------------------------------------
    def activation_bytes(self, hidden, seq, heads, tokens, sp) -> float:
        """Bytes of activations one layer keeps for backward per rank, in 16-bit, for `tokens`
        tokens of a replica (Korthikanti et al.: s b h (34 + 5 a s / h))."""
        return tokens * hidden * (34 + 5 * heads * seq / hidden) / self.ranks() / sp

    def boundary_axis(self) -> str | None:
        """An axis over which a stage-boundary activation is replicated: each of its ranks then
        sends 1/size of it and the next stage all-gathers (Megatron's scatter/gather, seed
        003 §4 / Fig. 10); None: the activation is already split."""
        return None

    def boundary_fraction(self) -> float:
        """Share of a replica's (tokens x hidden) activation one rank sends at a stage boundary."""
        return 1.0

    def __repr__(self):
        return f"gw.{type(self).__name__}({self.size})"


def resolve(mode, grid) -> Mode:
    """A layer's `mode` argument: a Mode (checked against the grid), a layer-mode name
    ("1d", "2d", "3d", "sp", "dsp", "csub": the mode over the grid's axes), or None (the
    grid's own tensor mode)."""
    if mode is None:
        return grid.tp
    if isinstance(mode, Mode):
        mode.check_grid(grid)
        return mode
    cls = _REGISTRY.get(mode) if isinstance(mode, str) else None
    if cls is None:
        names = sorted({c.name for c in _REGISTRY.values()})
        raise GridError(f"mode must be a gw mode object or one of {names}, got {mode!r}")
    return cls.from_grid(grid)


def parse(spec: str) -> Mode:
    """--tp none | row:N | square:Q | cube:P | subgraph:G | csub:G -> the mode object."""
    spec = (spec or "none").lower()
    kind, _, n = spec.partition(":")
    cls = _REGISTRY.get(kind)
    keywords = sorted({f"{c.keyword}:N" if c.size_arg else c.keyword for c in _REGISTRY.values()})
    if cls is None or cls.keyword != kind or (cls.size_arg and (not n.isdigit() or int(n) < 1)) or \
            (not cls.size_arg and n):
        raise GridError(f"--tp must be one of {keywords}; got {spec!r}")
    return cls(int(n)) if cls.size_arg else cls()


def known() -> list:
    """Every registered mode class, once."""
    return list(dict.fromkeys(_REGISTRY.values()))


def grid_axes(dp: int, pp: int, sp: int, tp) -> list:
    """Axes in naive order (row-major, last fastest).

    Tensor axes come last, inside data, pipeline and sequence axes, as in Megatron-LM's
    TP x PP x DP layout; a mode with `outer` (SubGraph) comes first: SUPER's naive layout
    numbers the sub-grids contiguously (Fig. 11), and "topology" placement then moves it
    innermost.
    """
    for name, v in (("dp", dp), ("pp", pp), ("sp", sp)):
        positive(name, v)
    if tp is not None and not isinstance(tp, Mode):
        raise GridError(f"tp must be gw.Row(n), gw.Square(q), gw.Cube(p), gw.SubGraph(g), gw.CSub(g), "
                        f"gw.Sequence() or None, got {tp!r}")
    outer = [("dp", dp), ("pp", pp), ("sp", sp)]
    if tp is None:
        return outer
    return tp.axes() + outer if tp.outer else outer + tp.axes()
