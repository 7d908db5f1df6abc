"""2-D SUMMA products on a q x q grid (axes "r", "c"), the Optimus baseline of Bian et al.
Every operand is split in q x q blocks: block (r, c) lives on rank (r, c)."""
from __future__ import annotations

import torch

from .. import float8, split


def _bcast(grid, t, axis, src, mine):
    buf = t.detach().clone() if mine else torch.empty_like(t)
    return grid.broadcast(buf, axis=axis, src=src)


class _SummaMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, grid, deferred, recipe=None):
        ctx.grid, ctx.deferred, ctx.recipe = grid, deferred, recipe
        ctx.save_for_backward(a, b)
        q, r, c = grid.axes["r"], grid.coords["r"], grid.coords["c"]
        out = a.new_zeros(a.shape[0], b.shape[1])
        for t in range(q):  # C_rc = sum_t A_rt B_tc
            a_t = _bcast(grid, a, "c", t, c == t)  # A_rt along the row
            b_t = _bcast(grid, b, "r", t, r == t)  # B_tc along the column
            out += float8.output(a_t, b_t.t(), recipe)  # B is W^T: the linear's weight transposed
        return out

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grid = ctx.grid
        g = g.contiguous()
        q, r, c = grid.axes["r"], grid.coords["r"], grid.coords["c"]
        da = db = None
        recipe = ctx.recipe
        if ctx.needs_input_grad[0]:  # dA_rt = sum_c dC_rc B_tc^T: reduce along the row to (r, t)
            for t in range(q):
                b_t = _bcast(grid, b, "r", t, r == t)
                part = float8.grad_input(g, b_t.t(), recipe).contiguous()
                grid.reduce(part, axis="c", dst=t)
                if c == t:
                    da = part
        if ctx.needs_input_grad[1]:
            db = _summa_weight_grad(grid, a, g, recipe)
        elif ctx.deferred is not None:  # in W, in the table's order, alike on every rank of the grid
            split.defer(*ctx.deferred, lambda: (_summa_weight_grad(grid, a, g, recipe),))
        return da, db, None, None, None


def _summa_weight_grad(grid, a, g, recipe=None):
    """dB_tc = sum_r A_rt^T dC_rc: reduced along the column to (t, c)."""
    q, r, c = grid.axes["r"], grid.coords["r"], grid.coords["c"]
    db = None
    for t in range(q):
        a_t = _bcast(grid, a, "c", t, c == t)
        part = float8.matmul(a_t.t(), g, recipe, float8.Product.GRAD_WEIGHT).contiguous()
        grid.reduce(part, axis="r", dst=t)
        if r == t:
            db = part
    return db


class _SummaVector(torch.autograd.Function):
    """A vector split over "c" and, for balanced storage, again over "r": all-gather in r
    forward; reduce-scatter the (row-summed) gradient in r backward."""

    @staticmethod
    def forward(ctx, v, grid):
        ctx.grid = grid
        return grid.all_gather(v.contiguous(), axis="r")

    @staticmethod
    def backward(ctx, g):
        return ctx.grid.reduce_scatter(g.contiguous(), axis="r"), None


def summa_matmul(a, b, grid, store=None, recipe=None):
    """A B on the q x q grid; B's gradient waits for W where `store` defers now (gw.split);
    recipe: each step's local product in float8 (gw.float8; A the input, B the weight's W^T)."""
    deferred, (b,) = split.deferral(store, a, (b,))
    return _SummaMatmul.apply(a.contiguous(), b.contiguous(), grid, deferred, recipe)


def summa_vector(v, grid):
    return _SummaVector.apply(v, grid)
