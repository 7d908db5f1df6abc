"""3-D tensor parallelism (Bian et al.) as a mode: a p x p x p cube of axes z, y, x. Every
direction fact comes from the engine's cube plan (cpp/cube.h): the layouts of a product's
operands, and that a Linear3D's output directions are its input's swapped (§3.1.3)."""
from __future__ import annotations

from dataclasses import dataclass

from ..autograd.cube import INPUT_DIRECTIONS, activation_layout, output_directions
from ..nn.dense import Norm
from ..nn.tensor3d import LayerNorm3D, Linear3D
from .base import Mode, register


@register
@dataclass(frozen=True)
class Cube(Mode):
    """3-D (Bian et al.): a p x p x p cube with the paper's directions z, y, x.

    x varies fastest in naive placement: the weights are stored along x (Bian et al. §3).
    """
    p: int
    name = "3d"
    keyword = "cube"
    float8 = True
    size_field, size_axis = "p", "x"

    @property
    def float8_token_parts(self) -> int:  # rows split over (x, a), a gathered for the product (Algorithm 1)
        return self.p

    def axes(self):
        return [("z", self.p), ("y", self.p), ("x", self.p)]

    def head_groups_count(self):
        return self.p

    def accepts(self, heads, hidden, kv_heads=None):
        return heads % self.p == 0 and (kv_heads or heads) % self.p == 0 and hidden % (self.p * self.p) == 0

    def base_layout(self, grid):
        return activation_layout(*INPUT_DIRECTIONS)

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        a, c = INPUT_DIRECTIONS
        a2, c2 = output_directions(a, c)  # the first linear swaps the directions, the second swaps them back
        kw = dict(dtype=dtype, device=device)
        return (lambda i, o: Linear3D(i, o, grid, bias, a, c, overlap, **kw),
                lambda i, o: Linear3D(i, o, grid, bias, a2, c2, overlap, **kw))

    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        a, c = INPUT_DIRECTIONS
        return LayerNorm3D(hidden, grid, a, c, eps=eps, dtype=dtype, device=device, norm=norm or Norm.LAYER)
