"""The collectives the layers call, as torch custom ops (torch.library): each has a fake
(meta) kernel, so torch.compile traces it without running it, and the differentiable ones
have their autograd registered, so a layer compiles forward and backward with
fullgraph=True. (The cube's products and vectors, Bian et al., are registered beside their
Functions in cube.py, with these ops for their backward.) A grid is named by a string (Grid.name, resolved by gw.grid.by_name) and an
axis by its label ("" the world, "x,y" a tuple), as torch's functional collectives name
their process group.

Eager code calls the autograd Functions of comm.py and cube.py, which skip the custom-op
dispatch on every call; under torch.compile those call these ops, whose kernels are the same
grid collectives and whose backward formulas are the Functions' (comm.py: Megatron's f and g,
Megatron-LM; cube.py: Bian et al.'s Algorithms 1-8).
"""
from __future__ import annotations

import torch

from ..grid import axis_of, by_name

LIB = "gridweave"


def size(grid: str, axis: str) -> int:
    """Members along `axis` (a label) of the grid called `grid`."""
    return by_name(grid).size(axis_of(axis))


def _resized(x, dim, factor=1, divisor=1):
    shape = list(x.shape)
    shape[dim] = shape[dim] * factor // divisor
    return x.new_empty(shape)


# ---- functional collectives (no autograd of their own) ---------------------------------


def _reduced(x, grid: str, axis: str, op: str = "sum"):
    """The kernel of every all-reduce below: a new tensor, the reduction over the line."""
    return by_name(grid).all_reduce(x.contiguous().clone(), axis=axis_of(axis), op=op)


def _gathered(x, grid: str, axis: str, dim: int):
    """The kernel of every all-gather below."""
    return by_name(grid).all_gather(x.contiguous(), axis=axis_of(axis), dim=dim)


@torch.library.custom_op(f"{LIB}::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, grid: str, axis: str, op: str) -> torch.Tensor:
    return _reduced(x, grid, axis, op)


@all_reduce.register_fake
def _(x, grid, axis, op):
    return torch.empty_like(x)


@torch.library.custom_op(f"{LIB}::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, grid: str, axis: str, dim: int) -> torch.Tensor:
    return _gathered(x, grid, axis, dim)


@all_gather.register_fake
def _(x, grid, axis, dim):
    return _resized(x, dim, factor=size(grid, axis))


@torch.library.custom_op(f"{LIB}::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, grid: str, axis: str, dim: int) -> torch.Tensor:
    return by_name(grid).reduce_scatter(x.contiguous(), axis=axis_of(axis), dim=dim).contiguous()


@reduce_scatter.register_fake
def _(x, grid, axis, dim):
    return _resized(x, dim, divisor=size(grid, axis))


@torch.library.custom_op(f"{LIB}::reduce", mutates_args=())
def reduce(x: torch.Tensor, grid: str, axis: str, dst: int) -> torch.Tensor:
    return by_name(grid).reduce(x.contiguous().clone(), axis=axis_of(axis), dst=dst)


@reduce.register_fake
def _(x, grid, axis, dst):
    return torch.empty_like(x)


# ---- Megatron's f and g and their kin (Megatron-LM), differentiable ----------------------


@torch.library.custom_op(f"{LIB}::copy_to_parallel", mutates_args=())
def copy_to_parallel(x: torch.Tensor, grid: str, axis: str) -> torch.Tensor:
    return x.clone()  # f: identity forward


@copy_to_parallel.register_fake
def _(x, grid, axis):
    return torch.empty_like(x)


def _setup_axis(ctx, inputs, output):
    ctx.grid, ctx.axis = inputs[1], inputs[2]


torch.library.register_autograd(  # f: all-reduce backward
    f"{LIB}::copy_to_parallel", lambda ctx, g: (all_reduce(g, ctx.grid, ctx.axis, "sum"), None, None),
    setup_context=_setup_axis)


@torch.library.custom_op(f"{LIB}::reduce_from_parallel", mutates_args=())
def reduce_from_parallel(x: torch.Tensor, grid: str, axis: str) -> torch.Tensor:
    return _reduced(x, grid, axis)  # g: all-reduce forward


@reduce_from_parallel.register_fake
def _(x, grid, axis):
    return torch.empty_like(x)


torch.library.register_autograd(f"{LIB}::reduce_from_parallel", lambda ctx, g: (g, None, None),  # g: identity
                                setup_context=_setup_axis)


@torch.library.custom_op(f"{LIB}::all_reduce_replicated", mutates_args=())
def all_reduce_replicated(x: torch.Tensor, grid: str, axis: str) -> torch.Tensor:
    return _reduced(x, grid, axis)


@all_reduce_replicated.register_fake
def _(x, grid, axis):
    return torch.empty_like(x)


torch.library.register_autograd(  # every rank uses the sum: each partial's gradient is the sum too
    f"{LIB}::all_reduce_replicated", lambda ctx, g: (all_reduce(g, ctx.grid, ctx.axis, "sum"), None, None),
    setup_context=_setup_axis)


@torch.library.custom_op(f"{LIB}::gather_from_parallel", mutates_args=())
def gather_from_parallel(x: torch.Tensor, grid: str, axis: str, dim: int) -> torch.Tensor:
    return _gathered(x, grid, axis, dim)


@gather_from_parallel.register_fake
def _(x, grid, axis, dim):
    return _resized(x, dim, factor=size(grid, axis))


def _setup_gather(ctx, inputs, output):
    x, ctx.grid, ctx.axis, ctx.dim = inputs
    ctx.n = x.shape[ctx.dim]


def _gather_backward(ctx, g):  # keep this rank's chunk
    i = by_name(ctx.grid).index(axis_of(ctx.axis))
    return g.narrow(ctx.dim, i * ctx.n, ctx.n).contiguous(), None, None, None


torch.library.register_autograd(f"{LIB}::gather_from_parallel", _gather_backward, setup_context=_setup_gather)


@torch.library.custom_op(f"{LIB}::scatter_to_parallel", mutates_args=())
def scatter_to_parallel(x: torch.Tensor, grid: str, axis: str, dim: int) -> torch.Tensor:
    g = by_name(grid)
    n = x.shape[dim] // g.size(axis_of(axis))
    return x.narrow(dim, g.index(axis_of(axis)) * n, n).contiguous()


@scatter_to_parallel.register_fake
def _(x, grid, axis, dim):
    return _resized(x, dim, divisor=size(grid, axis))


def _setup_scatter(ctx, inputs, output):
    _, ctx.grid, ctx.axis, ctx.dim = inputs


torch.library.register_autograd(
    f"{LIB}::scatter_to_parallel", lambda ctx, g: (all_gather(g, ctx.grid, ctx.axis, ctx.dim), None, None, None),
    setup_context=_setup_scatter)


def keep_alive(*ops_) -> None:
    """Collectives keep program order in a compiled graph: each rank's compiler schedules its
    own graph (shapes differ across ranks: diagonal blocks, empty shards), and two ranks that
    issued a line's collectives in different orders would deadlock, or one that dropped a
    collective whose result it does not use would leave its peers waiting. An ordered effect
    (torch threads a token through them, as through its own side-effecting ops) keeps them
    all, in the order the program issued them."""
    for op in ops_:
        torch.library._register_effectful_op(op._qualname, torch.library.EffectType.ORDERED)


keep_alive(all_reduce, all_gather, reduce_scatter, reduce, copy_to_parallel, reduce_from_parallel,
           all_reduce_replicated, gather_from_parallel, scatter_to_parallel)
