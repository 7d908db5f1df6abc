"""2-D SUMMA (the Optimus baseline of Bian et al.) as a mode: a q x q grid of axes "r", "c";
activations split by batch over "r" and hidden over "c", heads over "c"."""
from __future__ import annotations

from dataclasses import dataclass

from ..nn.dense import Norm
from ..nn.tensor2d import ACTIVATION, LayerNorm2D, Linear2D
from .base import Mode, register


@register
@dataclass(frozen=True)
class Square(Mode):
    """2-D SUMMA: a q x q grid, axes "r" (rows) and "c" (columns)."""
    q: int
    name = "2d"
    keyword = "square"
    float8 = True
    size_field, size_axis = "q", "r"

    @property
    def float8_token_parts(self) -> int:  # the rows split over "r"
        return self.q

    def axes(self):
        return [("r", self.q), ("c", self.q)]

    def head_groups_count(self):
        return self.q

    def base_layout(self, grid):
        return ACTIVATION

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        return (lambda i, o: Linear2D(i, o, grid, bias, dtype=dtype, device=device),) * 2

    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        return LayerNorm2D(hidden, grid, eps=eps, dtype=dtype, device=device, norm=norm or Norm.LAYER)
