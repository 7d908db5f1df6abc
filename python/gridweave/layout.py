"""Layouts: how a full tensor is split over the grid, and gw.scatter / gw.gather.

A Layout lists, for each tensor dimension, the axes that split it (outermost first);
dimensions past the list, and every axis not named, are replicated. Chunk k of a
dimension split by (u, v) lives on the rank whose index over (u, v) is k, the same
row-major order in which grid.all_gather over (u, v) concatenates. A dimension may instead
be split by one LinePart (experts over an expert-parallel part of the data axes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _C
from .errors import GridError


def _sizes(grid, axes) -> list:
    """The sizes of the axes splitting a dim: axis names (read from grid.axes: a grid, or just its
    sizes), or one LinePart (a grid's: one size)."""
    return [grid.axes[a] for a in axes] if all(isinstance(a, str) for a in axes) else [grid.size(axes)]


def _coords(grid, axes) -> list:
    """This rank's coordinates along the axes splitting a dim (as _sizes)."""
    return [grid.coords[a] for a in axes] if all(isinstance(a, str) for a in axes) else [grid.index(axes)]


def _ranks(grid, axes) -> int:
    return math.prod(_sizes(grid, axes))


@dataclass(frozen=True)
class Layout:
    dims: tuple  # per dim: tuple of axis names
    zigzag: int | None = None  # a dim split over its axes in zigzag order (causal ring attention)
    only: tuple | None = None  # (axis, index): only ranks there hold data (SUPER's cSub common grid)
    ring: int | None = None  # the zigzag's ring when it is not the split's ranks (USP: the outer ring)

    def __init__(self, *dims, zigzag=None, only=None, ring=None):
        norm = tuple(tuple([d] if isinstance(d, str) else (d or ())) for d in dims)
        object.__setattr__(self, "dims", norm)
        object.__setattr__(self, "zigzag", zigzag)
        object.__setattr__(self, "only", tuple(only) if only is not None else None)
        object.__setattr__(self, "ring", ring)
        if zigzag is not None and not (0 <= zigzag < len(norm) and norm[zigzag]):
            raise GridError(f"zigzag dim {zigzag} must be a split dim of {norm}")

    def zigzag_ring(self, grid) -> int:
        """The ranks of the zigzag's ring: the sequence is 2 x that many chunks, ring member r
        holding chunks r and 2R-1-r (split further over its block of ranks under USP)."""
        return self.ring or _ranks(grid, self.dims[self.zigzag])

    def lines(self, grid) -> list:
        """The lines gather() and scatter() of this layout run collectives over (Grid.connect items)."""
        items = [tuple(d) for d in self.dims if _ranks(grid, d) > 1]
        return items + ([self.only[0]] if self.only is not None else [])

    def without(self, *axes) -> "Layout":
        """This layout with `axes` no longer splitting anything (a replica's layout: without "dp")."""
        dims = [tuple(a for a in d if a not in axes) for d in self.dims]
        return Layout(*dims, zigzag=self.zigzag, only=self.only, ring=self.ring)

    def axes(self) -> tuple:
        """Every axis that splits some dimension, in order."""
        return tuple(a for d in self.dims for a in d)

    def local_shape(self, shape, grid) -> tuple:
        out = list(shape)
        for d, axes in enumerate(self.dims):
            k = _ranks(grid, axes)
            if d == self.zigzag and d < len(shape) and shape[d] % (2 * self.zigzag_ring(grid)):
                raise GridError(f"dim {d} of size {shape[d]} does not split into {2 * self.zigzag_ring(grid)} "
                                f"zigzag chunks over axes {axes}")
            if d >= len(shape):
                raise GridError(f"layout {self} has more dims than a {len(shape)}-d tensor")
            if out[d] % k:
                raise GridError(f"dim {d} of size {shape[d]} does not split over axes {axes} ({k} ranks)")
            out[d] //= k
        return tuple(out)

    def global_shape(self, local_shape, grid) -> tuple:
        """The full shape whose shard on a rank is `local_shape` (the inverse of local_shape)."""
        return tuple(n * (_ranks(grid, self.dims[d]) if d < len(self.dims) else 1)
                     for d, n in enumerate(local_shape))

    def __repr__(self):
        return "Layout(" + ", ".join("(" + ",".join(map(str, d)) + ")" for d in self.dims) + ")"


def local_slices(shape, layout: Layout, grid) -> tuple:
    """This rank's slice of a full tensor of `shape` under `layout` (the engine's block math)."""
    layout.local_shape(shape, grid)  # GridError if a dim does not split
    sl = []
    for d in range(len(shape)):
        axes = layout.dims[d] if d < len(layout.dims) else ()
        begin, end = _C.block_range(shape[d], _sizes(grid, axes), _coords(grid, axes))
        sl.append(slice(begin, end))
    return tuple(sl)


def zigzag_order(length: int, n: int, device="cpu") -> torch.Tensor:
    """Global positions in zigzag order: rank r's shard is chunks r and 2n-1-r of 2n."""
    c = length // (2 * n)
    return torch.cat([torch.cat([torch.arange(r * c, (r + 1) * c, device=device),
                                 torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c, device=device)])
                      for r in range(n)])


@dataclass(frozen=True)
class ChunkOrder:
    """A sequence cut in equal chunks of `chunk` tokens, dealt to the members of a ring: member r
    holds chunks members[r] (ascending), its local sequence their concatenation (the zigzag is
    the case of 2 chunks a member, r and 2R-1-r). visible: the (query chunk, key chunk) pairs with
    a pair of tokens that may attend (packed documents, causality), or None (by position only).
    Made on the host from the host's document ids (gw.documents.balanced_order): ring attention
    skips the blocks of invisible pairs without reading the device."""
    chunk: int
    members: tuple
    visible: frozenset | None = None

    @property
    def length(self) -> int:
        return self.chunk * sum(len(m) for m in self.members)

    def runs(self, member: int) -> list:
        """(local slice, first global position, chunk index) of each chunk of a member's sequence."""
        c = self.chunk
        return [(slice(i * c, (i + 1) * c), j * c, j) for i, j in enumerate(self.members[member])]

    def positions(self, member: int, device="cpu") -> torch.Tensor:
        """Global positions of a member's local sequence."""
        return torch.cat([torch.arange(g, g + self.chunk, device=device) for _, g, _ in self.runs(member)])

    def permutation(self, device="cpu") -> torch.Tensor:
        """Global positions in the members' order (the sequence as the ring members hold it, in turn)."""
        return torch.cat([self.positions(r, device) for r in range(len(self.members))])

    def sees(self, q_chunk: int, k_chunk: int) -> bool:
        return self.visible is None or (q_chunk, k_chunk) in self.visible


def scatter(full: torch.Tensor, layout: Layout, grid) -> torch.Tensor:
    """This rank's shard of `full` (every rank passes the same full tensor)."""
    layout.local_shape(full.shape, grid)  # GridError before anything moves
    if layout.zigzag is not None:
        d = layout.zigzag
        full = full.index_select(d, zigzag_order(full.shape[d], layout.zigzag_ring(grid), full.device))
    local = full[local_slices(full.shape, layout, grid)].contiguous()
    if layout.only is not None and grid.coords[layout.only[0]] != layout.only[1]:
        return local[:0].contiguous()
    return local


def gather(local: torch.Tensor, layout: Layout, grid, shape=None) -> torch.Tensor:
    """The full tensor on every rank, from each rank's shard. Layouts with `only` need the
    full `shape` (ranks outside hold empty shards)."""
    if layout.only is not None:
        axis, index = layout.only
        inner = Layout(*layout.dims, zigzag=layout.zigzag, ring=layout.ring)
        # The owners' lines along the layout's other axes hold owners only, so the others
        # just wait for the broadcast.
        t = gather(local, inner, grid) if grid.coords[axis] == index else local.new_empty(shape)
        return grid.broadcast(t.contiguous(), axis=axis, src=index)
    t = local.detach().contiguous()
    for d, axes in enumerate(layout.dims):
        if _ranks(grid, axes) > 1:
            t = grid.all_gather(t, axis=tuple(axes), dim=d)
    if layout.zigzag is not None:
        d = layout.zigzag
        order = zigzag_order(t.shape[d], layout.zigzag_ring(grid), t.device)
        t = t.index_select(d, torch.argsort(order))
    return t


def assemble(local: torch.Tensor, full_shape, layout: Layout, grid, owner: bool = True, over=None) -> torch.Tensor:
    """The full tensor from shards that only `owner` ranks hold (e.g. diagonal storage):
    each owner writes its slice into zeros and a sum over `over` (default: the layout's
    axes) assembles them; every block must have exactly one owner on that sum's lines."""
    full = torch.zeros(full_shape, dtype=local.dtype, device=local.device)
    if owner:
        full[local_slices(full_shape, layout, grid)] = local.detach()
    axes = tuple(over) if over is not None else tuple(dict.fromkeys(layout.axes()))
    if axes:
        grid.all_reduce(full, axis=axes)
    return full
