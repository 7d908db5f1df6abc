"""1-D tensor parallelism (Megatron-LM, Megatron-LM): column- and row-parallel linears with
the f / g operators, vocab-parallel embedding. Axis "tp"."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import _init
from ..autograd.comm import (copy_to_parallel, gather_from_parallel, reduce_from_parallel, reduce_scatter_sequence,
                             scatter_to_parallel)
from .. import float8, split
from ..errors import GridError
from ..layout import Layout, gather, scatter
from ..sharding import DATA_AXES, place
from .dense import ParallelLinearBase, linear_tensors, values

REPLICATED = Layout()


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise GridError(f"{what} = {n} does not split over {parts} tensor-parallel ranks")
    return n // parts


class _SequenceColumnLinear(torch.autograd.Function):
    """all-gather + linear of Megatron's sequence parallelism (Korthikanti et al. 2022, §4.2.2):
    backward all-gathers the input again rather than keeping it, so only this rank's sequence
    shard is saved (1/t of the activation), and reduce-scatters the input's gradient. deferred:
    (store, micro-batch, the parameters) where the weights' gradients wait for W (the weights come
    detached), which all-gathers the input again itself (gw.split)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grid, axis, deferred=None, recipe=None):
        ctx.grid, ctx.axis, ctx.has_bias, ctx.deferred, ctx.recipe = grid, axis, bias is not None, deferred, recipe
        ctx.save_for_backward(x, weight)
        full = grid.all_gather(x.contiguous(), axis=axis, dim=1)
        return float8.output(full, weight, recipe, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        grid, axis, has_bias, recipe = ctx.grid, ctx.axis, ctx.has_bias, ctx.recipe

        def grads(full=None):
            full = grid.all_gather(x.contiguous(), axis=axis, dim=1) if full is None else full
            return float8.grad_weight(dy, full, recipe), (dy.reshape(-1, dy.shape[-1]).sum(0) if has_bias else None)

        def dx():
            return grid.reduce_scatter(float8.grad_input(dy, weight, recipe).contiguous(), axis=axis, dim=1)
        if ctx.deferred is not None:
            store, mb, params = ctx.deferred
            d = dx()
            split.defer(store, mb, params, grads)
            return d, None, None, None, None, None, None
        full = grid.all_gather(x.contiguous(), axis=axis, dim=1)
        return (dx(), *grads(full), None, None, None, None)


class ColumnParallelLinear(ParallelLinearBase, split.Deferrable):
    """Y = X W^T + b with W split by output rows: f (identity fwd, all-reduce bwd) on the input;
    sequence=True (Megatron's sequence parallelism): the input is a sequence shard over the
    axis, all-gathered forward and its gradient reduce-scattered backward."""

    FLOAT8 = True  # each rank's products on its shard

    def __init__(self, in_features, out_features, grid, bias=True, gather_output=False, axis="tp", dtype=None,
                 device=None, sequence=False):
        super().__init__()
        self.grid, self.axis, self.gather_output, self.sequence = grid, axis, gather_output, sequence
        self.in_features, self.out_features = in_features, out_features
        n = _split(out_features, grid.size(axis), "out_features")
        kw = dict(dtype=dtype, device=device or grid.device)
        self.weight = place(nn.Parameter(torch.empty(n, in_features, **kw)), Layout((axis,)))
        self.bias = place(nn.Parameter(torch.zeros(n, **kw)), Layout((axis,))) if bias else None
        _init.normal_(self.weight, std=in_features ** -0.5)

    @property
    def input_layout(self):
        return Layout((), (self.axis,)) if self.sequence else REPLICATED

    @property
    def output_layout(self):
        return REPLICATED if self.gather_output else Layout((), (), (self.axis,))

    def forward(self, x):
        if self.sequence:
            deferred, (w, b) = split.deferral(self.weight_store, x, (self.weight, self.bias))  # W adds their gradients
            y = _SequenceColumnLinear.apply(x, w, b, self.grid, self.axis, deferred, self.float8)
        else:
            y = split.linear(copy_to_parallel(x, self.grid, self.axis), self.weight, self.bias, self.weight_store,
                             self.float8)
        return gather_from_parallel(y, self.grid, self.axis, -1) if self.gather_output else y

    def load_dense(self, dense, order=None):
        w, b = linear_tensors(dense, order)
        with torch.no_grad():
            self.weight.copy_(scatter(w, Layout((self.axis,)), self.grid))
            if self.bias is not None:
                self.bias.copy_(scatter(b, Layout((self.axis,)), self.grid))

    def dense_state(self, grad=False):
        pick = values(grad)
        out = {"weight": gather(pick(self.weight), Layout((self.axis,)), self.grid)}
        if self.bias is not None:
            out["bias"] = gather(pick(self.bias), Layout((self.axis,)), self.grid)
        return out


class RowParallelLinear(ParallelLinearBase, split.Deferrable):
    """Y = X W^T + b with W split by input columns: g (all-reduce fwd, identity bwd) on the output;
    sequence=True: reduce-scattered to sequence shards over the axis instead (all-gather bwd)."""

    FLOAT8 = True  # each rank's products on its shard; the all-reduce of their partial sums in bf16

    def __init__(self, in_features, out_features, grid, bias=True, input_is_parallel=True, axis="tp", dtype=None,
                 device=None, sequence=False):
        super().__init__()
        self.grid, self.axis, self.input_is_parallel, self.sequence = grid, axis, input_is_parallel, sequence
        self.in_features, self.out_features = in_features, out_features
        n = _split(in_features, grid.size(axis), "in_features")
        kw = dict(dtype=dtype, device=device or grid.device)
        self.weight = place(nn.Parameter(torch.empty(out_features, n, **kw)), Layout((), (axis,)))
        # the bias is added after the all-reduce: identical on every tp rank (on its sequence shard
        # with sequence parallelism, so its gradient is partial over the axis too)
        self.bias = place(nn.Parameter(torch.zeros(out_features, **kw)),
                          partial=DATA_AXES + ((axis,) if sequence else ())) if bias else None
        _init.normal_(self.weight, std=in_features ** -0.5)

    @property
    def input_layout(self):
        return Layout((), (), (self.axis,)) if self.input_is_parallel else REPLICATED

    @property
    def output_layout(self):
        return Layout((), (self.axis,)) if self.sequence else REPLICATED

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.grid, self.axis, -1)
        if self.float8 is not None and not self.sequence:  # g reduces the float8 product's rows in place
            y = split.linear(x.reshape(-1, x.shape[-1]), self.weight, None, self.weight_store, self.float8)
            y = reduce_from_parallel(y, self.grid, self.axis).view(*x.shape[:-1], -1)
        else:
            y = split.linear(x, self.weight, None, self.weight_store, self.float8)
            y = reduce_scatter_sequence(y, self.grid, self.axis) if self.sequence else \
                reduce_from_parallel(y, self.grid, self.axis)
        return split.apart(self.weight_store, torch.add, y, self.bias) if self.bias is not None else y

    def load_dense(self, dense, order=None):
        w = dense.weight.detach()
        if order is not None:
            w = w[:, order]
        with torch.no_grad():
            self.weight.copy_(scatter(w, Layout((), (self.axis,)), self.grid))
            if self.bias is not None:
                self.bias.copy_(dense.bias.detach())

    def dense_state(self, grad=False):
        pick = values(grad)
        out = {"weight": gather(pick(self.weight), Layout((), (self.axis,)), self.grid)}
        if self.bias is not None:
            out["bias"] = pick(self.bias).clone()
        return out


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over the vocabulary; out-of-range ids give zeros locally and
    one all-reduce (g) assembles the lookup."""

    def __init__(self, num_embeddings, embedding_dim, grid, axis="tp", dtype=None, device=None):
        super().__init__()
        self.grid, self.axis = grid, axis
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        n = _split(num_embeddings, grid.size(axis), "num_embeddings")
        self.start = grid.index(axis) * n
        self.weight = place(nn.Parameter(torch.empty(n, embedding_dim, dtype=dtype, device=device or grid.device)),
                            Layout((axis,)))
        _init.normal_(self.weight)

    input_layout = REPLICATED
    output_layout = REPLICATED

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(torch.where(outside, torch.zeros_like(local), local), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel(out, self.grid, self.axis)

    @classmethod
    def from_dense(cls, dense: nn.Embedding, grid, **kw):
        m = cls(dense.num_embeddings, dense.embedding_dim, grid, dtype=dense.weight.dtype, **kw)
        with torch.no_grad():
            m.weight.copy_(scatter(dense.weight.detach(), Layout((m.axis,)), grid))
        return m

    def dense_state(self, grad=False):
        w = self.weight.grad if grad else self.weight.detach()
        return {"weight": gather(w, Layout((self.axis,)), self.grid)}

    def to_dense(self):
        e = _init.embedding(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
        with torch.no_grad():
            e.weight.copy_(self.dense_state()["weight"])
        return e
