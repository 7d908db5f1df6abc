"""What a layer asks of its tensor-parallel mode: the protocol gw.nn's layers read and the
mode objects of gridweave/modes/ implement (TransformerEngine's modules take their group as an
argument; ours take their mode). The modes register themselves here by layer-mode name when
gridweave.modes is imported, as the engine's transports register with its registry, so the
layers never import the modes."""
from __future__ import annotations

from ..axes import TensorAxes, positive
from ..errors import GridError
from ..layout import Layout
from .sequence import SeqAttention

_STYLES: dict = {}  # layer-mode name -> class: written once per class at import (register), read-only after


class Style(TensorAxes):
    """A tensor-parallel mode as the layers see it: its grid facts and its layers' pieces."""

    name = ""        # the layer mode ("1d", "2d", "3d", "sp", "dsp", "csub")
    default = False  # the style of a grid without tensor axes (gw.init(tp=None))
    size_arg = True  # the constructor takes a size: the dataclass field named size_field
    size_field = ""  # the paper's name of that size (n, q, p, g)
    size_axis = ""   # the grid axis whose length is that size (from_grid reads it)
    packs_documents = True  # its attention masks packed documents (attend() on the rows its qkv holds)
    float8 = False  # its linears' products run in float8 (gw.float8.convert takes them)
    # the parts a rank's micro-batch tokens are split into in its linears' local products (the weight
    # gradient's contraction, which float8 needs a multiple of 16): 1 but where rows are split
    float8_token_parts = 1

    def __post_init__(self):
        if self.size_arg:
            positive(type(self).__name__, self.size)

    @property
    def size(self) -> int:
        """The constructor's argument (N, q, p or g; 1 for Sequence)."""
        return getattr(self, self.size_field) if self.size_arg else 1

    @classmethod
    def from_grid(cls, grid):
        """This mode over the axes `grid` has (the layers' mode="1d" etc.)."""
        return cls(grid.axes.get(cls.size_axis, 1)) if cls.size_arg else cls()

    def check_grid(self, grid) -> None:
        for a, s in self.axes():
            if grid.axes.get(a) != s:
                raise GridError(f"{type(self).__name__} needs axis {a!r} of size {s}; the grid has "
                                f"{dict(grid.axes)}: gw.init(tp={self!r})")

    def base_layout(self, grid) -> Layout:
        """(batch, seq, hidden) of a layer's input and output, without the sequence axis."""
        return Layout()

    def layout(self, grid, zigzag: bool = False, ring: int | None = None) -> Layout:
        """The activation layout: the batch split over "dp" besides the mode's own axes, the
        sequence over "sp" when the grid has it (zigzag: the causal ring attention's load-
        balanced order, over `ring` ranks when not sp's: USP's outer ring). Every parameter is
        partial over dp (and sp), so an input scattered by this layout, then gw.reduce_gradients,
        gives the dense model's gradients."""
        base = self.base_layout(grid)
        dims = list(base.dims) + [()] * (3 - len(base.dims))
        if "dp" not in dims[0]:
            dims[0] = ("dp",) + dims[0]
        split_sequence = grid.axes.get("sp", 1) > 1
        if split_sequence:
            dims[1] = ("sp",)
        return Layout(*dims, zigzag=1 if zigzag and split_sequence else None, only=base.only,
                      ring=ring if zigzag and split_sequence else None)

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        """Constructors (in, out) -> module of a block's first (in -> wide) and second
        (wide -> in) linear; the second's output layout is the first's input layout."""
        raise NotImplementedError

    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        """The block's LayerNorm or RMSNorm (norm: a gw.nn.Norm; None: LayerNorm)."""
        raise NotImplementedError

    def attention(self, hidden, heads, grid, causal, bias, dtype, device, overlap=False, attention="ring",
                  arch=None, **options):
        """The block's self-attention module."""
        raise NotImplementedError

    def check_attention(self, attention) -> None:
        """A GridError unless this style's attention can run `attention` over sp (every one here)."""
        SeqAttention.of(attention)

    def vocab_axis(self) -> str | None:
        """The axis that splits the vocabulary of the embedding and head (Megatron's vocab
        parallelism), or None: they are replicated over the tensor ranks."""
        return None

    def moe_token_axes(self) -> tuple | None:
        """The axes a mixture-of-experts layer's tokens are split over, where the MLP's input
        holds each token's whole hidden vector on every rank; None where this style splits the
        hidden dim there (experts would need its own linears: not built)."""
        return None

    def moe_tensor_axis(self) -> tuple:
        """(the axis that splits each expert's width, as this style's MLP splits its own, or None;
        whether the MLP's input arrives as sequence shards over it)."""
        return None, False


class Branches(Style):
    """A style whose attention heads are branches on sub-grids (SUPER, SUPER §IV): the
    common tensor and the branches meet through split / sum / slice / concat."""

    packs_documents = False  # the branches' rows move between sub-grids: no document masks there

    def check_attention(self, attention) -> None:
        """SUPER's branches run the ring over sp themselves: Ulysses and USP are the other modes'."""
        a = SeqAttention.of(attention)
        if a in (SeqAttention.ULYSSES, SeqAttention.USP, SeqAttention.LINFORMER):
            raise GridError(f"SUPER's branches run the ring over sp; attention={a.value} is for the other modes")

    def split(self, x, grid, shape=None):
        raise NotImplementedError

    def branch_sum(self, y, grid):
        raise NotImplementedError

    def slice_(self, x, grid, method, shape=None):
        raise NotImplementedError

    def concat(self, y, grid, method):
        raise NotImplementedError

    def common_shape(self, x, grid, known=None):
        """The common shard's shape where only some ranks know it (cSub), else None. known: that
        shape where the caller knows it (the step's micro-batch)."""
        return None


def register(cls):
    """Make a Style subclass known by its layer-mode name (e.g. "3d")."""
    if _STYLES.get(cls.name, cls) is not cls:
        raise GridError(f"mode name {cls.name!r} is taken by {_STYLES[cls.name].__name__}")
    _STYLES[cls.name] = cls
    return cls


def registered() -> list:
    """Every registered style class, once, in registration order."""
    return list(_STYLES.values())


def find(name):
    """The registered class of a layer-mode name, or None."""
    return _STYLES.get(name) if isinstance(name, str) else None


def style_class(name: str):
    """The registered class of a layer-mode name, or a GridError listing the names."""
    cls = find(name)
    if cls is None:
        raise GridError(f"mode must be a gw mode object or one of {sorted(_STYLES)}, got {name!r}")
    return cls


def resolve(mode, grid) -> Style:
    """A layer's `mode` argument: a mode object (checked against the grid), a layer-mode name
    ("1d", "2d", "3d", "sp", "dsp", "csub": the mode over the grid's axes), or None (the
    grid's own tensor mode; a grid without one has the default style's)."""
    if mode is None:
        mode = grid.tp
        if mode is None:
            return next(c for c in _STYLES.values() if c.default).from_grid(grid)
    if isinstance(mode, Style):
        mode.check_grid(grid)
        return mode
    return style_class(mode).from_grid(grid)
