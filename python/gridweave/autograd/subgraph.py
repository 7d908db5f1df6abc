"""SUPER's split, slice, sum and concat layers (SUPER §IV) between the common grid and
g sub-grids, on segmented collectives along the "sg" axis (each sub-communicator joins
the i-th rank of every sub-grid). Each backward is the conjugate collective.

D&SP (common layers data-parallel over all ranks):
  split  = all-gather      sum    = reduce-scatter
  slice  = all-to-all, or all-gather and discard (the paper's choice on NCCL)
  concat = all-to-all, or all-gather and discard
D&SP-cSub (common layers on sub-grid 0):
  split  = broadcast       sum    = reduce
  slice  = scatter         concat = gather
Tensors are (batch, ..., hidden); batch is dim 0 and slices cut the last dim.
"""
from __future__ import annotations

import torch

from ..errors import GridError

AXIS = "sg"


def _g(grid):
    return grid.axes[AXIS]


def _check_hidden(x, g):
    if x.shape[-1] % g:
        raise GridError(f"hidden size {x.shape[-1]} does not split over {g} sub-grids")


# ---- D&SP --------------------------------------------------------------------------------


class _Conjugate(torch.autograd.Function):
    """A collective along sg forward and its conjugate backward: split is all-gather /
    reduce-scatter, sum the reverse."""

    @staticmethod
    def forward(ctx, x, grid, op, conjugate):
        ctx.grid, ctx.conjugate = grid, conjugate
        return getattr(grid, op)(x.contiguous(), axis=AXIS)

    @staticmethod
    def backward(ctx, g):
        return getattr(ctx.grid, ctx.conjugate)(g.contiguous(), axis=AXIS), None, None, None


def _a2a_slice(grid, x):
    """(b, ..., h) -> (g*b, ..., h/g): member k receives slice k of every member's samples."""
    g = _g(grid)
    parts = torch.cat(list(x.chunk(g, dim=-1)), dim=0).contiguous()
    return grid.all_to_all(parts, axis=AXIS)


def _a2a_concat(grid, y):
    """(g*b, ..., h/g) -> (b, ..., h): the inverse of _a2a_slice."""
    g = _g(grid)
    got = grid.all_to_all(y.contiguous(), axis=AXIS)
    return torch.cat(list(got.chunk(g, dim=0)), dim=-1)


def _gather_slice(grid, x):
    k, g = grid.index(AXIS), _g(grid)
    full = grid.all_gather(x.contiguous(), axis=AXIS)
    w = x.shape[-1] // g
    return full[..., k * w:(k + 1) * w].contiguous()


def _gather_slice_backward(grid, gy, h):
    k, g = grid.index(AXIS), _g(grid)
    w = h // g
    pad = gy.new_zeros(gy.shape[:-1] + (h,))
    pad[..., k * w:(k + 1) * w] = gy
    return grid.reduce_scatter(pad, axis=AXIS)


def _gather_concat(grid, y):
    k, g = grid.index(AXIS), _g(grid)
    full = grid.all_gather(y.contiguous(), axis=AXIS)  # (g * g*b, ..., h/g): every branch's output
    b = y.shape[0] // g
    blocks = full.reshape((g, y.shape[0]) + tuple(y.shape[1:]))[:, k * b:(k + 1) * b]
    return torch.cat(list(blocks), dim=-1)


def _gather_concat_backward(grid, gx):
    k, g = grid.index(AXIS), _g(grid)
    b, w = gx.shape[0], gx.shape[-1] // g
    # member j's input fed block k of this rank's output with its slice j
    pad = gx.new_zeros((g, g * b) + tuple(gx.shape[1:-1]) + (w,))
    for j, part in enumerate(gx.chunk(g, dim=-1)):
        pad[j, k * b:(k + 1) * b] = part
    return grid.reduce_scatter(pad.reshape((g * g * b,) + tuple(pad.shape[2:])), axis=AXIS)


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, method):
        _check_hidden(x, _g(grid))
        ctx.grid, ctx.method, ctx.h = grid, method, x.shape[-1]
        return _a2a_slice(grid, x) if method == "all_to_all" else _gather_slice(grid, x)

    @staticmethod
    def backward(ctx, g):
        if ctx.method == "all_to_all":
            return _a2a_concat(ctx.grid, g), None, None
        return _gather_slice_backward(ctx.grid, g.contiguous(), ctx.h), None, None


class _Concat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, grid, method):
        ctx.grid, ctx.method = grid, method
        return _a2a_concat(grid, y) if method == "all_to_all" else _gather_concat(grid, y)

    @staticmethod
    def backward(ctx, g):
        if ctx.method == "all_to_all":
            return _a2a_slice(ctx.grid, g.contiguous()), None, None
        return _gather_concat_backward(ctx.grid, g.contiguous()), None, None


# ---- D&SP-cSub: the common grid is sub-grid 0 -----------------------------------------------


def _root(grid):
    return grid.index(AXIS) == 0


class _CSubSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, shape):
        ctx.grid, ctx.shape = grid, shape
        buf = x.detach().clone() if _root(grid) else x.new_empty(shape)
        return grid.broadcast(buf.contiguous(), axis=AXIS, src=0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.grid.reduce(g, axis=AXIS, dst=0)
        return (g if _root(ctx.grid) else g.new_empty((0,) + tuple(ctx.shape[1:]))), None, None


class _CSubSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, grid):
        ctx.grid = grid
        y = y.contiguous().clone()
        grid.reduce(y, axis=AXIS, dst=0)
        ctx.shape = y.shape
        return y if _root(grid) else y.new_empty((0,) + tuple(y.shape[1:]))

    @staticmethod
    def backward(ctx, g):
        buf = g.contiguous().clone() if _root(ctx.grid) else g.new_empty(ctx.shape)
        return ctx.grid.broadcast(buf, axis=AXIS, src=0), None


class _CSubSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, shape):
        g = _g(grid)
        ctx.grid, ctx.shape = grid, shape
        out = x.new_empty(tuple(shape[:-1]) + (shape[-1] // g,))
        full = torch.cat(list(x.chunk(g, dim=-1)), dim=0).contiguous() if _root(grid) else None
        return grid.scatter(out, full, axis=AXIS, src=0)

    @staticmethod
    def backward(ctx, gy):
        got = ctx.grid.gather(gy.contiguous(), axis=AXIS, dst=0)
        if not _root(ctx.grid):
            return gy.new_empty((0,) + tuple(ctx.shape[1:])), None, None
        return torch.cat(list(got.chunk(_g(ctx.grid), dim=0)), dim=-1), None, None


class _CSubConcat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, grid):
        ctx.grid, ctx.shape = grid, y.shape
        got = grid.gather(y.contiguous(), axis=AXIS, dst=0)
        if not _root(grid):
            return y.new_empty((0,) + tuple(y.shape[1:-1]) + (y.shape[-1] * _g(grid),))
        return torch.cat(list(got.chunk(_g(grid), dim=0)), dim=-1)

    @staticmethod
    def backward(ctx, gx):
        g = _g(ctx.grid)
        out = gx.new_empty(ctx.shape)
        full = torch.cat(list(gx.chunk(g, dim=-1)), dim=0).contiguous() if _root(ctx.grid) else None
        return ctx.grid.scatter(out, full, axis=AXIS, src=0), None


# ---- public -------------------------------------------------------------------------------

SLICE_METHODS = ("all_to_all", "all_gather")


def _method(method):
    if method not in SLICE_METHODS:
        raise GridError(f"slice/concat method must be one of {SLICE_METHODS}, got {method!r}")
    return method


def dsp_split(x, grid):
    return _Conjugate.apply(x, grid, "all_gather", "reduce_scatter")


def dsp_sum(y, grid):
    return _Conjugate.apply(y, grid, "reduce_scatter", "all_gather")


def dsp_slice(x, grid, method="all_to_all"):
    return _Slice.apply(x, grid, _method(method))


def dsp_concat(y, grid, method="all_to_all"):
    return _Concat.apply(y, grid, _method(method))


def csub_split(x, grid, shape):
    return _CSubSplit.apply(x, grid, tuple(shape))


def csub_sum(y, grid):
    return _CSubSum.apply(y, grid)


def csub_slice(x, grid, shape):
    return _CSubSlice.apply(x, grid, tuple(shape))


def csub_concat(y, grid):
    return _CSubConcat.apply(y, grid)
