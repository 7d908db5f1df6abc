"""A mode's per-layer schedule, recorded from the code that runs it.

The planner does not restate any algorithm: it builds the mode's TransformerLayer on a
RecordingGrid (meta tensors, nothing computed or sent), runs forward and backward, and
reads off every collective the autograd Functions issued (op, axis, bytes), every GEMM
call, and the parameters this rank holds. Change an algorithm and the prediction follows.
Bytes are affine in the batch (weights move whatever the batch, activations in
proportion), so two recordings give every micro-batch size exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _C, float8
from ..axes import AxesView
from ..axes import grid_axes as _grid_axes
from ..axes import stage_axes
from ..errors import GridError
from ..grid import LineArithmetic, LinePart, Work, one_part
from ..models import ModelConfig, build
from ..models.stage import GPTStage
from ..nn.moe import expert_line, plan_routing
from ..nn.transformer import TransformerLayer
from .. import optim
from ..optim import DistributedAdam, OffloadAdam, bucket_starts, gradient_chunks, matrices_only, uses_distributed
from ..pipeline import run_layers
from ..sharding import grad_norm_of, placement_of

# fused attention kernels (their backward is the name + "_backward"); the attention core's
# forward kernels: batched products (the math path) or fused attention
_FUSED_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_flash_attention"}
_ATTENTION = {"bmm", "baddbmm"} | _FUSED_ATTENTION
_GEMMS = {"mm", "bmm", "addmm", "baddbmm"} | _FUSED_ATTENTION
# kernels that pass over their rows more than once (max, sum of exponentials, normalise): their
# bytes at memory bandwidth and a cost per element for the further passes (Cluster.softmax_element_s)
_SOFTMAX = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}


# A send issued in one group with the send before it (Grid.all_to_all_v's batch of sends and
# receives): the engine counts it as a send; the planner charges the group's fixed cost once
GROUPED_SEND = "send+"


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
    flops: float = 0.0  # of those GEMM kernels
    kernels: int = 0    # the other kernels (element-wise, reductions, copies)
    kernel_bytes: float = 0.0  # that they read and write
    saved_bytes: float = 0.0   # activations kept for backward
    attention_flops: float = 0.0  # of the forward attention core (QK^T, softmax-weighted values)
    peak_bytes: float = 0.0    # most bytes held at once (activations, their gradients, temporaries, gradients)
    fused_attention_flops: float = 0.0  # of the fused attention kernels, forward and backward (within flops)
    gemm_bytes: float = 0.0  # the other GEMM kernels' operands and outputs (read from memory: Cluster.gemm_bandwidth_Bps)
    attention_rows: float = 0.0  # query rows (batch x heads x sequence) of the fused attention kernels, forward and backward
    attention_scores: float = 0.0  # their query x key pairs (each an exponential and a mask, whatever the head size)
    softmax_elements: float = 0.0  # elements of the (log-)softmax kernels, forward and backward (within kernels)
    float8_flops: float = 0.0  # of the float8 products (torch._scaled_mm), forward and backward (within flops)
    attention_calls: int = 0  # the fused attention kernels, forward and backward (within gemm_calls)
    attention_head_scores: float = 0.0  # their query x key pairs times the query's head size (by it, its mean)

    @cached_property
    def tally(self) -> tuple:
        """The collectives that cost time (receives cost nothing: their time is the send's) as
        ((op, axis, nbytes), times issued), in first-issue order: a stage's layers issue one layer's
        collectives again and again, so the planner costs each distinct one once."""
        return tally_of(self.collectives)

    def minus(self, other: "LayerSchedule") -> "LayerSchedule":
        """What this recording has beyond `other` (one layer: a two-layer stage minus a one-layer one)."""
        return LayerSchedule(tuple(_difference(other.collectives, self.collectives)),
                             **{k: getattr(self, k) - getattr(other, k) for k in _SUMMED})

    def plus(self, other: "LayerSchedule", times: int = 1) -> "LayerSchedule":
        return LayerSchedule(self.collectives + other.collectives * times,
                             **{k: getattr(self, k) + times * getattr(other, k) for k in _SUMMED})


# the fields that add up over layers; of them, the counts do not change with the batch
_SUMMED = ("gemm_calls", "parameters", "flops", "kernels", "kernel_bytes", "saved_bytes", "attention_flops",
           "peak_bytes", "fused_attention_flops", "gemm_bytes", "attention_rows", "attention_scores",
           "softmax_elements", "float8_flops", "attention_calls", "attention_head_scores")
_COUNTS = ("gemm_calls", "parameters", "kernels", "attention_calls")


class _Done(Work):
    """An already finished async op of the recording grid."""

    def __init__(self, result):
        super().__init__(None, 0.0, None)
        self._result, self._done = result, True


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _tensors(x) -> list:
    """The tensors of an argument or output: itself, or those of a list (cat's, the foreach and
    fused optimizer kernels')."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)] if isinstance(x, (list, tuple)) else []


def _kernel_bytes(func, args, out) -> int:
    """Bytes a kernel reads and writes: its tensor arguments, and its outputs, or where it returns
    none (torch's fused AdamW, the foreach ops) the arguments its schema says it writes."""
    read = sum(_nbytes(t) for a in args for t in _tensors(a))
    written = _tensors(out)
    if not written:
        written = [t for a, arg in zip(args, func._schema.arguments)
                   if arg.alias_info is not None and arg.alias_info.is_write for t in _tensors(a)]
    return read + sum(_nbytes(t) for t in written)


def _label(axis) -> str:
    return axis if isinstance(axis, str) else ",".join(axis)


class RecordingGrid(LineArithmetic):
    """Stands in for gw.Grid on one rank (`coords`; default every coordinate 0) of a grid with
    `axes`: every collective returns a meta tensor of the right shape and is recorded. Its axis
    arithmetic is Grid's own (LineArithmetic)."""

    def __init__(self, axes, tp, coords=None, device="meta"):
        self.axes = dict(axes)
        self.tp = tp
        self.device = torch.device(device)
        self.timeout = 0.0
        self.rank, self.world_size = 0, math.prod(self.axes.values())
        self.coords = {a: (coords or {}).get(a, 0) for a in self.axes}
        self.log: list = []

    def _index_in(self, axes: list) -> int:
        """This rank's index in the line over `axes` (row-major, first slowest: Grid's); a recording
        has no nodes, so its line parts are blocks of consecutive members (LineArithmetic._members)."""
        i = 0
        for a in axes:
            i = i * self.axes[a] + self.coords[a]
        return i

    def _record(self, op, axis, nbytes, result, async_op, member=None, root=0, elem=1):
        self.log.append(Collective(op, self.label(axis), float(nbytes),
                                   float(nbytes if member is None else member), int(root), int(elem)))
        return _Done(result) if async_op else result

    def label(self, axis) -> str:
        """The engine's counter label of an axis argument (the axes as given, "world" for None; a
        line part: its line's, then its own, as Grid.comm names its communicator)."""
        axis = one_part(axis)
        if isinstance(axis, LinePart):
            return f"{_label(tuple(axis.axes))}:{axis.label}"
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
        axis = self.reduce_line(axis)
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

    def all_to_all_v(self, t, send_counts, recv_counts, axis, tag: int = 0):
        """Recorded as Grid.all_to_all_v runs it: a send to each other member with rows for it, a
        receive from each with rows for this one (its own rows are copied)."""
        row = _nbytes(t) // max(t.shape[0], 1)
        me = self.index(axis)
        self.record_group(self.label(axis), [(k, inc * row or None, k, out * row or None)
                                             for k, (out, inc) in enumerate(zip(send_counts, recv_counts)) if k != me])
        return t.new_empty((sum(recv_counts),) + tuple(t.shape[1:]))

    def record_group(self, label: str, messages: list) -> None:
        """One group of point-to-point messages on line `label` (the engine's batch), each
        (member received from, its bytes, member sent to, its bytes; None: no such message): a
        receive and a send each, the sends after the group's first GROUPED_SEND (they travel in
        its launch: one fixed cost a group)."""
        first = True
        for src, inc, dst, out in messages:
            if inc is not None:
                self.log.append(Collective("recv", label, 0.0, float(inc), src))
            if out is not None:
                self.log.append(Collective("send" if first else GROUPED_SEND, label, float(out), float(out), dst))
                first = False

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
        self.grid, self.axis = grid, grid.label(axis)
        self.size, self.rank = grid.size(axis), grid.index(axis)

    def source_at(self, step):
        return (-step) % self.size  # as the engine's Ring (cpp/ring.h)

    def pass_on(self, tensors, step):
        send = [t.contiguous() for t in tensors]
        if self.size > 1:  # cpp/ring.cpp: per block a receive from the previous member, a send to the
            # next, the step's blocks one group (Ring::exchange's batch)
            prev, nxt = (self.rank - 1) % self.size, (self.rank + 1) % self.size
            self.grid.record_group(self.axis, [(prev, _nbytes(t), nxt, _nbytes(t)) for t in send])
        return _Done([torch.empty_like(t) for t in send])


def _flops(name, args, pairs: float = 0.0) -> float:
    """FLOPs of one GEMM-like kernel from its operands' shapes (2 per multiply-add); fused
    attention: its two products (forward), twice that (backward), over the query x key `pairs` it
    computes (attention_pairs: half of them where causal)."""
    shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm", "addmm"):
        a, b = shapes[-2], shapes[-1]
        return 2.0 * a[0] * a[1] * b[1]
    if name in ("bmm", "baddbmm"):
        a, b = shapes[-2], shapes[-1]
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    f = 4.0 * pairs * shapes[0][-1]
    return 2 * f if name.endswith("backward") else f


def attention_pairs(func, args, kwargs) -> float:
    """The query x key pairs a fused attention kernel computes: (batch x heads x s_q) rows of s_k
    keys, half of them under its causal mask (a ring's off-diagonal blocks have none: whole blocks,
    twice a diagonal block's work; one count for both would cost them alike). Read by the
    argument's name in the op's schema (forward and backward kernels place it differently)."""
    q = args[0]  # the query, or the backward's output gradient: (batch, heads, s_q, d) either way
    key = args[2] if func.overloadpacket.__name__.endswith("_backward") else args[1]
    pairs = float(math.prod(q.shape[:-1]) * key.shape[-2])
    names = [a.name for a in func._schema.arguments]
    causal = kwargs.get("is_causal", False)
    if "is_causal" in names and names.index("is_causal") < len(args):
        causal = args[names.index("is_causal")]
    return pairs / 2 if causal else pairs


class MetaOutputs:
    """A memo of functional ops' outputs on meta tensors. On the meta device an op's outputs are
    fixed by its inputs' shapes, strides, dtypes and offsets and its other arguments, yet torch
    computes them in Python for many ops (its reference decompositions): most of a recording's
    time, and a recording repeats the same calls (layers, ring steps, the grids that share a
    mode). A call whose schema lets an output alias an input (views, in-place and out= ops),
    one on another device, or one with an argument that is not plain data runs as it is; an
    output is remade only where the remade tensor's shape, strides, dtype and storage match
    the real one's. Exact by construction: the recording sees the same tensors' metadata."""

    _PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)

    def __init__(self, size: int = 1 << 17):
        """size: the most calls remembered (0: none, every op runs)."""
        self.size, self.memo, self.plain_schema = size, {}, {}

    # initialisers: on meta they change nothing (no data), so a recording's module construction
    # need not run torch's Python reference for them
    _NO_DATA = {"normal_", "uniform_", "fill_", "zero_"}

    def __call__(self, func, args, kwargs):
        if self.size and func.overloadpacket.__name__ in self._NO_DATA and isinstance(args[0], torch.Tensor) and \
                args[0].device.type == "meta":
            return args[0]
        key = self._key(func, args, kwargs)
        recipe = self.memo.get(key) if key is not None else None
        if recipe:
            return tree_unflatten([self._make(r) for r in recipe[1]], recipe[0])
        out = func(*args, **kwargs)
        if key is not None and len(self.memo) < self.size:
            self.memo[key] = self._recipe(out)
        return out

    def _key(self, func, args, kwargs):
        plain = self.plain_schema.get(func)
        if plain is None:  # no argument or return may alias (views, in-place, out=)
            schema = func._schema
            plain = self.plain_schema[func] = not any(a.alias_info is not None for a in
                                                      list(schema.arguments) + list(schema.returns))
        if not plain:
            return None
        key = [func, self._leaf(args)]
        if kwargs:
            key.append(self._leaf(tuple(kwargs.items())))
        return None if None in key else tuple(key)

    def _leaf(self, x):
        """A hashable stand-in for an argument: a tensor's metadata, plain data as it is, a list's
        items; None where the argument is neither."""
        if isinstance(x, torch.Tensor):
            if x.device.type != "meta" or x.layout != torch.strided:
                return None
            return x.shape, x.stride(), x.dtype, x.storage_offset()
        if isinstance(x, (tuple, list)):
            parts = tuple([self._leaf(y) for y in x])
            return None if None in parts else (type(x), parts)
        return (type(x), x) if isinstance(x, self._PLAIN) else None

    def _recipe(self, out):
        """How to remake `out`, or False (not remade: not plain tensors, or a remade one differs)."""
        leaves, spec = tree_flatten(out)
        recipe = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if x.device.type != "meta" or x.layout != torch.strided or x.requires_grad:
                    return False
                r = ("T", tuple(x.shape), x.stride(), x.dtype, x.storage_offset(), x.untyped_storage().nbytes())
                again = self._make(r)
                if (again.untyped_storage().nbytes(), again.storage_offset()) != (r[5], r[4]):
                    return False
                recipe.append(r)
            elif isinstance(x, self._PLAIN):
                recipe.append(("V", x))
            else:
                return False
        return spec, tuple(recipe)

    @staticmethod
    def _make(r):
        if r[0] == "V":
            return r[1]
        _, shape, stride, dtype, offset, nbytes = r
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


META = MetaOutputs()  # shared by every recording of the process: a pure memo, like the recordings' lru caches


class MetaMemo(TorchDispatchMode):
    """Every op on meta tensors through META (building a stage, the optimizer's recording)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return META(func, args, kwargs or {})


class _LiveStorages:
    """Bytes of the storages added and still alive, and the most they came to at once: each
    storage once while it lives (torch keeps one Python object per storage, so a finalizer fires
    when the storage is freed; an address is another storage's once its first is gone)."""

    def __init__(self):
        self.alive, self.live, self.peak = set(), 0, 0

    def add(self, st) -> None:
        key = st._cdata
        if key in self.alive:
            return
        n = st.nbytes()
        self.alive.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, key, n)

    def _free(self, key, n):
        if key in self.alive:
            self.alive.discard(key)
            self.live -= n


class Census(TorchDispatchMode):
    """What a recorded run costs a rank: GEMM calls and FLOPs, the other kernels (views are
    not kernels) and the bytes they read and write, and the activations kept for backward."""

    def __init__(self):
        super().__init__()
        self.calls, self.flops, self.kernels, self.bytes = 0, 0.0, 0, 0.0
        self.attention_flops = 0.0  # forward attention core (QK^T and the values): selective recomputation's
        self.fused_attention_flops = 0.0  # fused attention kernels, forward and backward (their own rate)
        self.gemm_bytes = 0.0  # the other GEMMs' operands and outputs
        self.attention_rows = 0.0  # the fused attention kernels' query rows
        self.attention_scores = 0.0  # and their query x key pairs
        self.softmax_elements = 0.0  # the softmax kernels' elements
        self.float8_flops = 0.0  # the float8 products'
        self.attention_calls = 0  # the fused attention kernels
        self.attention_head_scores = 0.0  # and their pairs times the query's head size
        self.forward = True  # the recorder sets it False before backward
        self.held = _LiveStorages()  # bytes of the tensors the run holds at once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = META(func, args, kwargs or {})
        name = func.overloadpacket.__name__
        if name in _GEMMS or name.removesuffix("_backward") in _GEMMS:
            self.calls += 1
            fused = name.removesuffix("_backward") in _FUSED_ATTENTION
            pairs = attention_pairs(func, args, kwargs or {}) if fused else 0.0
            f = _flops(name, args, pairs)
            self.flops += f
            if name in _ATTENTION and self.forward:
                self.attention_flops += f
            if float8.is_float8(args[0]):  # an mm of torchao's float8 tensors: torch._scaled_mm beneath
                self.float8_flops += f
            if fused:
                self.fused_attention_flops += f
                self.attention_rows += math.prod(args[0].shape[:-1])  # q: (batch, heads, s_q, d)
                self.attention_scores += pairs
                self.attention_calls += 1
                query = args[1] if name.endswith("_backward") else args[0]  # a backward's first is the output's gradient
                self.attention_head_scores += pairs * query.shape[-1]
            else:
                self.gemm_bytes += _kernel_bytes(func, args, out)
        elif not func.is_view:
            if name in _SOFTMAX:
                self.softmax_elements += out.numel()
            self.kernels += 1
            self.bytes += _kernel_bytes(func, args, out)
        if not func.is_view:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.hold(t)
        return out

    def hold(self, t):
        """Count t's storage while it lives: until its last tensor or view dies."""
        self.held.add(t.untyped_storage())

    @property
    def peak(self) -> int:
        """The most bytes the run held at once."""
        return self.held.peak


class FusedAttention(TorchFunctionMode):
    """On the meta device torch's scaled_dot_product_attention takes its math path: the
    (s x s) scores and probabilities made and kept for backward. The devices a plan is for
    run a fused kernel (flash or memory-efficient attention on CUDA, flash on the host) that
    keeps q, k, v, the output and the log-sum-exp, so the recording calls one: its memory,
    kernels and bytes are then the run's."""

    _NAMES = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            kwargs.update(zip(self._NAMES, args[3:]))
            q, k, v = args[:3]
            # the fused kernels group key/value heads themselves; values of another width than the
            # keys (latent attention's) take torch's math path here, its FLOPs exact
            if kwargs.get("attn_mask") is None and v.shape[-1] == q.shape[-1]:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), scale=kwargs.get("scale"))[0]
            args = args[:3]
        return func(*args, **kwargs)


class _Saved:
    """Bytes of the tensors autograd keeps for backward, parameters not: the most that the
    storages packed for backward and still alive come to at once (_LiveStorages). Counted by
    address for the run instead, a storage freed and another made at its address was one, and how
    much the allocator's reuse hid changed from run to run (1.59 MB one run, 1.75 MB another)."""

    def __init__(self, params):
        self.skip = {p.untyped_storage()._cdata for p in params}
        self.kept = _LiveStorages()

    def pack(self, t):
        st = t.untyped_storage()
        if st._cdata not in self.skip:
            self.kept.add(st)
        return t

    @property
    def bytes(self) -> int:
        return self.kept.peak

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def batch_unit(mode, sp) -> int:
    """The smallest batch the mode's activation layout splits (its batch-dim axes)."""
    axes = dict(_grid_axes(1, 1, sp, mode))
    dims = mode.layout(AxesView(axes)).dims
    return math.prod(axes.get(a, 1) for a in (dims[0] if dims else ()))


def collectives_at(mode, hidden, heads, seq, sp, batch: float) -> list:
    """One GPT layer's collectives in `mode` for `batch` sequences of a replica (the layer
    alone: step_schedule with ends=False, one layer)."""
    config = ModelConfig("gpt", 1, hidden, heads, 1, seq)
    return list(step_schedule(config, mode, 1, 1, sp, (), 1, batch, ends=False).microbatch.collectives)


# ---- a whole training step ------------------------------------------------------------------


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts model's layers are recorded: the expert-parallel degree (its line
    carved out of dp x sp, nn.moe.expert_line) and the planned routing's imbalance (the most
    loaded expert's slots over the mean; nn.moe.planned_counts)."""
    ep: int = 1
    imbalance: float = 1.0


def _stage_dp(config, dp: int) -> int:
    """The dp a stage is recorded at: 1 (a dense stage's layers and parameters do not depend on
    it), or a mixture of experts' own (its expert line is carved out of dp x sp)."""
    return 1 if config.moe is None else dp


def _moe_options(config, grid, experts) -> dict:
    """A stage's options for a mixture-of-experts model: its expert line (else none)."""
    return {} if config.moe is None else {"ep": expert_line(grid, (experts or Experts()).ep)}


class GroupedGemm(TorchFunctionMode):
    """torch's grouped GEMM has a meta kernel for bf16 only, and the experts run it in float32 and
    fp16 too: the recording runs one product of its FLOPs in its place, the rows through the
    first group's (K, N) weights (2 M K N forward, its two products backward, one kernel each,
    as the grouped kernel's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.nn.functional.grouped_mm, torch._grouped_mm) and args[0].dim() == 2 and args[1].dim() == 3:
            return torch.mm(args[0], args[1][0])
        return func(*args, **(kwargs or {}))


def record_stage(config, mode, dp, pp, sp, at, batch, per_stage, dtype=torch.bfloat16, ends=True,
                 fused_attention=True, attention=("ring", 1), experts=None, flat_gradients=False,
                 fused_loss=False, recipe=None) -> tuple:
    """Forward and backward of one micro-batch of `batch` sequences through gw.models.GPTStage
    (embedding, loss, vocab-parallel pieces and the stage boundary's scatter / gather included)
    on the rank at coordinates `at` ((axis, index) pairs, the others 0; its stage at["pp"]), the
    model `config` with `per_stage` layers a stage; ends=False: its layers alone.
    fused_attention: the attention core as a fused kernel (FusedAttention), else torch's math
    path with the scores kept (as Megatron ran before flash attention). attention: how it runs
    over sp (a SeqAttention value and the Ulysses degree). experts: a mixture of experts' Experts
    (None: ep 1, balanced), routed as planned (nn.moe.plan_routing). flat_gradients: each gradient's
    flat copy made as the backward completes it and kept to the end (DistributedAdam's buckets at
    ZeRO 0 and 1), so the peak holds them as they appear. fused_loss: GPTStage's. recipe: the linears'
    products in float8 (gw.float8.convert, as gw.train builds it). Returns (schedule, pipeline payload
    bytes)."""
    axes = _grid_axes(dp, pp, sp, mode)
    grid = RecordingGrid(axes, mode, _recorded_at(mode, axes, at))
    stage = grid.coords["pp"]
    options = dict(attention=attention[0], ulysses_degree=attention[1], **_moe_options(config, grid, experts))
    with MetaMemo():  # building it (its run is the Census's, which memoizes the same way)
        dense = _dense(config, pp * per_stage, dtype)
        if ends:
            st = GPTStage(dense, grid, mode, stage, pp, fused_loss=fused_loss, **options)
            shape = st.activation_shape(batch, config.seq)
        else:  # the layers alone, on the stage's (dp-free) layout
            st = torch.nn.Module()
            st.layers = torch.nn.ModuleList(TransformerLayer.from_dense(d, grid, mode=mode, **options)
                                            for d in dense.layers[:per_stage])
            shape = st.layers[0].input_layout.without("dp").local_shape((batch, config.seq, config.hidden), grid)
        float8.convert(st, recipe)
    plan_routing(st, (experts or Experts()).imbalance)
    params = list(st.parameters())
    saved = _Saved(params)
    # the optimizer's flat copies, made here (no kernel of the run) and counted from the moment the
    # backward completes each gradient: they meet the activations not yet freed, not all of them
    flats = {id(p): torch.empty_like(p) for p in params if flat_gradients and p.requires_grad}
    with Census() as census, GroupedGemm(), (FusedAttention() if fused_attention else contextlib.nullcontext()):
        hooks = [p.register_post_accumulate_grad_hook(lambda p: census.hold(flats[id(p)]))
                 for p in params if id(p) in flats]
        if not ends:
            x = torch.empty(shape, dtype=dtype, device=grid.device, requires_grad=True)
        elif stage == 0:
            x = torch.empty((batch, config.seq), dtype=torch.int64, device=grid.device)
        else:
            x = torch.empty(shape, dtype=dtype, device=grid.device, requires_grad=True)
        with saved.hooks():
            y = st(x) if ends else run_layers(st.layers, x)
            last = ends and stage == pp - 1
            if last:
                y = st.loss(y, torch.empty((batch, config.seq), dtype=torch.int64, device=grid.device))
        census.forward = False
        if last:
            y.backward()
        else:
            y.backward(torch.empty_like(y))
    for h in hooks:
        h.remove()
    sched = LayerSchedule(tuple(grid.log), census.calls, sum(p.numel() for p in params), census.flops,
                          census.kernels, census.bytes, saved.bytes, census.attention_flops, census.peak,
                          census.fused_attention_flops, census.gemm_bytes, census.attention_rows,
                          census.attention_scores, census.softmax_elements, census.float8_flops,
                          census.attention_calls, census.attention_head_scores)
    return sched, math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class StepSchedule:
    """One training step (gw.train's) on one rank, as the code runs it. microbatch: one
    micro-batch through the stage (its collectives, kernels, FLOPs, kept activations) and its
    pipeline messages; step: the once-a-step collectives (loss, optimizer's
    gradient chunks, clipping norm); parameters: elements this rank holds."""
    microbatch: LayerSchedule
    microbatches: int
    step: tuple          # of Collective
    parameters: int
    parameter_tensors: int
    layer: LayerSchedule  # one of the stage's layers (inside microbatch)
    layers: int           # the stage's layers
    state_elements: int = -1  # elements of optimizer state per kind on this rank (-1: parameters, unsharded)
    gathered: int = 0  # ZeRO-3: the most parameter elements gathered whole at once (units beside the shards)
    in_backward: tuple = ()  # of Collective: started in the last micro-batch's backward (overlapped chunks)

    @cached_property
    def step_tally(self) -> tuple:
        """The once-a-step collectives as LayerSchedule.tally counts them."""
        return tally_of(self.step)

    @property
    def shard(self) -> int:
        """Elements of each optimizer state (master, exp_avg, exp_avg_sq) this rank keeps."""
        return self.parameters if self.state_elements < 0 else self.state_elements

    @property
    def collectives(self) -> tuple:
        """(Collective, times issued in the step)."""
        return tuple((c, self.microbatches) for c in self.microbatch.collectives) + \
            tuple((c, 1) for c in self.in_backward + self.step)


def tally_of(collectives) -> tuple:
    """((op, axis, nbytes), times issued) of the collectives but receives, in first-issue order."""
    counts: dict = {}
    for c in collectives:
        if c.op != "recv":
            k = (c.op, c.axis, c.nbytes)
            counts[k] = counts.get(k, 0) + 1
    return tuple(counts.items())


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


def stage_role(pp: int, stage: int) -> tuple:
    """(pp, stage) of the smallest pipeline whose stage `stage` holds and does what stage `stage`
    of `pp` does: the only stage (pp 1), the first (stage 0 of 2), the last (stage 1 of 2) or one
    between (stage 1 of 3). A stage depends on pp only through whether it has the embedding
    (stage 0), the head (the last) and boundaries (pp > 1), so the recordings of grids that differ
    in pp alone are one recording (and in dp alone: a stage issues no collective over dp, its
    gradients are reduced by the optimizer, recorded with dp as it is). Exact:
    tests/python/test_plan.py compares them."""
    return (1, 0) if pp == 1 else (2, 0) if stage == 0 else (2, 1) if stage == pp - 1 else (3, 1)


@lru_cache(maxsize=1024)
def _stage_recordings(config, mode, dp, pp, sp, at, dtype, ends, fused_attention, attention, experts,
                      flat_gradients, fused_loss, batches: tuple, recipe=None) -> dict:
    """record_stage with one and two layers a stage at each of `batches`: {(layers, batch): recording}."""
    return {(k, b): record_stage(config, mode, dp, pp, sp, at, b, k, dtype, ends, fused_attention, attention, experts,
                                 flat_gradients, fused_loss, recipe) for k in (1, 2) for b in batches}


def _lerp(a: LayerSchedule, b: LayerSchedule, f: float) -> LayerSchedule:
    """a + (b - a) f: the schedule at a batch between (or beyond) two recordings'."""
    if [(c.op, c.axis) for c in a.collectives] != [(c.op, c.axis) for c in b.collectives]:
        raise GridError("a recording's collectives change with the batch; it cannot be interpolated")
    cs = tuple(Collective(x.op, x.axis, x.nbytes + (y.nbytes - x.nbytes) * f,
                          round(x.member_bytes + (y.member_bytes - x.member_bytes) * f), x.root, x.elem)
               for x, y in zip(a.collectives, b.collectives))
    return LayerSchedule(cs, **{k: getattr(a, k) if k in _COUNTS else getattr(a, k) + (getattr(b, k) - getattr(a, k)) * f
                                for k in _SUMMED})


@lru_cache(maxsize=1024)
def step_schedule(config, mode, dp, pp, sp, at, microbatches, batch, dtype=torch.bfloat16, bsize=1 << 14,
                  coarsening=4, clip=True, loss_scaling=False, ends=True, fused_attention=True,
                  announced=False, zero=0, offload=True, attention=("ring", 1), agreed=False,
                  overlap=False, experts=None, flat_gradients=False, fused_loss=False, recipe=None) -> StepSchedule:
    """The collectives of one gw.train step on the rank at coordinates `at` ((axis, index) pairs,
    the others 0; its pipeline stage at["pp"]): `microbatches` micro-batches of `batch`
    sequences through the stage (recorded: gw.models.GPTStage on a RecordingGrid, its layers
    from one- and two-layer stages), the pipeline's messages (gw.pipeline.pipeline_step, given the
    job's micro-batch count), the loss's all-reduce (gw.train.train_step), the optimizer's
    chunked gradient all-reduces (gw.optim.gradient_chunks) and the clipping norm's all-reduce
    (gw.sharding.grad_norm_of). ends=False: the stages' layers alone, no step collectives.
    announced: the transport has no receive-from-any (NCCL), so each pipeline message is first
    announced on the host control channel (its header, cpp/pipeline.cpp's Outbox). zero (a ZeRO
    stage) or offload=False: gw.optim.DistributedAdam's reductions, norm and all-gathers, recorded
    from its own code. attention: (SeqAttention value, Ulysses degree) of the layers over sp.
    agreed: the message-driven schedule, whose stages between two others agree on each message
    they take (its first member's 16-byte broadcast over the stage's axes, on a host channel).
    overlap: OffloadAdam's overlap (gw.train's overlap_grad_reduce): its chunks in the backward's
    layout, each started in the last backward (StepSchedule.in_backward). experts: a mixture of
    experts' (recorder.Experts; its layers are recorded on the whole dp, their line carved out of it).
    flat_gradients, fused_loss: record_stage's (DistributedAdam's flat gradient copies in the peak; the
    head's fused projection and loss)."""
    stage = dict(at).get("pp", 0)
    rpp, rstage = stage_role(pp, stage)  # the recordings of grids that share this stage's shapes
    # a dense stage's layers are alike on every dp replica; a mixture of experts' line spans dp
    others = tuple((a, i) for a, i in at if a != "pp" and (a != "dp" or config.moe is not None))
    # bytes and FLOPs are affine in the batch, but the peak is not: the most of the activations
    # (growing with the batch) and the gradients (not), whichever moment holds more; so the two
    # recordings are the multiples of the smallest batch b0 around this one
    b0 = batch_unit(mode, sp)
    lo = max(b0, int(batch // b0) * b0)
    f = (batch - lo) / b0  # affine between the two recordings (the peak too, near them)

    def recorded(kind):  # the stage of one and of two layers of one kind, and one layer's difference
        rec = _stage_recordings(kind, mode, _stage_dp(config, dp), rpp, sp, others + (("pp", rstage),), dtype, ends,
                                fused_attention, attention, experts, flat_gradients, fused_loss, (lo, lo + b0), recipe)
        one, two = (_lerp(rec[(k, lo)][0], rec[(k, lo + b0)][0], f) for k in (1, 2))
        return one, two.minus(one), round(rec[(1, lo)][1] + (rec[(1, lo + b0)][1] - rec[(1, lo)][1]) * f)

    one, layer, payload = recorded(_uniform(config, False))
    per, dense = config.layers // pp, _dense_in_stage(config, pp, stage)
    if not dense:
        stage_work = one.plus(layer, per - 1)  # the stage's layers are one layer's recording
    else:  # DeepSeek-V3's dense first layers: each kind's layers from its own recordings, the
        # stage's first layer (what a one-layer recording holds beyond a later layer) of its own kind
        one_dense, dense_layer, _ = recorded(_uniform(config, True))
        first_dense = stage * per in config.dense_layers
        stage_work = (one_dense if first_dense else one).plus(layer, per - dense - (not first_dense)) \
            .plus(dense_layer, dense - first_dense)
    pipeline = []  # AxoNN: each micro-batch's activation forward, its gradient backward
    message = float(_C.pipeline_message_bytes(payload))  # the payload alone: no message carries a header
    for peer in (stage + 1, stage - 1):
        if 0 <= peer < pp:
            pipeline += [Collective("send", "pp", message, message, peer), Collective("recv", "pp", 0.0, message, peer)]
            if announced:
                header = float(_C.pipeline_header_bytes)
                pipeline += [Collective("send", "pp:control", header, header, peer),
                             Collective("recv", "pp:control", 0.0, header, peer)]
    group = stage_axes(_grid_axes(dp, pp, sp, mode))
    if agreed and group and 0 < stage < pp - 1:  # cpp/pipeline.cpp's LeadReceiver: one per message received
        said = float(_C.pipeline_header_bytes)
        pipeline += [Collective("broadcast", ",".join(group) + ":control", said, said, 0, 8)] * 2
    micro = dataclasses.replace(stage_work, collectives=stage_work.collectives + tuple(pipeline))
    if not ends:
        return StepSchedule(micro, microbatches, (), stage_work.parameters, 0, layer, config.layers // pp)
    grid = RecordingGrid(_grid_axes(dp, pp, sp, mode), mode, dict(at))
    scalar = torch.empty(1, dtype=torch.float64, device=grid.device)
    grid.all_reduce(scalar, None)  # the step's loss (the micro-batch count is the job's: no agreement)
    if loss_scaling:
        grid.all_reduce(scalar, None, op="max")  # the inf check (Grid.any)
    # the stage's parameters as the smallest pipeline with this stage's role and layers holds them;
    # unsharded (zero 0: OffloadAdam's chunks, or DistributedAdam's unpadded buckets all-reduced), the
    # optimizer depends on dp only through whether it is an axis (size > 1); sharded, on its size
    odp, oat = (dp, at) if zero or config.moe is not None else (min(dp, 2), _without_dp(at))
    # ZeRO-2 differs from ZeRO-1 only in dropping the whole gradients once reduced (DistributedAdam._launch):
    # the same recording (test_plan checks it), made once
    opt = _optimizer_schedule(_role_config(config, pp, stage, rpp, rstage), mode, odp, rpp, sp,
                              tuple((a, i) for a, i in oat if a != "pp") + (("pp", rstage),), dtype, bsize, coarsening,
                              clip, 1 if zero == 2 else zero, offload, overlap, experts, recipe)
    micro = dataclasses.replace(micro, collectives=micro.collectives + opt["gathers"])
    return StepSchedule(micro, microbatches, tuple(grid.log) + opt["step"], opt["parameters"], opt["tensors"],
                        layer, config.layers // pp, opt["state"], opt["gathered"], opt["in_backward"])


@lru_cache(maxsize=1024)
def _optimizer_schedule(config, mode, dp, pp, sp, at, dtype, bsize, coarsening, clip, zero, offload,
                        overlap=False, experts=None, recipe=None) -> dict:
    """The optimizer's part of a step, recorded from its own code over the stage's parameters as
    its modules place them (the same for every micro-batch count): its step collectives (gradient
    all-reduces or reduce-scatters, the clipping norm, the all-gathers), ZeRO-3's gathers of one
    micro-batch, the parameters, the state elements of each kind (-1: unsharded) and ZeRO-3's
    most elements gathered at once."""
    with MetaMemo():
        return _record_optimizer(config, mode, dp, pp, sp, at, dtype, bsize, coarsening, clip, zero, offload, overlap,
                                 experts, recipe)


def _record_optimizer(config, mode, dp, pp, sp, at, dtype, bsize, coarsening, clip, zero, offload, overlap,
                      experts=None, recipe=None) -> dict:
    k = config.layers // pp
    if k > 3 and uses_distributed(zero, offload) and _layers_cut_alike(config, mode, dp, pp, sp, at, dtype, zero,
                                                                       experts):
        two, three = (_record_optimizer(dataclasses.replace(config, layers=j * pp), mode, dp, pp, sp, at, dtype, bsize,
                                        coarsening, clip, zero, offload, overlap, experts, recipe) for j in (2, 3))
        out = _repeated(two, three, k)
        if out is not None:
            return out
    grid = RecordingGrid(_grid_axes(dp, pp, sp, mode), mode, dict(at))
    stage = _stand_in(config, mode, pp, sp, _without_dp(at), dtype, _stage_dp(config, dp), experts, recipe)
    params_of = list(stage.parameters())
    out = {"parameters": sum(p.numel() for p in params_of), "tensors": len(params_of), "state": -1,
           "gathers": (), "gathered": 0, "in_backward": ()}
    if uses_distributed(zero, offload):  # the distributed optimizer's own calls, in its order
        opt = DistributedAdam(params_of, grid, zero=zero, decay=matrices_only, overlap=False,
                              units=stage.shard_units() if zero == 3 else None,
                              float8_params=(getattr(stage, "float8_params", None) or float8.gathered_weights(stage))
                              if zero == 3 else ())
        if opt.units is not None:
            grid.log = []  # made once (the float8 gathers' first scales): the step's own are below
            out["gathered"] = opt.units.rehearse()
            out["gathers"], grid.log = tuple(grid.log), []
        shards = opt.reduce_gradients()
        if clip:
            grad_norm_of(opt.norm_pieces(shards), grid)
        if opt.units is None:
            opt.gather_parameters()
        else:
            opt.units.rescale()  # the float8 gathers' scales for the next step (DistributedAdam.step's)
        out["state"] = opt.master.numel()
    else:
        size = params_of[0].element_size()
        for lo, hi, axes in gradient_chunks(params_of, grid, bsize, coarsening, backward=overlap)[2]:
            if axes:
                n = float((hi - lo) * size)
                grid.log.append(Collective("all_reduce", grid.label(grid.reduce_line(axes)), n, n, 0, size))
        if overlap:  # OffloadAdam(overlap=True): started by the backward's hooks, before the step's own
            out["in_backward"], grid.log = tuple(grid.log), []
        if clip:
            grad_norm_of([(p, placement_of(p)) for p in params_of], grid)
    out["step"] = tuple(grid.log)
    return out


def _layers_cut_alike(config, mode, dp, pp, sp, at, dtype, zero, experts=None) -> bool:
    """Whether DistributedAdam's buckets over a stage's layers repeat layer by layer: for each set
    of reduction axes, its open bucket holds as much where the second layer ends as where the
    first does (optim.bucket_starts over two layers' parameters, in backward order, the first to
    come). The packing is greedy, so from equal states alike layers are packed alike, and by
    induction every further layer adds the same buckets; the embedding and head are then met in
    the same state whatever the layer count. At ZeRO-3 a bucket never spans two units, and each
    layer is one."""
    if zero == 3:
        return True
    if config.dense_layers:  # two kinds of layer: the stage is recorded whole
        return False
    grid = RecordingGrid(_grid_axes(dp, pp, sp, mode), mode, dict(at))
    layer = _one_layer_stage(config, mode, pp, sp, _without_dp(at), dtype, _stage_dp(config, dp), experts).layers[0]
    by_axes: dict = {}
    for p in reversed([p for p in layer.parameters() if p.requires_grad]):
        by_axes.setdefault(placement_of(p).reduce_axes(grid), []).append(p.numel())

    def open_at(sizes, starts, t):  # elements in the bucket open after the first t parameters
        return sum(sizes[max(a for a in starts if a < t):t])
    for sizes in by_axes.values():
        two = sizes * 2
        starts = bucket_starts(two, optim.BUCKET)
        if open_at(two, starts, len(sizes)) != open_at(two, starts, len(two)):
            return False
    return True


def _repeated(two: dict, three: dict, k: int) -> dict | None:
    """The optimizer's recording of a stage of k layers from its recordings with two and three
    (_layers_cut_alike): from the second layer on each layer adds the same buckets (the first
    starts from an empty bucket, the last meets the head), so every bucket's collectives, the
    state and the parameters grow by what the third layer added, k - 3 times; the norm's
    collectives are three layers' (this rank's shard of each repeated bucket holds the same kinds
    of parameters); ZeRO-3's most elements gathered at once too (the units
    held together are of the same kinds from two layers on: a unit and the next, prefetched).
    Collectives as a multiset (the planner costs their tally). None where three layers' do not
    hold two layers' (then the whole stage is recorded)."""
    out = dict(three)
    for key in ("step", "gathers"):
        added = _difference(two[key], three[key])
        if len(added) != len(three[key]) - len(two[key]):
            return None
        out[key] = tuple(three[key]) + tuple(added) * (k - 3)
    for key in ("parameters", "tensors"):
        out[key] = three[key] + (three[key] - two[key]) * (k - 3)
    out["state"] = three["state"] + (three["state"] - two["state"]) * (k - 3) if three["state"] >= 0 else -1
    return out


def _recorded_at(mode, axes, at) -> dict:
    """The coordinates a recording runs at: `at`, moved onto the members that hold data where
    the mode's layout keeps it on some (cSub: sub-grid 0). The others learn the shapes from
    them (Grid.broadcast_ints) and issue the same ops; their messages are still their own
    (plan.step_counters)."""
    coords = dict(at)
    only = mode.base_layout(AxesView(dict(axes))).only
    if only is not None:
        coords[only[0]] = only[1]
    return coords


def _dense(config, layers, dtype):
    """The dense model on meta with `layers` layers, one module a kind of layer (the dense-MLP
    layers config.dense_layers names, the others), each repeated where its kind is (a stage
    converts only its own)."""
    def one(cfg):
        return build(dataclasses.replace(cfg, layers=1, tie=config.tie and layers == config.layers), dtype=dtype,
                     device="meta")

    model = one(_uniform(config, False))
    kinds = {False: model.layers[0]}
    if config.dense_layers:
        kinds[True] = one(_uniform(config, True)).layers[0]
    model.layers = torch.nn.ModuleList([kinds[i in config.dense_layers] for i in range(layers)])
    return model


def _uniform(config, dense: bool):
    """`config` with every layer of one kind: the dense MLP's of dense_layers (DeepSeek-V3's first
    layers), or the mixture of experts' of the others."""
    if not config.dense_layers:
        return config
    return dataclasses.replace(config, dense_layers=(), **({"moe": None} if dense else {}))


def _dense_in_stage(config, pp: int, stage: int) -> int:
    """How many of pipeline stage `stage`'s layers (a contiguous block of layers // pp) are dense."""
    per = config.layers // pp
    return sum(1 for i in config.dense_layers if stage * per <= i < (stage + 1) * per)


def _role_config(config, pp: int, stage: int, rpp: int, rstage: int):
    """The model of stage_role's smaller pipeline (rpp stages of this stage's layers), its stage
    rstage holding the dense layers stage `stage` of pp holds, in their places."""
    per = config.layers // pp
    dense = tuple(rstage * per + j for j in range(per) if stage * per + j in config.dense_layers)
    return dataclasses.replace(config, layers=per * rpp, dense_layers=dense)


def _stage(config, mode, dp, pp, sp, at, dtype, experts=None):
    """The stage (meta) without running it: its modules place its parameters."""
    grid = RecordingGrid(_grid_axes(dp, pp, sp, mode), mode, dict(at))
    return GPTStage(_dense(config, config.layers, dtype), grid, mode, grid.coords["pp"], pp,
                    **_moe_options(config, grid, experts))


def _without_dp(at) -> tuple:
    """Coordinates without the dp one: a stage's parameters and an unsharded optimizer are the same
    on every data-parallel replica."""
    return tuple((a, i) for a, i in at if a != "dp")


@lru_cache(maxsize=256)
def _one_layer_stage(config, mode, pp, sp, at, dtype, dp=1, experts=None):
    """_stage with one layer a stage (dp 1: a dense stage's parameters do not depend on dp, only
    on the mode, sp and its role; a mixture of experts' do, through its expert line); the
    model's tied embedding kept as the whole model ties it."""
    return _stage(dataclasses.replace(config, layers=pp), mode, dp, pp, sp, at, dtype, experts)


class _Copies(torch.nn.Module):
    """A module's parameters as new meta tensors (shape, dtype, requires_grad and placement
    alike), in its order; `seen` maps the parameters already copied (a tied weight stays one)."""

    def __init__(self, module, seen: dict):
        super().__init__()
        for i, p in enumerate(module.parameters()):
            if id(p) not in seen:
                seen[id(p)] = q = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                q.__dict__.update(p.__dict__)
            self.register_parameter(f"p{i}", seen[id(p)])
        self.of = {id(p): seen[id(p)] for p in module.parameters()}  # each original's copy


def _stand_in(config, mode, pp, sp, at, dtype, dp=1, experts=None, recipe=None):
    """What the optimizer sees of a stage of config.layers // pp layers: its parameters in
    stage.parameters()' order (embedding, head, then layer by layer) and its ZeRO-3 units
    (shard_units: embedding, each layer, head), each a copy of a one-layer stage's modules, the
    layer's repeated. Exact: the stage's layers are one dense layer converted alike
    (_dense), so they hold equal parameters; the optimizer reads only the parameters, their
    order and the units (tests/python/test_plan.py compares the recordings with the full
    stage's). Building a 1T model's 128-layer stage took most of its planning time. recipe: its
    linears in float8 (float8_params: the copies of the weights ZeRO-3 gathers in float8)."""
    one = _one_layer_stage(_uniform(config, False), mode, pp, sp, at, dtype, dp, experts)
    kinds = {False: one}
    if config.dense_layers:  # DeepSeek-V3's dense first layers: copies of a dense-MLP layer's
        kinds[True] = _one_layer_stage(_uniform(config, True), mode, pp, sp, at, dtype, dp, experts)
    gathered = []
    for stage in kinds.values():
        float8.convert(stage, recipe)
        gathered += [id(w) for w in float8.gathered_weights(stage)]
    seen: dict = {}
    stand = torch.nn.Module()
    stand.embed = _Copies(one.embed, seen) if one.embed is not None else None
    stand.head = _Copies(one.head, seen) if one.head is not None else None
    per, first = config.layers // pp, dict(at).get("pp", 0) * (config.layers // pp)
    stand.layers = torch.nn.ModuleList(_Copies(kinds[first + j in config.dense_layers].layers[0], {})
                                       for j in range(per))
    stand.shard_units = lambda: [m for m in (stand.embed, *stand.layers, stand.head) if m is not None]
    stand.float8_params = [c.of[i] for c in stand.shard_units() for i in gathered if i in c.of]
    return stand


@lru_cache(maxsize=16)
def optimizer_census(bsize: int, coarsening: int, clip: bool, decay: bool, staged: bool = False) -> dict:
    """gw.optim.OffloadAdam.step's own work, recorded on small CPU tensors: kernels a step, a
    parameter tensor and a bucket, and the bytes its kernels read and write per element (the
    flat gradient, the clipping norm, the Adam update through the bucket buffers, the write-back).
    staged: the path a GPU runs (the state in host memory, updated through device buckets: each
    bucket's copies and update its own kernels); else the CPU's one pass over the flat buffers."""
    def run(sizes):
        grid = RecordingGrid(_grid_axes(1, 1, 1, None), None, device="cpu")  # the optimizer reads its norm
        params = [torch.nn.Parameter(torch.zeros(n, 1, device="cpu")) for n in sizes]
        opt = OffloadAdam(params, grid=grid, bsize=bsize, coarsening=coarsening, max_grad_norm=1.0 if clip else None,
                          decay=matrices_only if decay else None, staged=staged)
        for p in params:
            p.grad = torch.zeros_like(p)
        with Census() as census:
            opt.step()
        return census.kernels + census.calls, census.bytes

    k1, b1 = run([bsize])             # one tensor, one bucket
    k2, _ = run([bsize, bsize])       # two tensors, two buckets
    k3, b3 = run([2 * bsize])         # one tensor, two buckets
    bucket = k3 - k1
    return {"per_tensor": k2 - k3, "per_bucket": bucket, "fixed": k1 - bucket - (k2 - k3),
            "bytes_per_element": (b3 - b1) / bsize}
