"""1-D tensor parallelism (seed 003, Megatron-LM) as a mode: axis "tp"; column-parallel
then row-parallel linears (f / g), layer norms replicated, heads split over "tp"."""
from __future__ import annotations

from dataclasses import dataclass

from ..nn.tensor1d import ColumnParallelLinear, RowParallelLinear
from .base import Mode, register


@register
@dataclass(frozen=True)
class Row(Mode):
    """1-D tensor parallelism (Megatron-LM): one axis "tp" of n ranks."""
    n: int
    name = "1d"
    keyword = "row"
    size_field, size_axis = "n", "tp"

    def axes(self):
        return [("tp", self.n)]

    def head_groups_count(self):
        return self.n

    def boundary_axis(self):
        return "tp"

    def vocab_axis(self):
        return "tp"  # seed 003 §3: embedding rows and the head's columns split over tp

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        kw = dict(dtype=dtype, device=device)
        return (lambda i, o: ColumnParallelLinear(i, o, grid, bias, **kw),
                lambda i, o: RowParallelLinear(i, o, grid, bias, **kw))
