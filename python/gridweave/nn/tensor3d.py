"""3-D tensor parallelism (Bian et al.) on a p x p x p cube, weights on x. Activations
(b, s, h): batch split over (x, a), hidden over c; a Linear3D returns batch over (x, c)
and hidden over a, so consecutive linears swap a and c (§3.1.3)."""
from __future__ import annotations

import torch
from torch import nn

from .. import _init
from .. import _C, split
from ..autograd.comm import all_reduce_replicated
from ..autograd.cube import AB, activation_layout, cube_matmul, cube_vector, is_diagonal, matrix_layout, vector_layout
from ..errors import GridError
from ..layout import assemble, gather, scatter
from ..sharding import place
from .dense import Norm, ParallelLinearBase, dense_layernorm, linear_tensors, norm_kind, normalize, values

CUBE = ("x", "y", "z")


def _p(grid):
    p = grid.axes.get("x")
    if p is None or grid.axes.get("y") != p or grid.axes.get("z") != p:
        raise GridError("3-D modules need a cube: gw.init(tp=gw.Cube(p))")
    return p


def _check(n, parts, what):
    if n % parts:
        raise GridError(f"{what} = {n} does not split over {parts} ranks of the 3-D cube")


class Linear3D(ParallelLinearBase, split.Deferrable):
    """Y = X W^T + b. W^T is B_lji [c | (a, x)] (Algorithm 1); b is stored on the
    diagonal ranks (Fig. 5) and applied with Algorithm 7. Float8 (gw.float8.convert): each rank's
    local product of its gathered blocks, forward and both gradients."""

    FLOAT8 = True

    def __init__(self, in_features, out_features, grid, bias=True, a="y", c="z", overlap=False, dtype=None,
                 device=None):
        super().__init__()
        p = _p(grid)
        _check(in_features, p, "in_features")
        _check(out_features, p * p, "out_features")
        self.grid, self.a, self.c, self.overlap = grid, a, c, overlap
        self.in_features, self.out_features = in_features, out_features
        kw = dict(dtype=dtype, device=device or grid.device)
        self.weight = place(nn.Parameter(torch.empty(in_features // p, out_features // (p * p), **kw)),
                            self.weight_layout, transposed=True)  # W^T, as Algorithm 1's B
        _init.normal_(self.weight, std=in_features ** -0.5)
        self.diagonal = is_diagonal(grid, a, c)
        n_bias = out_features // (p * p)
        self.bias = place(nn.Parameter(torch.zeros(n_bias if self.diagonal else 0, **kw)), self.bias_layout,
                          diagonal=(a, c)) if bias else None
        self._prefetched = None

    @property
    def input_layout(self):
        return activation_layout(self.a, self.c)

    @property
    def output_layout(self):
        return activation_layout(self.c, self.a)

    @property
    def weight_layout(self):
        return matrix_layout(AB, 1, self.a, self.c)

    @property
    def bias_layout(self):
        return vector_layout(self.a)

    def prefetch(self):
        """Start the all-gather of the weight in x now, for the next forward (async)."""
        plan = _C.cube_plan(AB, self.a, self.c)
        self._prefetched = self.grid.all_gather(self.weight.detach(), axis=plan.gather_rhs.axis,
                                                dim=plan.gather_rhs.dim, async_op=True)

    def forward(self, x):
        p = self.grid.axes["x"]
        if x.dim() != 3 or x.shape[-1] != self.in_features // p:
            raise GridError(f"Linear3D expects a (batch, seq, {self.in_features // p}) shard, got {tuple(x.shape)}")
        b, s, h = x.shape
        pre, self._prefetched = self._prefetched, None
        y = cube_matmul(x.reshape(b * s, h), self.weight, self.grid, AB, self.a, self.c, self.overlap, pre,
                        self.weight_store, self.float8)
        if self.bias is not None:  # C + b: columns split by a, broadcast along c (Algorithm 7); Algorithm 8 in W
            n = self.out_features // (p * p)
            y = split.apart(self.weight_store, lambda y, v: y + cube_vector(v, self.grid, self.a, self.c, n), y,
                            self.bias)
        return y.reshape(b, s, -1)

    def load_dense(self, dense, order=None):
        w, b = linear_tensors(dense, order)
        with torch.no_grad():
            self.weight.copy_(scatter(w.t().contiguous(), self.weight_layout, self.grid))
            if self.bias is not None and self.diagonal:
                self.bias.copy_(scatter(b, self.bias_layout, self.grid))

    def dense_state(self, grad=False):
        pick = values(grad)
        out = {"weight": gather(pick(self.weight), self.weight_layout, self.grid).t().contiguous()}
        if self.bias is not None:
            local = pick(self.bias)
            out["bias"] = _assemble_diagonal(local, self.out_features, self.bias_layout, self.grid, self.diagonal)
        return out


def _assemble_diagonal(local, n, layout, grid, diagonal):
    if local is None:
        local = torch.zeros(0, device=grid.device)
    return assemble(local, (n,), layout, grid, owner=diagonal, over=CUBE)


class LayerNorm3D(nn.Module, split.Deferrable):
    """LayerNorm (or RMSNorm: norm=Norm.RMS) over a hidden dim split over c; gamma and beta
    on the diagonal (Alg. 7-8)."""

    def __init__(self, hidden, grid, a="y", c="z", eps=1e-5, dtype=None, device=None, norm=Norm.LAYER):
        super().__init__()
        p = _p(grid)
        _check(hidden, p * p, "hidden")
        self.grid, self.hidden, self.eps, self.a, self.c, self.norm = grid, hidden, eps, a, c, norm
        self.diagonal = is_diagonal(grid, c, a)
        n = hidden // (p * p) if self.diagonal else 0
        kw = dict(dtype=dtype, device=device or grid.device)
        self.weight = place(nn.Parameter(torch.ones(n, **kw)), self.vector_layout, diagonal=(c, a))
        self.bias = place(nn.Parameter(torch.zeros(n, **kw)), self.vector_layout, diagonal=(c, a)) \
            if norm is Norm.LAYER else None

    @property
    def input_layout(self):
        return activation_layout(self.a, self.c)

    output_layout = input_layout

    @property
    def vector_layout(self):
        return vector_layout(self.c)

    def forward(self, x):
        p = self.grid.axes["x"]
        n = self.hidden // (p * p)
        y = normalize(x, self.norm, self.eps, self.hidden, lambda t: all_reduce_replicated(t, self.grid, self.c))
        return split.apart(self.weight_store, lambda y, w, b: self._affine(y, w, b, n), y, self.weight, self.bias)

    def _affine(self, y, weight, bias, n):  # gamma and beta's Algorithm 8 waits for W where the store defers
        y = y * cube_vector(weight, self.grid, self.c, self.a, n)
        return y + cube_vector(bias, self.grid, self.c, self.a, n) if bias is not None else y

    @classmethod
    def from_dense(cls, dense: nn.Module, grid, **kw):
        m = cls(dense.normalized_shape[0], grid, eps=dense.eps, dtype=dense.weight.dtype, norm=norm_kind(dense), **kw)
        m.load_dense(dense)
        return m

    def load_dense(self, dense):
        if self.diagonal:
            with torch.no_grad():
                for name, t in self.named_parameters():
                    t.copy_(scatter(getattr(dense, name).detach(), self.vector_layout, self.grid))

    def dense_state(self, grad=False):
        pick = values(grad)
        return {name: _assemble_diagonal(pick(t), self.hidden, self.vector_layout, self.grid, self.diagonal)
                for name, t in self.named_parameters()}

    def to_dense(self):
        return dense_layernorm(self.dense_state(), self.hidden, self.eps)
