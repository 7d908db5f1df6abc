"""3-D tensor parallelism (seed 000) as a mode: a p x p x p cube of axes z, y, x. Every
direction fact comes from the engine's cube plan (cpp/cube.h): the layouts of a product's
operands, and that a Linear3D's output directions are its input's swapped (§3.1.3)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _C
from ..layout import Layout
from .base import Mode, register

# The directions (a, c) of a layer's input: Algorithm 1's a = "y", c = "z".
INPUT_DIRECTIONS = ("y", "z")


def matrix_layout(form, operand, a, c) -> Layout:
    """The engine's layout of one operand of a cube product, as a Layout of the matrix."""
    return Layout(*[tuple(d) for d in _C.cube_layout(form, operand, a, c)])


def vector_layout(col) -> Layout:
    """Algorithms 7-8: the diagonal storage of a vector over columns split by `col` (the engine's)."""
    return Layout(*[tuple(d) for d in _C.cube_vector_layout(col)])


def activation_layout(a, c) -> Layout:
    """(batch, seq, hidden) of an activation in directions (a, c): the rows of Algorithm 1's
    A [(x, a) | c] are (batch, seq) flattened, so the batch takes the row split."""
    rows, cols = matrix_layout(_C.CubeForm.AB, 0, a, c).dims
    return Layout(rows, (), cols)


def output_directions(a, c) -> tuple:
    """Directions (a', c') of a product's output C, read off the engine's layout of C
    [(x, c) | a]: its rows are split like an input's over (x, a'), its columns over c'."""
    rows, cols = _C.cube_layout(_C.CubeForm.AB, 2, a, c)
    return ([r for r in rows if r != "x"][0], cols[0])


@register
@dataclass(frozen=True)
class Cube(Mode):
    """3-D (Bian et al.): a p x p x p cube with the paper's directions z, y, x.

    x varies fastest in naive placement: the weights are stored along x (seed 000 §3).
    """
    p: int
    name = "3d"
    keyword = "cube"
    size_field, size_axis = "p", "x"

    def axes(self):
        return [("z", self.p), ("y", self.p), ("x", self.p)]

    def head_groups_count(self):
        return self.p

    def accepts(self, heads, hidden, kv_heads=None):
        return heads % self.p == 0 and (kv_heads or heads) % self.p == 0 and hidden % (self.p * self.p) == 0

    def base_layout(self, grid):
        return activation_layout(*INPUT_DIRECTIONS)

    def linear_pair(self, grid, bias, dtype, device, overlap=False):
        from ..nn.tensor3d import Linear3D

        a, c = INPUT_DIRECTIONS
        a2, c2 = output_directions(a, c)  # the first linear swaps the directions, the second swaps them back
        kw = dict(dtype=dtype, device=device)
        return (lambda i, o: Linear3D(i, o, grid, bias, a, c, overlap, **kw),
                lambda i, o: Linear3D(i, o, grid, bias, a2, c2, overlap, **kw))

    def norm(self, hidden, grid, dtype, device, eps=1e-5, norm=None):
        from ..nn.dense import Norm
        from ..nn.tensor3d import LayerNorm3D

        a, c = INPUT_DIRECTIONS
        return LayerNorm3D(hidden, grid, a, c, eps=eps, dtype=dtype, device=device, norm=norm or Norm.LAYER)

    def boundary_fraction(self):
        return 1.0 / self.ranks()
