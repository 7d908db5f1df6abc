"""A mode's per-layer schedule, recorded from the code that runs it.

The planner does not restate any algorithm: it builds the mode's TransformerLayer on a
RecordingGrid (meta tensors, nothing computed or sent), runs forward and backward, and
reads off every collective the autograd Functions issued (op, axis, bytes), every GEMM
call, and the parameters this rank holds. Change an algorithm and the prediction follows.
Bytes are affine in the batch (weights move whatever the batch, activations in
proportion), so two recordings give every micro-batch size exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..grid import Work

_GEMMS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}


@dataclass(frozen=True)
class Collective:
    """One collective of a layer on one rank. nbytes: the whole buffer (all-gather output,
    reduce-scatter / all-reduce / all-to-all input, broadcast / reduce payload, scatter /
    gather full tensor, ring send payload), as gw.plan.collective_time takes it."""
    op: str
    axis: str
    nbytes: float


@dataclass(frozen=True)
class LayerSchedule:
    collectives: tuple  # of Collective, in issue order, forward then backward
    gemm_calls: int     # GEMM kernels (matrix products and fused attention), forward and backward
    parameters: int     # elements of the layer's parameters this rank holds


class _Done(Work):
    """An already finished async op of the recording grid."""

    def __init__(self, result):
        super().__init__(None, 0.0, None)
        self._result, self._done = result, True


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _label(axis) -> str:
    return axis if isinstance(axis, str) else ",".join(axis)


class RecordingGrid:
    """Stands in for gw.Grid on rank 0 (every coordinate 0) of a grid with `axes`: every
    collective returns a meta tensor of the right shape and is recorded."""

    def __init__(self, axes, tp):
        self.axes = dict(axes)
        self.tp = tp
        self.device = torch.device("meta")
        self.timeout = 0.0
        self.rank, self.world_size = 0, math.prod(self.axes.values())
        self.coords = {a: 0 for a in self.axes}
        self.log: list = []

    def size(self, axis=None) -> int:
        if axis is None:
            return self.world_size
        return math.prod(self.axes[a] for a in ([axis] if isinstance(axis, str) else axis))

    def index(self, axis) -> int:
        return 0

    def _record(self, op, axis, nbytes, result, async_op):
        self.log.append(Collective(op, _label(axis) if axis is not None else "world", float(nbytes)))
        return _Done(result) if async_op else result

    def all_gather(self, t, axis, dim=0, async_op=False, out=None):
        g = self.size(axis)
        shape = list(t.shape)
        shape[dim % t.dim()] *= g
        res = t.new_empty(shape)
        return self._record("all_gather", axis, _nbytes(res), res, async_op)

    def reduce_scatter(self, t, axis, op="sum", dim=0, async_op=False, out=None):
        g = self.size(axis)
        shape = list(t.shape)
        shape[dim % t.dim()] //= g
        return self._record("reduce_scatter", axis, _nbytes(t), t.new_empty(shape), async_op)

    def all_reduce(self, t, axis, op="sum", async_op=False):
        return self._record("all_reduce", axis, _nbytes(t), t, async_op)

    def broadcast(self, t, axis, src=0, async_op=False):
        return self._record("broadcast", axis, _nbytes(t), t, async_op)

    def reduce(self, t, axis, dst=0, op="sum", async_op=False):
        return self._record("reduce", axis, _nbytes(t), t, async_op)

    def all_to_all(self, t, axis, async_op=False):
        return self._record("all_to_all", axis, _nbytes(t), torch.empty_like(t), async_op)

    def scatter(self, out, full=None, axis=None, src=0, async_op=False):
        return self._record("scatter", axis, _nbytes(out) * self.size(axis), out, async_op)

    def gather(self, t, axis=None, dst=0, async_op=False):
        full = t.new_empty((self.size(axis) * t.shape[0],) + tuple(t.shape[1:]))
        return self._record("gather", axis, _nbytes(full), full, async_op)

    def ring(self, axis):
        return _RecordingRing(self, axis)


class _RecordingRing:
    def __init__(self, grid, axis):
        self.grid, self.axis = grid, axis
        self.size, self.rank = grid.axes[axis], 0

    def source_at(self, step):
        return (-step) % self.size  # as the engine's Ring (cpp/ring.h)

    def pass_on(self, tensors, step):
        send = [t.contiguous() for t in tensors]
        if self.size > 1:
            self.grid.log.append(Collective("send", self.axis, float(sum(_nbytes(t) for t in send))))
        return _Done([torch.empty_like(t) for t in send])


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _GEMMS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def record_layer(mode, hidden, heads, seq, sp, batch, dtype=torch.bfloat16, causal=True) -> LayerSchedule:
    """Forward and backward of mode's TransformerLayer on `batch` sequences of a replica."""
    from ..nn.transformer import TransformerLayer
    from .base import grid_axes

    grid = RecordingGrid(grid_axes(1, 1, sp, mode), mode)
    layer = TransformerLayer(hidden, heads, grid, mode, dtype=dtype, causal=causal, device=grid.device)
    local = layer.input_layout.local_shape((batch, seq, hidden), grid)
    x = torch.empty(local, dtype=dtype, device=grid.device, requires_grad=True)
    with _CountGemms() as counter:
        y = layer(x)
        y.backward(torch.empty_like(y))
    params = sum(p.numel() for p in layer.parameters())
    return LayerSchedule(tuple(grid.log), counter.calls, params)


def batch_unit(mode, sp) -> int:
    """The smallest batch the mode's activation layout splits (its batch-dim axes)."""
    from .base import AxesView, grid_axes

    axes = dict(grid_axes(1, 1, sp, mode))
    dims = mode.layout(AxesView(axes)).dims
    return math.prod(axes.get(a, 1) for a in (dims[0] if dims else ()))


@lru_cache(maxsize=512)
def layer_schedule(mode, hidden, heads, seq, sp) -> tuple:
    """(schedule at b0 sequences, schedule at 2 b0, b0): bytes at any batch b are
    bytes(b0) + (bytes(2 b0) - bytes(b0)) (b - b0) / b0."""
    b0 = batch_unit(mode, sp)
    one = record_layer(mode, hidden, heads, seq, sp, b0)
    two = record_layer(mode, hidden, heads, seq, sp, 2 * b0)
    return one, two, b0


def collectives_at(mode, hidden, heads, seq, sp, batch: float) -> list:
    """The layer's collectives for `batch` sequences of a replica (fractions allowed)."""
    one, two, b0 = layer_schedule(mode, hidden, heads, seq, sp)
    f = (batch - b0) / b0
    return [Collective(a.op, a.axis, a.nbytes + (b.nbytes - a.nbytes) * f)
            for a, b in zip(one.collectives, two.collectives)]
