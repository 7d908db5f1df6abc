"""Differentiable collectives (Megatron-LM: Megatron's f and g operators, and friends).

Eager calls run these autograd Functions; under torch.compile the same collectives run as
the custom ops of ops.py (fake kernels, registered autograd), so a layer traces whole."""
from __future__ import annotations

import torch

from ..grid import axis_label
from . import ops


def _in_place(ctx, x):
    """x itself for an in-place all-reduce where it is contiguous (Megatron's g: no copy before the
    collective), marked dirty so that autograd refuses it loudly where x was saved for a backward."""
    if x.is_contiguous():
        ctx.mark_dirty(x)
        return x
    return x.contiguous()


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, grid, axis):
        ctx.grid, ctx.axis = grid, axis
        return x

    @staticmethod
    def backward(ctx, g):
        return ctx.grid.all_reduce(g.contiguous(), axis=ctx.axis), None, None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (partial sums -> replicated), identity backward."""

    @staticmethod
    def forward(ctx, x, grid, axis):
        return grid.all_reduce(_in_place(ctx, x), axis=axis)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _AllReduceReplicated(torch.autograd.Function):
    """Sum of per-rank partials whose result every rank uses for its own share of the
    loss (e.g. LayerNorm statistics over a split hidden dim): the gradient of each
    partial is the sum of every rank's gradient, so backward all-reduces too."""

    @staticmethod
    def forward(ctx, x, grid, axis):
        ctx.grid, ctx.axis = grid, axis
        return grid.all_reduce(_in_place(ctx, x), axis=axis)

    @staticmethod
    def backward(ctx, g):
        return ctx.grid.all_reduce(g.contiguous(), axis=ctx.axis), None, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather along `dim` forward; keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim):
        ctx.grid, ctx.axis, ctx.dim, ctx.n = grid, axis, dim, x.shape[dim]
        return grid.all_gather(x.contiguous(), axis=axis, dim=dim)

    @staticmethod
    def backward(ctx, g):
        i = ctx.grid.index(ctx.axis)
        return g.narrow(ctx.dim, i * ctx.n, ctx.n).contiguous(), None, None, None


def copy_to_parallel(x, grid, axis):
    if torch.compiler.is_compiling():
        return ops.copy_to_parallel(x, grid.name, axis_label(axis))
    return _CopyToParallel.apply(x, grid, axis)


def reduce_from_parallel(x, grid, axis):
    if torch.compiler.is_compiling():
        return ops.reduce_from_parallel(x, grid.name, axis_label(axis))
    return _ReduceFromParallel.apply(x, grid, axis)


def all_reduce_replicated(x, grid, axis):
    if torch.compiler.is_compiling():
        return ops.all_reduce_replicated(x, grid.name, axis_label(axis))
    return _AllReduceReplicated.apply(x, grid, axis)


def gather_from_parallel(x, grid, axis, dim=-1):
    if torch.compiler.is_compiling():
        return ops.gather_from_parallel(x, grid.name, axis_label(axis), dim % x.dim())
    return _GatherFromParallel.apply(x, grid, axis, dim % x.dim())


class _ScatterToParallel(torch.autograd.Function):
    """Keep this rank's chunk of `dim` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim):
        ctx.grid, ctx.axis, ctx.dim = grid, axis, dim
        n = x.shape[dim] // grid.size(axis)
        return x.narrow(dim, grid.index(axis) * n, n).contiguous()

    @staticmethod
    def backward(ctx, g):
        return ctx.grid.all_gather(g.contiguous(), axis=ctx.axis, dim=ctx.dim), None, None, None


def scatter_to_parallel(x, grid, axis, dim=-1):
    if torch.compiler.is_compiling():
        return ops.scatter_to_parallel(x, grid.name, axis_label(axis), dim % x.dim())
    return _ScatterToParallel.apply(x, grid, axis, dim % x.dim())


class _SequenceExchange(torch.autograd.Function):
    """Megatron's sequence parallelism (Korthikanti et al. 2022, §4.2.2): ḡ reduce-scatters partial
    sums of the whole sequence to sequence shards forward and all-gathers the gradient backward;
    g, its adjoint, all-gathers the shards forward and reduce-scatters the (partial) gradient
    backward. (The all-gather before a column-parallel linear is fused with it: gw.nn.tensor1d.)"""

    @staticmethod
    def forward(ctx, x, grid, axis, dim, gather):
        ctx.grid, ctx.axis, ctx.dim, ctx.gather = grid, axis, dim, gather
        op = grid.all_gather if gather else grid.reduce_scatter
        return op(x.contiguous(), axis=axis, dim=dim)

    @staticmethod
    def backward(ctx, g):
        op = ctx.grid.reduce_scatter if ctx.gather else ctx.grid.all_gather
        return op(g.contiguous(), axis=ctx.axis, dim=ctx.dim), None, None, None, None


def reduce_scatter_sequence(x, grid, axis, dim=1):
    """Partial sums of the whole sequence -> this rank's sequence shard of their sum."""
    return _SequenceExchange.apply(x, grid, axis, dim % x.dim(), False)


def gather_sequence(x, grid, axis, dim=1):
    """This rank's sequence shard -> the whole sequence, read by this rank's own consumers (its
    heads): its gradient, partial, reduce-scattered back."""
    return _SequenceExchange.apply(x, grid, axis, dim % x.dim(), True)


class _AllToAllV(torch.autograd.Function):
    """grid.all_to_all_v forward; backward the same exchange reversed (the gradients of the
    rows received go back to their senders)."""

    @staticmethod
    def forward(ctx, x, grid, axis, send, recv):
        ctx.grid, ctx.axis, ctx.send, ctx.recv = grid, axis, send, recv
        return grid.all_to_all_v(x, send, recv, axis)

    @staticmethod
    def backward(ctx, g):
        return ctx.grid.all_to_all_v(g.contiguous(), ctx.recv, ctx.send, ctx.axis), None, None, None, None


def all_to_all_v(x, grid, axis, send_counts, recv_counts):
    """Differentiable grid.all_to_all_v (MoE's dispatch and combine)."""
    return _AllToAllV.apply(x, grid, axis, list(send_counts), list(recv_counts))


class _ExchangeStarted(torch.autograd.Function):
    """An uneven all-to-all's first half: forward starts it (box["work"]); backward waits for the
    reverse exchange its second half's backward started. What autograd runs between the two
    halves' backwards (created between their forwards: the shared expert) overlaps it."""

    @staticmethod
    def forward(ctx, x, grid, axis, send, recv, box):
        ctx.box = box
        box.update(grid=grid, axis=axis, send=send, recv=recv,
                   work=grid.all_to_all_v(x, send, recv, axis, async_op=True))
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return ctx.box.pop("back").wait(), None, None, None, None, None


class _ExchangeFinished(torch.autograd.Function):
    """The second half: forward waits for the rows; backward starts their gradients home."""

    @staticmethod
    def forward(ctx, started, box):
        ctx.box = box
        return box.pop("work").wait()

    @staticmethod
    def backward(ctx, g):
        b = ctx.box
        b["back"] = b["grid"].all_to_all_v(g.contiguous(), b["recv"], b["send"], b["axis"], async_op=True)
        return g.new_empty(0), None


def all_to_all_v_around(x, grid, axis, send_counts, recv_counts, work):
    """all_to_all_v of x with work() run while it moves, forward and (its autograd nodes made in
    between) backward: Megatron-Core's overlap of the experts' dispatch with the shared expert.
    Returns (the rows received, work()'s result)."""
    box: dict = {}
    started = _ExchangeStarted.apply(x, grid, axis, list(send_counts), list(recv_counts), box)
    side = work()
    return _ExchangeFinished.apply(started, box), side
