"""2-D tensor parallelism (SUMMA, the Optimus baseline of Bian et al.) on a q x q grid:
activations (b, s, h) split by batch over "r" and hidden over "c"."""
from __future__ import annotations

import torch
from torch import nn

from .. import _init
from .. import split
from ..autograd.comm import all_reduce_replicated
from ..autograd.summa import summa_matmul, summa_vector
from ..errors import GridError
from .dense import Norm, ParallelLinearBase, dense_layernorm, linear_tensors, norm_kind, normalize, values
from ..layout import Layout, gather, scatter
from ..sharding import place

ACTIVATION = Layout(("r",), (), ("c",))
WEIGHT = Layout(("r",), ("c",))  # B = W^T, (in, out)
VECTOR = Layout(("c", "r"))      # split over c, then over r for balanced storage


def _check(n, parts, what):
    if n % parts:
        raise GridError(f"{what} = {n} does not split over {parts} ranks of the 2-D grid")


def _check_batch(x, grid):
    q = grid.axes["r"]
    if x.dim() != 3:
        raise GridError(f"2-D modules take (batch, seq, hidden) shards, got {tuple(x.shape)}")
    return q


class Linear2D(ParallelLinearBase, split.Deferrable):
    """Y = X W^T + b with X, W^T and Y in q x q blocks; SUMMA broadcasts per step."""

    FLOAT8 = True  # each SUMMA step's local product (the sum over the steps in the parameters' dtype)
    input_layout = ACTIVATION
    output_layout = ACTIVATION

    def __init__(self, in_features, out_features, grid, bias=True, dtype=None, device=None):
        super().__init__()
        q = grid.axes["r"]
        if grid.axes.get("c") != q:
            raise GridError("Linear2D needs a square grid: gw.init(tp=gw.Square(q))")
        _check(in_features, q, "in_features")
        _check(out_features, q * q, "out_features")
        self.grid, self.in_features, self.out_features = grid, in_features, out_features
        kw = dict(dtype=dtype, device=device or grid.device)
        self.weight = place(nn.Parameter(torch.empty(in_features // q, out_features // q, **kw)), WEIGHT,
                            transposed=True)  # W^T, SUMMA's B
        self.bias = place(nn.Parameter(torch.zeros(out_features // (q * q), **kw)), VECTOR) if bias else None
        _init.normal_(self.weight, std=in_features ** -0.5)

    def forward(self, x):
        _check_batch(x, self.grid)
        b, s, h = x.shape
        y = summa_matmul(x.reshape(b * s, h), self.weight, self.grid, self.weight_store, self.float8)
        if self.bias is not None:  # its gradient's reduce-scatter in r waits for W with the weight's
            y = split.apart(self.weight_store, lambda y, v: y + summa_vector(v, self.grid), y, self.bias)
        return y.reshape(b, s, -1)

    def load_dense(self, dense, order=None):
        w, b = linear_tensors(dense, order)
        with torch.no_grad():
            self.weight.copy_(scatter(w.t().contiguous(), WEIGHT, self.grid))
            if self.bias is not None:
                self.bias.copy_(scatter(b, VECTOR, self.grid))

    def dense_state(self, grad=False):
        pick = values(grad)
        out = {"weight": gather(pick(self.weight), WEIGHT, self.grid).t().contiguous()}
        if self.bias is not None:
            out["bias"] = gather(pick(self.bias), VECTOR, self.grid)
        return out


class LayerNorm2D(nn.Module, split.Deferrable):
    """LayerNorm (or RMSNorm: norm=Norm.RMS) over a hidden dim split over "c": statistics
    all-reduced in c."""

    input_layout = ACTIVATION
    output_layout = ACTIVATION

    def __init__(self, hidden, grid, eps=1e-5, dtype=None, device=None, norm=Norm.LAYER):
        super().__init__()
        q = grid.axes["r"]
        _check(hidden, q * q, "hidden")
        self.grid, self.hidden, self.eps, self.norm = grid, hidden, eps, norm
        kw = dict(dtype=dtype, device=device or grid.device)
        self.weight = place(nn.Parameter(torch.ones(hidden // (q * q), **kw)), VECTOR)
        self.bias = place(nn.Parameter(torch.zeros(hidden // (q * q), **kw)), VECTOR) if norm is Norm.LAYER else None

    def forward(self, x):
        y = normalize(x, self.norm, self.eps, self.hidden, lambda t: all_reduce_replicated(t, self.grid, "c"))
        return split.apart(self.weight_store, self._affine, y, self.weight, self.bias)

    def _affine(self, y, weight, bias):  # the weights' reduce-scatters in r wait for W where the store defers
        y = y * summa_vector(weight, self.grid)
        return y + summa_vector(bias, self.grid) if bias is not None else y

    @classmethod
    def from_dense(cls, dense: nn.Module, grid, **kw):
        m = cls(dense.normalized_shape[0], grid, eps=dense.eps, dtype=dense.weight.dtype, norm=norm_kind(dense), **kw)
        m.load_dense(dense)
        return m

    def load_dense(self, dense):
        with torch.no_grad():
            for name, t in self.named_parameters():
                t.copy_(scatter(getattr(dense, name).detach(), VECTOR, self.grid))

    def dense_state(self, grad=False):
        pick = values(grad)
        return {name: gather(pick(t), VECTOR, self.grid) for name, t in self.named_parameters()}

    def to_dense(self):
        return dense_layernorm(self.dense_state(), self.hidden, self.eps)
