"""3-D matrix products (seed 000, Algorithms 1-6) and vector ops (Algorithms 7-8) as
autograd Functions. The plan of every step comes from the engine (cpp/cube.h); the
local GEMMs are torch."""
from __future__ import annotations

import torch

from .. import _C
from ..grid import Work

AB, ABT, ATB = _C.CubeForm.AB, _C.CubeForm.ABt, _C.CubeForm.AtB


def _resolve(r):
    return r.wait() if isinstance(r, Work) else r


def _gather(grid, t, step, async_op, cache):
    key = (id(t), step.axis, step.dim)
    if cache is not None and key in cache:
        return cache[key]
    r = grid.all_gather(t, axis=step.axis, dim=step.dim, async_op=async_op)
    if cache is not None:
        cache[key] = r
    return r


def _product(grid, form, lhs, rhs, a, c, overlap, cache=None, rhs_gathered=None, async_out=False):
    """One of Algorithms 1, 3, 5: all-gather lhs and rhs, local GEMM, reduce-scatter."""
    plan = _C.cube_plan(form, a, c)
    # The rhs gather (the weights, on x) is issued first and asynchronously when
    # overlapping, so it runs beside the lhs gather on another communicator.
    r = rhs_gathered if rhs_gathered is not None else _gather(grid, rhs, plan.gather_rhs, overlap, cache)
    lhs_full = _resolve(_gather(grid, lhs, plan.gather_lhs, False, cache))
    rhs_full = _resolve(r)
    if cache is not None:
        cache[(id(rhs), plan.gather_rhs.axis, plan.gather_rhs.dim)] = rhs_full
        cache[(id(lhs), plan.gather_lhs.axis, plan.gather_lhs.dim)] = lhs_full
    out = (lhs_full.t() if plan.trans_lhs else lhs_full) @ (rhs_full.t() if plan.trans_rhs else rhs_full)
    rs = plan.reduce_scatter_out
    return grid.reduce_scatter(out, axis=rs.axis, dim=rs.dim, async_op=async_out)


class _CubeMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lhs, rhs, grid, form, a, c, overlap, rhs_gathered):
        ctx.grid, ctx.form, ctx.a, ctx.c, ctx.overlap = grid, form, a, c, overlap
        ctx.save_for_backward(lhs, rhs)
        return _product(grid, form, lhs, rhs, a, c, overlap, rhs_gathered=rhs_gathered)

    @staticmethod
    def backward(ctx, g):
        lhs, rhs = ctx.saved_tensors
        ops = {0: lhs, 1: rhs, 2: g.contiguous()}
        grad_a, grad_b = _C.cube_backward(ctx.form, ctx.a, ctx.c)
        cache = {}  # dC is all-gathered once for both gradients
        works = []
        for spec, needed in ((grad_a, ctx.needs_input_grad[0]), (grad_b, ctx.needs_input_grad[1])):
            if needed:
                works.append(_product(ctx.grid, spec.form, ops[spec.lhs], ops[spec.rhs], spec.a, spec.c,
                                      ctx.overlap, cache, async_out=ctx.overlap))
            else:
                works.append(None)
        da, db = (_resolve(w) for w in works)
        return da, db, None, None, None, None, None, None


def cube_matmul(lhs, rhs, grid, form=AB, a="y", c="z", overlap=False, rhs_gathered=None):
    """C = op(lhs) op(rhs) on the cube; operand layouts are _C.cube_layout(form, k, a, c)."""
    return _CubeMatmul.apply(lhs.contiguous(), rhs.contiguous(), grid, form, a, c, overlap, rhs_gathered)


def is_diagonal(grid, col_axis, row_axis) -> bool:
    """Vector parameters live on the ranks whose row and column directions agree (Fig. 5)."""
    return grid.coords[col_axis] == grid.coords[row_axis]


class _CubeVector(torch.autograd.Function):
    """Algorithm 7: broadcast the diagonal block along `row_axis`, all-gather it in x.
    Algorithm 8 (its adjoint): reduce-scatter the gradient in x, reduce it to the
    diagonal along `row_axis`."""

    @staticmethod
    def forward(ctx, b_local, grid, col_axis, row_axis, n_local):
        ctx.grid, ctx.col, ctx.row = grid, col_axis, row_axis
        ctx.diag = is_diagonal(grid, col_axis, row_axis)
        ctx.root = grid.coords[col_axis]
        buf = b_local.detach().clone() if ctx.diag else torch.empty(n_local, dtype=b_local.dtype, device=b_local.device)
        grid.broadcast(buf, axis=row_axis, src=ctx.root)
        ctx.inner = _C.cube_vector_layout(col_axis)[0][1]  # the diagonal block's split (x)
        return grid.all_gather(buf, axis=ctx.inner)

    @staticmethod
    def backward(ctx, g):
        part = ctx.grid.reduce_scatter(g.contiguous(), axis=ctx.inner)
        ctx.grid.reduce(part, axis=ctx.row, dst=ctx.root)
        return (part if ctx.diag else g.new_empty(0)), None, None, None, None


def cube_vector(b_local, grid, col_axis, row_axis, n_local):
    """The block of a diagonally stored vector that matches columns split by `col_axis`."""
    return _CubeVector.apply(b_local, grid, col_axis, row_axis, n_local)
