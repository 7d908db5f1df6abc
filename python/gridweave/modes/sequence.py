"""Sequence parallelism alone (Li et al.) as a mode: no tensor axes; every weight on every
rank, the batch over "dp" and the sequence over "sp" (ring attention)."""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import Layout
from ..nn.sequence import ReplicatedLinear
from ..sharding import DATA_AXES
from .base import Mode, register


@register
@dataclass(frozen=True)
class Sequence(Mode):
    """No tensor parallelism: replicated weights, data x sequence parallel activations."""
    name = "sp"
    default = True  # the layers of a grid without tensor axes
    keyword = "none"
    float8 = True
    size_arg = False

    def spec(self):
        return "none"

    def base_layout(self, grid):
        return Layout(("dp",), (), ())

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        return (lambda i, o: ReplicatedLinear(i, o, bias, dtype=dtype, device=device),) * 2

    def moe_token_axes(self):
        return DATA_AXES

    def __repr__(self):
        return "gw.Sequence()"
