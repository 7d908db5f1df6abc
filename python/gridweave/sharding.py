"""Where every parameter lives on the grid, and the one rule that reads it.

A parameter carries a ParamPlacement (the role of Megatron-Core's tensor-parallel
attributes or DTensor's Shard/Replicate/Partial): how its full tensor is split over grid
axes (a Layout), over which axes each replica's gradient is only a partial sum, and, for
Bian et al.'s diagonal storage, which ranks hold it at all. Every other grid axis (but "pp",
whose stages hold different parameters) holds identical copies with identical gradients.

gw.reduce_gradients sums each gradient over exactly its partial axes; gw.clip_grad_norm_
counts every element of the model once; OffloadAdam and checkpoints read the same
placements. Nothing else decides which axes a gradient is summed over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .errors import GridError
from .grid import LinePart
from .layout import Layout

# Axes that split the tokens: a replica's gradient there is a partial sum of the batch's.
DATA_AXES = ("dp", "sp")


def first_copy(grid, distinct=()) -> bool:
    """Whether this rank holds the copy that counts of a value that differs along the axes in
    `distinct` and along pp (each stage holds its own) and is identical along every other axis:
    member 0 of each of those. The one rule for what a norm, a checkpoint or a loss counts. A
    LinePart in `distinct` (experts over an expert-parallel part of the data axes) differs
    along its part of its line and is identical along the other part."""
    skip = {a for a in distinct if isinstance(a, str)} | {"pp"}
    for part in (a for a in distinct if isinstance(a, LinePart)):
        skip |= set(part.axes)
        if grid.index(part.complement()) != 0:
            return False
    return all(c == 0 for a, c in grid.coords.items() if a not in skip)


def axis_size(grid, axis) -> int:
    """Ranks along an axis name (1 where the grid lacks it) or a LinePart."""
    return grid.size(axis) if isinstance(axis, LinePart) else grid.axes.get(axis, 1)


def present_axes(grid, axes) -> tuple:
    """The axes of `axes` along which this grid has more than one rank."""
    return tuple(a for a in axes if axis_size(grid, a) > 1)


@dataclass(frozen=True)
class ParamPlacement:
    """layout: how the stored full tensor is split (dims -> axes); partial: axes whose
    replicas' gradients are partial sums; diagonal: (u, v) when only the ranks whose u and
    v coordinates agree hold the tensor (Bian et al. Fig. 5; the others hold an empty one)."""
    layout: Layout = field(default_factory=Layout)
    partial: tuple = DATA_AXES
    diagonal: tuple | None = None
    # How the stored full tensor relates to the dense model's tensor: the dense rows taken
    # in group_order(widths, groups) of order = (widths, groups[, dim]) (packed qkv / gate-up
    # regrouped by head group; along dim, 0 unless given: stacked experts' 1), then transposed
    # (2-D and 3-D linears store W^T). Sharded checkpoints read these to reshard.
    transposed: bool = False
    order: tuple | None = None

    def __post_init__(self):
        both = set(self.layout.axes()) & set(self.partial)
        if both:
            raise GridError(f"a parameter cannot be both split and partial over {sorted(both)}")

    def reduce_axes(self, grid) -> tuple:
        """The partial axes this grid has (size > 1): the gradient's all-reduce."""
        return present_axes(grid, self.partial)

    def counted_here(self, grid, sharded=()) -> bool:
        """Whether this rank's copy is the one that counts (norms, checkpoints): it holds the
        tensor, and it is member 0 of every axis along which copies are identical. sharded:
        data axes over which this rank holds its own slice (ZeRO's shards), not a copy."""
        coords = grid.coords
        distinct = set(self.layout.axes()) | set(sharded)
        if self.diagonal is not None:
            u, v = self.diagonal
            if coords[u] != coords[v]:
                return False
            distinct |= {u, v}  # along the other one of the pair, exactly one rank holds the block
        return first_copy(grid, distinct)


REPLICATED = ParamPlacement()


def place(param: torch.nn.Parameter, layout: Layout | None = None, partial=DATA_AXES, diagonal=None,
          transposed=False, order=None):
    """Attach a placement to `param` (returned, for chaining)."""
    param.placement = ParamPlacement(layout if layout is not None else Layout(), tuple(partial),
                                     tuple(diagonal) if diagonal else None, bool(transposed),
                                     (tuple(order[0]), *(int(v) for v in order[1:])) if order else None)
    return param


def values(grad):
    """Picks, for dense_state(), a parameter's value (False), its gradient (True), or any
    tensor shaped like it (a callable param -> tensor, e.g. an optimizer state)."""
    if callable(grad):
        return grad
    return (lambda t: t.grad) if grad else (lambda t: t.detach())


def group_order(widths, groups: int, device="cpu") -> torch.Tensor:
    """Row order of a projection packing parts of `widths` rows that makes `groups` equal
    blocks, block t = [part_0's t-th slice | part_1's t-th slice | ...] (e.g. a head group's
    [q_t | k_t | v_t]), so a column split over `groups` ranks keeps each group whole."""
    for w in widths:
        if w % groups:
            raise GridError(f"a packed projection of parts {list(widths)} does not split into {groups} groups")
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return torch.cat([torch.arange(s + t * (w // groups), s + (t + 1) * (w // groups), dtype=torch.int64, device=device)
                      for t in range(groups) for s, w in zip(starts, widths)])


def set_row_order(param, widths, groups: int):
    """Record that `param` stores the dense rows in group_order(widths, groups) (nothing for
    one group: the order is the identity)."""
    if param is not None and groups > 1:
        param.placement = replace(placement_of(param), order=(tuple(widths), int(groups)))


def placement_of(param) -> ParamPlacement:
    """A parameter's placement; one without is replicated with a data-parallel gradient
    (what torch's DDP assumes of every parameter)."""
    return getattr(param, "placement", REPLICATED)


def _params(module_or_params) -> list:
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.parameters())
    if isinstance(module_or_params, torch.Tensor):
        return [module_or_params]
    return list(module_or_params)


def reduction_groups(params, grid) -> dict:
    """{axes: [params]}: the parameters whose gradients are summed over the same axes, in
    the order given (every rank of a line holds the same modules, so the same order)."""
    groups: dict = {}
    for p in params:
        axes = placement_of(p).reduce_axes(grid)
        if axes:
            groups.setdefault(axes, []).append(p)
    return groups


def reduce_gradients(module_or_params, grid) -> None:
    """Sum every gradient over its placement's partial axes, one flat all-reduce per group
    of axes and dtype. A missing gradient takes part as zeros (so every member of a line
    sends the same buffer). Loss convention: each rank's loss is its share of the global
    mean (see gw.nn.global_token_mean); the sum is then the gradient of the global loss."""
    params = [p for p in _params(module_or_params) if p.requires_grad]
    for axes, group in reduction_groups(params, grid).items():
        by_dtype: dict = {}
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for ps in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            grid.all_reduce(flat, axis=axes)
            off = 0
            for p in ps:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n


def grad_norm_of(pieces, grid, norm_type: float = 2.0) -> torch.Tensor:
    """The norm over (gradient, placement[, shard axes]) pieces of the whole model, every
    element counted once (float64, on grid.device). Collective over the world: every rank calls it."""
    inf = math.isinf(norm_type)
    if norm_type <= 0:
        raise GridError(f"norm_type must be positive, got {norm_type}")
    acc = torch.zeros(1, dtype=torch.float64, device=grid.device)
    # on meta (the planner's recordings) no piece has a value: only the all-reduce is recorded
    kept = [g.detach() for g, placement, *sharded in (pieces if not acc.is_meta else ())  # (gradient, placement[, shard axes])
            if g.numel() and placement.counted_here(grid, *sharded)]
    if kept:  # each piece's norm accumulated in float64 without a float64 copy of it (torch's clip_grad_norm_)
        norms = torch.stack([n.to(grid.device) for n in torch._foreach_norm(kept, norm_type, dtype=torch.float64)])
        acc = norms.max().reshape(1) if inf else norms.pow(norm_type).sum().reshape(1)
    grid.all_reduce(acc, axis=None, op="max" if inf else "sum")
    return acc[0] if inf else acc[0].pow(1.0 / norm_type)


def grad_norm(params, grid, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient, every element counted once."""
    return grad_norm_of([(p.grad, placement_of(p)) for p in _params(params) if p.grad is not None], grid, norm_type)


def clip_grad_norm_(params, max_norm: float, grid, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the grid: the global norm of the model's
    gradient (each element once, whatever the tensor, pipeline, sequence and data axes),
    and every gradient scaled by max_norm / (norm + 1e-6) when that is below 1. Call it
    after the gradients are reduced (gw.reduce_gradients). Returns the norm."""
    params = [p for p in _params(params) if p.grad is not None]
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise GridError(f"max_norm must be a positive number, got {max_norm!r}")
    total = grad_norm(params, grid, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
