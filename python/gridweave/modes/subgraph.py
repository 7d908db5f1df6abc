"""SUPER's sub-graph parallelism (SUPER) as modes: g sub-grids joined by axis "sg";
attention heads are the branches, one head group per sub-grid.

SubGraph (D&SP): the common layers are data-parallel over every rank (batch over
(dp, sg)); split / sum are all-gather / reduce-scatter along sg. CSub (D&SP-cSub): the
common layers run on sub-grid 0 only; split / sum / slice / concat are broadcast / reduce /
scatter / gather."""
from __future__ import annotations

from dataclasses import dataclass

from ..autograd import subgraph as ops
from ..layout import Layout
from ..nn.dense import Norm
from ..nn.sequence import ReplicatedLinear, replicated_norm
from ..nn.style import Branches, resolve
from ..nn.subgraph import SubGraphAttention
from .base import Mode, register


@register
@dataclass(frozen=True)
class SubGraph(Mode, Branches):
    """SUPER D&SP: g sub-grids; axis "sg" joins the i-th rank of each."""
    g: int
    name = "dsp"
    keyword = "subgraph"
    float8 = True
    size_field, size_axis = "g", "sg"
    outer = True

    def axes(self):
        return [("sg", self.g)]

    def accepts(self, heads, hidden, kv_heads=None):
        # each sub-grid's branch holds heads / g of the heads and of the key/value heads
        return heads % self.g == 0 and hidden % self.g == 0 and (kv_heads or heads) % self.g == 0

    def base_layout(self, grid):
        return Layout(("dp", "sg"), (), ())

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        # the common layers: weights on every rank, gradients summed over (dp, sg, sp)
        partial = self.common_partial()
        return (lambda i, o: ReplicatedLinear(i, o, bias, dtype=dtype, device=device, partial=partial),) * 2

    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        return replicated_norm(norm or Norm.LAYER, hidden, eps, dtype, device, partial=self.common_partial())

    def common_partial(self) -> tuple:
        """The common layers see every sub-grid's samples (D&SP) or zeros off sub-grid 0 (cSub):
        their gradients are partial sums over sg as well as over the data axes."""
        return ("dp", "sg", "sp")

    def attention(self, hidden, heads, grid, causal, bias, dtype, device, overlap=False, attention="ring",
                  arch=None, ulysses_degree=1, projection="branch", method="all_to_all"):
        self.check_attention(attention)
        return SubGraphAttention(hidden, heads, grid, self, projection, method, causal, bias, dtype, device=device,
                                 arch=arch)

    # split / sum / slice / concat between the common grid and the branches (SUPER §IV)
    def split(self, x, grid, shape=None):
        return ops.dsp_split(x, grid)

    def branch_sum(self, y, grid):
        return ops.dsp_sum(y, grid)

    def slice_(self, x, grid, method, shape=None):
        return ops.dsp_slice(x, grid, method)

    def concat(self, y, grid, method):
        return ops.dsp_concat(y, grid, method)


@register
@dataclass(frozen=True)
class CSub(SubGraph):
    """SUPER D&SP-cSub: the common layers on sub-grid 0, the branches on all g sub-grids."""
    name = "csub"
    keyword = "csub"
    # Not planned: its layer's sizes are only known on sub-grid 0 (a broadcast the meta
    # recording cannot read), and with D&SP's GEMMs and more serial work it never wins.
    planned = False

    def base_layout(self, grid):
        return Layout(("dp",), (), (), only=("sg", 0))

    def split(self, x, grid, shape=None):
        return ops.csub_split(x, grid, shape)

    def branch_sum(self, y, grid):
        return ops.csub_sum(y, grid)

    def slice_(self, x, grid, method, shape=None):
        return ops.csub_slice(x, grid, shape)

    def concat(self, y, grid, method):
        return ops.csub_concat(y, grid)

    def common_shape(self, x, grid, known=None):
        """cSub's other sub-grids learn the common shard's shape from sub-grid 0, unless the stage
        said it (known: the step's micro-batch in this layout; no collective, no host read)."""
        return tuple(known) if known is not None else tuple(grid.broadcast_ints(x.shape, "sg", 0))


# The common/branch meetings by layer-mode name (the mode objects pick among autograd/subgraph's):


def split(x, grid, mode="dsp", shape=None):
    """Every branch gets the common tensor. cSub: `shape` is the common shard's shape."""
    return resolve(mode, grid).split(x, grid, shape)


def branch_sum(y, grid, mode="dsp"):
    """The common tensor is the sum of the branches' outputs."""
    return resolve(mode, grid).branch_sum(y, grid)


def slice_(x, grid, mode="dsp", method="all_to_all", shape=None):
    """Branch k gets slice k of the last dim."""
    return resolve(mode, grid).slice_(x, grid, method, shape)


def concat(y, grid, mode="dsp", method="all_to_all"):
    """The common tensor is the branches' outputs concatenated along the last dim."""
    return resolve(mode, grid).concat(y, grid, method)
