"""1-D tensor parallelism (Megatron-LM, Megatron-LM) as a mode: axis "tp"; column-parallel
then row-parallel linears (f / g), layer norms replicated, heads split over "tp"."""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import Layout
from ..nn.dense import Norm
from ..nn.sequence import replicated_norm
from ..nn.tensor1d import ColumnParallelLinear, RowParallelLinear
from ..sharding import DATA_AXES
from .base import Mode, register


@register
@dataclass(frozen=True)
class Row(Mode):
    """1-D tensor parallelism (Megatron-LM): one axis "tp" of n ranks. sequence=True adds
    Megatron's sequence parallelism (Korthikanti et al. 2022): norms and residuals on sequence
    shards over tp, all-gather before the column-parallel linears and reduce-scatter after the
    row-parallel ones in place of f and g (the same bytes, t times fewer activations there)."""
    n: int
    sequence: bool = False
    name = "1d"
    keyword = "row"
    float8 = True
    size_field, size_axis = "n", "tp"

    def axes(self):
        return [("tp", self.n)]

    def head_groups_count(self):
        return self.n

    def boundary_axis(self):
        return None if self.sequence else "tp"  # sequence shards cross a stage boundary as they are

    def vocab_axis(self):
        return "tp"  # Megatron-LM §3: embedding rows and the head's columns split over tp

    def moe_token_axes(self):
        # every tp rank runs the replica's tokens (with tp_sp gathered first) through its share of
        # each expert's width: the tokens are split over the data axes only
        return DATA_AXES

    def moe_tensor_axis(self):
        return "tp", self.sequence  # Megatron's expert tensor parallelism, its size the MLP's

    def layout(self, grid, zigzag=False, ring=None):
        lay = super().layout(grid, zigzag, ring)
        if not self.sequence:
            return lay
        dims = list(lay.dims)
        dims[1] = tuple(dims[1]) + ("tp",)  # each sp shard (or the sequence) cut in tp pieces
        zig = lay.zigzag
        return Layout(*dims, zigzag=zig, only=lay.only, ring=(lay.ring or grid.axes.get("sp", 1)) if zig else None)

    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        if not self.sequence:
            return super().norm(hidden, grid, dtype, device, eps, norm)
        # on sequence shards: its gradient is partial over tp as over the data axes
        return replicated_norm(norm or Norm.LAYER, hidden, eps, dtype, device, partial=DATA_AXES + ("tp",))

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        kw = dict(dtype=dtype, device=device, sequence=self.sequence)
        return (lambda i, o: ColumnParallelLinear(i, o, grid, bias, **kw),
                lambda i, o: RowParallelLinear(i, o, grid, bias, **kw))
