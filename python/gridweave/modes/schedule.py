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

from .. import _C
from ..grid import Work

_GEMMS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}


@dataclass(frozen=True)
class Collective:
    """One collective of a layer on one rank. nbytes: the whole buffer (all-gather output,
    reduce-scatter / all-reduce / all-to-all input, broadcast / reduce payload, scatter /
    gather full tensor, ring send payload), as gw.plan.collective_time takes it. member_bytes
    and root: what the engine's traffic counters take (this member's input, a scatter's
    output; the root or the peer), so a step's counters are predicted exactly
    (_C.message_schedule); elem: the element size the ring ops cut chunks on."""
    op: str
    axis: str
    nbytes: float
    member_bytes: float = 0.0
    root: int = 0
    elem: int = 1


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
    """Stands in for gw.Grid on one rank (`coords`; default every coordinate 0) of a grid with
    `axes`: every collective returns a meta tensor of the right shape and is recorded."""

    def __init__(self, axes, tp, coords=None):
        self.axes = dict(axes)
        self.tp = tp
        self.device = torch.device("meta")
        self.timeout = 0.0
        self.rank, self.world_size = 0, math.prod(self.axes.values())
        self.coords = {a: (coords or {}).get(a, 0) for a in self.axes}
        self.log: list = []

    def size(self, axis=None) -> int:
        if axis is None:
            return self.world_size
        return math.prod(self.axes[a] for a in ([axis] if isinstance(axis, str) else axis))

    def index(self, axis) -> int:
        return self.coords[axis]

    def _record(self, op, axis, nbytes, result, async_op, member=None, root=0, elem=1):
        self.log.append(Collective(op, self.label(axis), float(nbytes),
                                   float(nbytes if member is None else member), int(root), int(elem)))
        return _Done(result) if async_op else result

    def label(self, axis) -> str:
        """The engine's counter label of an axis argument (the axes as given, "world" for None)."""
        return "world" if axis is None else _label(axis)

    def all_gather(self, t, axis, dim=0, async_op=False, out=None):
        g = self.size(axis)
        shape = list(t.shape)
        shape[dim % t.dim()] *= g
        res = t.new_empty(shape)
        return self._record("all_gather", axis, _nbytes(res), res, async_op, _nbytes(t), elem=t.element_size())

    def reduce_scatter(self, t, axis, op="sum", dim=0, async_op=False, out=None):
        g = self.size(axis)
        shape = list(t.shape)
        shape[dim % t.dim()] //= g
        return self._record("reduce_scatter", axis, _nbytes(t), t.new_empty(shape), async_op, elem=t.element_size())

    def all_reduce(self, t, axis, op="sum", async_op=False):
        return self._record("all_reduce", axis, _nbytes(t), t, async_op, elem=t.element_size())

    def broadcast(self, t, axis, src=0, async_op=False):
        return self._record("broadcast", axis, _nbytes(t), t, async_op, root=src, elem=t.element_size())

    def broadcast_ints(self, values, axis, src=0) -> list:
        """Recorded as the int64 broadcast it is; this rank's values stand for src's (the shapes
        a recording meets are the same on every member)."""
        self._record("broadcast", axis, 8 * len(values), None, False, root=src, elem=8)
        return [int(v) for v in values]

    def reduce(self, t, axis, dst=0, op="sum", async_op=False):
        return self._record("reduce", axis, _nbytes(t), t, async_op, root=dst, elem=t.element_size())

    def all_to_all(self, t, axis, async_op=False):
        return self._record("all_to_all", axis, _nbytes(t), torch.empty_like(t), async_op, elem=t.element_size())

    def scatter(self, out, full=None, axis=None, src=0, async_op=False):
        return self._record("scatter", axis, _nbytes(out) * self.size(axis), out, async_op, _nbytes(out), src,
                            out.element_size())

    def gather(self, t, axis=None, dst=0, async_op=False):
        full = t.new_empty((self.size(axis) * t.shape[0],) + tuple(t.shape[1:]))
        return self._record("gather", axis, _nbytes(full), full, async_op, _nbytes(t), dst, t.element_size())

    def ring(self, axis):
        return _RecordingRing(self, axis)


class _RecordingRing:
    def __init__(self, grid, axis):
        self.grid, self.axis = grid, axis
        self.size, self.rank = grid.axes[axis], grid.coords[axis]

    def source_at(self, step):
        return (-step) % self.size  # as the engine's Ring (cpp/ring.h)

    def pass_on(self, tensors, step):
        send = [t.contiguous() for t in tensors]
        if self.size > 1:  # cpp/ring.cpp: per block a receive from the previous member, a send to the next
            for t in send:
                prev, nxt = (self.rank - 1) % self.size, (self.rank + 1) % self.size
                self.grid.log.append(Collective("recv", self.axis, 0.0, float(_nbytes(t)), prev))
                self.grid.log.append(Collective("send", self.axis, float(_nbytes(t)), float(_nbytes(t)), nxt))
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


# ---- a whole training step ------------------------------------------------------------------


def _scaled(c: Collective, f: float) -> Collective:
    return Collective(c.op, c.axis, c.nbytes * f, c.member_bytes * f, c.root, c.elem)


def record_stage(config, mode, dp, pp, sp, at, batch, per_stage, dtype=torch.bfloat16) -> LayerSchedule:
    """Forward and backward of one micro-batch of `batch` sequences through gw.models.GPTStage
    (embedding, loss, vocab-parallel pieces and the stage boundary's scatter / gather included)
    on the rank at coordinates `at` ((axis, index) pairs, the others 0; its stage at["pp"]), the
    model `config` with `per_stage` layers a stage. Returns (schedule, pipeline payload bytes)."""
    import dataclasses

    from ..models import GPTStage, build
    from .base import grid_axes

    cfg = dataclasses.replace(config, layers=per_stage * pp, tie=config.tie and pp == 1)
    axes = grid_axes(dp, pp, sp, mode)
    grid = RecordingGrid(axes, mode, _recorded_at(mode, axes, at))
    stage = grid.coords["pp"]
    model = build(cfg, dtype=dtype, device=grid.device)
    st = GPTStage(model, grid, mode, stage, pp)
    shape = st.activation_shape(batch, cfg.seq)
    with _CountGemms() as counter:
        if stage == 0:
            x = torch.empty((batch, cfg.seq), dtype=torch.int64, device=grid.device)
        else:
            x = torch.empty(shape, dtype=dtype, device=grid.device, requires_grad=True)
        y = st(x)
        if stage == pp - 1:
            st.loss(y, torch.empty((batch, cfg.seq), dtype=torch.int64, device=grid.device)).backward()
        else:
            y.backward(torch.empty_like(y))
    params = sum(p.numel() for p in st.parameters())
    return LayerSchedule(tuple(grid.log), counter.calls, params), math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class StepSchedule:
    """One training step (gw.train.run's) on one rank, as the code runs it: every collective
    and message with how many times it is issued, the GEMM calls, the parameters held, the
    pipeline's message and the rank's flat gradient buffer."""
    collectives: tuple   # (Collective, times)
    gemm_calls: int      # per step
    parameters: int      # elements this rank holds
    payload: int         # bytes of one pipeline message (activation or its gradient)


def _difference(a, b) -> list:
    """b's collectives that are not in a (a multiset difference, in b's order)."""
    from collections import Counter

    left = Counter(a)
    out = []
    for c in b:
        if left[c]:
            left[c] -= 1
        else:
            out.append(c)
    return out


@lru_cache(maxsize=256)
def step_schedule(config, mode, dp, pp, sp, at, microbatches, batch, dtype=torch.bfloat16, bsize=1 << 14,
                  coarsening=4, clip=True, loss_scaling=False) -> StepSchedule:
    """The collectives of one gw.train step on the rank at coordinates `at` ((axis, index) pairs,
    the others 0; its pipeline stage at["pp"]): `microbatches`
    micro-batches of `batch` sequences through the stage (recorded: gw.models.GPTStage on a
    RecordingGrid, its layers from one- and two-layer stages), the pipeline's messages and its
    micro-batch count (gw.pipeline.pipeline_step), the loss's all-reduce (gw.train.run), the
    optimizer's chunked gradient all-reduces (gw.optim.gradient_chunks) and the clipping norm's
    all-reduce (gw.sharding.grad_norm_of)."""
    from ..optim import gradient_chunks
    from ..sharding import grad_norm_of, placement_of

    one, payload = record_stage(config, mode, dp, pp, sp, at, batch, 1, dtype)
    two, _ = record_stage(config, mode, dp, pp, sp, at, batch, 2, dtype)
    stage = dict(at).get("pp", 0)
    layer = _difference(one.collectives, two.collectives)
    k = config.layers // pp
    items = [(c, microbatches) for c in one.collectives] + [(c, microbatches * (k - 1)) for c in layer]
    gemms = microbatches * (one.gemm_calls + (k - 1) * (two.gemm_calls - one.gemm_calls))
    params = one.parameters + (k - 1) * (two.parameters - one.parameters)
    pipeline = []  # seed 001: each micro-batch's activation forward, its gradient backward
    message = float(payload + _C.pipeline_header_bytes)
    for peer in (stage + 1, stage - 1):
        if 0 <= peer < pp:
            pipeline += [Collective("send", "pp", message, message, peer), Collective("recv", "pp", 0.0, message, peer)]
    grid = RecordingGrid(_step_axes(mode, dp, pp, sp), mode, dict(at))
    scalar = torch.empty(1, dtype=torch.float64, device=grid.device)
    grid.all_reduce(scalar, "pp", op="max")  # the micro-batch count every stage learns
    grid.all_reduce(scalar, None)  # the step's loss
    if loss_scaling:
        grid.all_reduce(scalar, None, op="max")  # the inf check (Grid.any)
    # the optimizer's gradient all-reduces, over the stage's parameters as its modules place them
    params_of = _stage_parameters(config, mode, dp, pp, sp, at, dtype)
    size = params_of[0].element_size()
    for lo, hi, axes in gradient_chunks(params_of, grid, bsize, coarsening)[2]:
        if axes:
            n = float((hi - lo) * size)
            grid.log.append(Collective("all_reduce", grid.label(axes), n, n, 0, size))
    if clip:
        grad_norm_of([(p, placement_of(p)) for p in params_of], grid)
    items += [(c, 1) for c in grid.log] + [(c, microbatches) for c in pipeline]
    return StepSchedule(tuple(items), gemms, params, payload)


def _recorded_at(mode, axes, at) -> dict:
    """The coordinates a recording runs at: `at`, moved onto the members that hold data where
    the mode's layout keeps it on some (cSub: sub-grid 0). The others learn the shapes from
    them (Grid.broadcast_ints) and issue the same ops; their messages are still their own
    (plan.step_counters)."""
    from .base import AxesView

    coords = dict(at)
    only = mode.base_layout(AxesView(dict(axes))).only
    if only is not None:
        coords[only[0]] = only[1]
    return coords


def _step_axes(mode, dp, pp, sp):
    from .base import grid_axes

    return grid_axes(dp, pp, sp, mode)


def _stage_parameters(config, mode, dp, pp, sp, at, dtype):
    """The stage's parameters (meta) without running it: its modules place them."""
    import dataclasses

    from ..models import GPTStage, build

    grid = RecordingGrid(_step_axes(mode, dp, pp, sp), mode, dict(at))
    cfg = dataclasses.replace(config, tie=config.tie and pp == 1)
    return list(GPTStage(build(cfg, dtype=dtype, device=grid.device), grid, mode, grid.coords["pp"], pp).parameters())
