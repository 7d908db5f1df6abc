"""The process grid on torch tensors: gw.init, gw.shutdown and Grid's collectives.

Collectives along an axis (or a tuple of axes) are *segmented*: every line of ranks
along that axis runs the collective at once on its own communicator (SUPER §IV-B).
"""
from __future__ import annotations

import atexit
import enum
import itertools
import json
import math
import os
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch

from . import _C, launch
from ._buffers import empty_like_shape, host_args, reduce_code, view
from .axes import ParallelDims
from .ring import Ring
from .errors import CommError, CommTimeout, GridError
from .launch import _env_int

AxisArg = "str | Sequence[str] | LinePart | None"


class Span(enum.Enum):
    """Which members of a line a LinePart keeps."""
    WITHIN = "within"  # those of this rank's block
    ACROSS = "across"  # those at this rank's position in every block


@dataclass(frozen=True)
class LinePart:
    """Half of a line: the line over `axes` cut into blocks of `block` consecutive members (0: a
    node's members, each block on one node: hybrid sharding's shard group, torchtitan's HSDP);
    WITHIN is this rank's block, ACROSS the members at its position in every block (USP's inner
    Ulysses group and outer ring). An axis argument of every collective."""
    axes: tuple
    span: Span
    block: int = 0

    def complement(self) -> "LinePart":
        """The other half of the same line: ACROSS for WITHIN and back (every member of the line
        is one block position of one block)."""
        return LinePart(self.axes, Span.ACROSS if self.span is Span.WITHIN else Span.WITHIN, self.block)

    @property
    def label(self) -> str:
        """Its traffic's name after the line's: node / across (a node's blocks), within<B> / across<B>."""
        if not self.block:
            return "node" if self.span is Span.WITHIN else "across"
        return f"{self.span.value}{self.block}"


@dataclass(frozen=True)
class Control:
    """A host control channel over a line (Grid.control), as an item of Grid.connect."""
    axes: tuple


@dataclass(frozen=True)
class Link:
    """A two-member link between members a and b of a line (Grid.link), as an item of Grid.connect."""
    axes: tuple
    a: int
    b: int
    channel: int


def _encode(item) -> list:
    """A connect item as JSON (every rank's are merged, then sorted by this)."""
    item = one_part(item)
    if isinstance(item, Link):
        return ["link", list(item.axes), item.a, item.b, item.channel]
    if isinstance(item, Control):
        return ["control", list(item.axes)]
    if isinstance(item, LinePart):
        return ["part", list(item.axes), item.span.value, item.block]
    return ["line", [] if item is None else [item] if isinstance(item, str) else list(item)]


def _decode(code: list):
    kind, axes = code[0], tuple(code[1])
    if kind == "link":
        return Link(axes, *code[2:])
    if kind == "control":
        return Control(axes)
    if kind == "part":
        return LinePart(axes, Span(code[2]), code[3])
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _order(code: list) -> tuple:
    """One global order of creation: lines, line parts, control channels, then links by their
    pair's lower member (so a chain of links is made from one end)."""
    kinds = ("line", "part", "control", "link")
    if code[0] == "link":
        a, b = code[2], code[3]
        return (3, code[1], min(a, b), max(a, b), a, code[4])
    return (kinds.index(code[0]), len(code[1]), code[1], *code[2:])


CheckLevel = _C.CheckLevel
DEBUG_ENV = "GRIDWEAVE_DEBUG"
EMULATE_ENV = "GRIDWEAVE_EMULATE"
# NCCL_BUFFSIZE's part in the emulation: sends up to this many bytes complete without their receive
EAGER_ENV = "GRIDWEAVE_EMULATE_EAGER_BYTES"
EMULATIONS = {None: _C.Emulation.Off, "nccl": _C.Emulation.Nccl}


def check_level() -> CheckLevel:
    """The check level GRIDWEAVE_DEBUG asks for: DETAIL, or the cheap checks (unset, OFF, INFO)."""
    value = os.environ.get(DEBUG_ENV, "").strip().upper()
    if value not in ("", "OFF", "INFO", "DETAIL"):
        raise GridError(f"{DEBUG_ENV} must be OFF, INFO or DETAIL, got {value!r}")
    return CheckLevel.Detail if value == "DETAIL" else CheckLevel.Cheap


class _TorchStore(_C.Store):
    """Adapter: torch's TCPStore (or any torch.distributed.Store) as the engine's Store, every
    operation bounded: torch's TCPStore client waits without end for a server that stopped
    answering (a network partition: no reset ever comes), so each call runs on a daemon thread
    and is given up, as a CommTimeout, SLACK_S after its own timeout (set: the grid's)."""

    SLACK_S = 1.0

    def __init__(self, store, timeout_s: float):
        super().__init__()
        self._store = store
        self._timeout_s = float(timeout_s)
        self._lost = None  # why the store stopped answering: later calls fail at once (its client is stuck)

    def _bounded(self, what: str, fn, timeout_s: float):
        if self._lost is not None:
            raise CommTimeout(self._lost)
        box = {}

        def call():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e

        t = threading.Thread(target=call, name="gridweave-store", daemon=True)
        t.start()
        t.join(timeout_s + self.SLACK_S)
        if t.is_alive():  # left blocked: a daemon thread does not keep the process alive
            self._lost = (f"gridweave: the rendezvous store did not answer {what} within {timeout_s:.0f} s: the "
                          "master node is unreachable (a network partition) or gone")
            raise CommTimeout(self._lost)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def set(self, key, value):
        self.set_within(key, value, self._timeout_s)

    def set_within(self, key, value, timeout_s):
        self._bounded(f"set({key!r})", lambda: self._store.set(key, value), min(timeout_s, self._timeout_s))

    def get(self, key, timeout_s):
        def fn():
            self._store.wait([key], timedelta(seconds=timeout_s))
            return self._store.get(key)
        return self._bounded(f"get({key!r})", fn, timeout_s)

    def wait(self, keys, timeout_s):
        keys = list(keys)
        self._bounded(f"wait({keys[:3]!r})", lambda: self._store.wait(keys, timedelta(seconds=timeout_s)), timeout_s)


def emulation(value=None):
    """The rules a grid's data transport keeps (gw.init's emulate=, else GRIDWEAVE_EMULATE):
    None, or "nccl": NCCL's rules on the CPU transport (cpp/emulate_nccl.h)."""
    if value is None:
        value = os.environ.get(EMULATE_ENV, "").strip().lower() or None
    if value not in EMULATIONS:
        raise GridError(f"emulate must be None or 'nccl' (also {EMULATE_ENV}), got {value!r}")
    return value


def eager_bytes() -> int:
    raw = os.environ.get(EAGER_ENV, "0").strip() or "0"
    if not raw.isdigit():
        raise GridError(f"{EAGER_ENV} must be a number of bytes, got {raw!r}")
    return int(raw)


class _Names:
    """Grids by name (Grid.name), for what may only pass strings: torch custom ops, which
    name their grid as torch's functional collectives name their process group."""

    live = weakref.WeakValueDictionary()
    counter = itertools.count()


def by_name(name: str) -> "Grid":
    """The live grid called `name` in this process."""
    try:
        return _Names.live[name]
    except KeyError:
        raise GridError(f"no live grid named {name!r} in this process (was it shut down?)") from None


def order_free(names, axis):
    """`axis` for an op whose result does not depend on member order (all-reduce, barrier): a
    tuple of axes in the grid's order (`names`), so (dp, sp) and (sp, dp) are one communicator."""
    if isinstance(axis, (tuple, list)) and len(axis) > 1:
        return tuple(sorted(axis, key=lambda a: names.index(a) if a in names else len(names)))
    return axis


def axis_label(axis) -> str:
    """An axis argument as the string custom ops carry: "" for the world, "x,y" for a tuple."""
    return "" if axis is None else axis if isinstance(axis, str) else ",".join(axis)


def axis_of(label: str):
    """The axis argument of a label (axis_label's inverse)."""
    return None if label == "" else tuple(label.split(",")) if "," in label else label


class P2POp:
    """One send or receive of a batch (torch.distributed.P2POp): op "isend" or "irecv",
    `tensor`, `peer` (an index along `axis`; a global rank when axis is None), and a tag
    (NCCL ignores tags: under its rules the ops of a pair are matched in issue order)."""

    KINDS = {"isend": _C.OpKind.Send, "irecv": _C.OpKind.Recv}

    def __init__(self, op: str, tensor, peer: int, axis: AxisArg = None, tag: int = 0):
        if op not in self.KINDS:
            raise GridError(f"P2POp op must be 'isend' or 'irecv', got {op!r}")
        if not isinstance(tensor, torch.Tensor):
            raise GridError(f"P2POp needs a torch tensor, got {type(tensor).__name__}")
        self.op, self.tensor, self.peer, self.axis, self.tag = op, tensor, int(peer), axis, int(tag)

    def __repr__(self):
        return f"P2POp({self.op!r}, {tuple(self.tensor.shape)}, peer={self.peer}, axis={self.axis!r})"


class Work:
    """Handle of an async op. wait() returns the op's result (the output tensor)."""

    def __init__(self, native, timeout, keep, finish=None):
        self._native = native
        self._timeout = timeout
        self._keep = keep  # tensors that must outlive the op
        self._finish = finish
        self._result = None
        self._done = False

    def test(self) -> bool:
        return self._native.test()

    def wait(self, timeout: float | None = None):
        """The op's result; on a stream-ordered transport (NCCL) the current stream waits for the op
        and the host does not (torch's Work.wait)."""
        if not self._done:
            limit = self._timeout if timeout is None else float(timeout)
            if getattr(self._native, "stream", 0):
                self._native.wait(limit, stream=torch.cuda.current_stream().cuda_stream)
            else:
                self._native.wait(limit)
            self._result = self._finish() if self._finish else None
            self._done = True
            self._keep = None
        return self._result

    @property
    def source(self) -> int:
        """Sender of a recv / recv_any, as an index in the op's communicator."""
        return self._native.source


class _Together:
    """Works waited as one (an uneven all-to-all's sends and receives): wait() returns `result`."""

    def __init__(self, works: list, result):
        self._works, self._result = works, result

    def test(self) -> bool:
        return all(w.test() for w in self._works)

    def wait(self, timeout: float | None = None):
        for w in self._works:
            w.wait(timeout)
        return self._result


def _then(work: Work, back) -> Work:
    """A Work that waits for `work` (a Work is itself a native-like handle: wait, test,
    source) and returns back(its result): results of ops run on host copies go home."""
    return Work(work, work._timeout, None, lambda: back(work.wait()))


def _to_host(t):
    if t is None:
        return None
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t.detach())  # ordered after the producer on the current stream, then synchronised
    return host


class LineArithmetic:
    """What an axis argument means on a grid, one implementation for gw.Grid and the planner's
    recording grid: the axes it names (checked), its size, this rank's index in its line, the line
    an order-free op runs it as, a line part's members. A grid provides `axes` (name -> size, in
    the grid's order), `world_size`, _index_in(axes) (this rank's index in the line over `axes`:
    row-major, first slowest) and, where its parts need more than blocks of consecutive members
    (a node's), _members(part)."""

    def _axis_tuple(self, axis) -> list[str]:
        if axis is None:
            return []
        names = [axis] if isinstance(axis, str) else list(axis)
        if not names:
            raise GridError("axis tuple is empty; pass None for the whole world")
        for a in names:
            if a not in self.axes:
                raise GridError(f"unknown axis {a!r}; this grid has axes {list(self.axes)}")
        if len(set(names)) != len(names):
            raise GridError(f"axis tuple {tuple(names)} repeats an axis")
        return names

    def _members(self, part: LinePart) -> list:
        """The member indices of the line part's line it keeps (blocks of part.block members)."""
        axes = self._axis_tuple(part.axes)
        n, q = math.prod(self.axes[a] for a in axes), part.block
        if not q or n % q:
            raise GridError(f"blocks of {q} members do not divide the line over {tuple(axes)} of {n}")
        return part_members(n, self._index_in(axes), part.span, q)

    def size(self, axis: AxisArg = None) -> int:
        """Number of ranks along an axis or a tuple of axes (the world for None)."""
        axis = one_part(axis)
        if isinstance(axis, LinePart):
            return len(self._members(axis))
        return math.prod(self.axes[a] for a in self._axis_tuple(axis)) if axis is not None else self.world_size

    def index(self, axis: AxisArg) -> int:
        """This rank's index along an axis or a tuple of axes (row-major, first slowest)."""
        axis = one_part(axis)
        if isinstance(axis, LinePart):
            return self._members(axis).index(self._index_in(self._axis_tuple(axis.axes)))
        return self._index_in(self._axis_tuple(axis))

    def reduce_line(self, axis: AxisArg):
        """The axis argument all_reduce and barrier run `axis` as: a tuple in the grid's order (the
        members' order does not change their result), so (dp, sp) and (sp, dp) are one communicator."""
        return order_free(list(self.axes), axis)


def flight_run(session: str) -> str:
    """What names this job (and its restart) alike on all its ranks, for the flight recorder's
    dumps: the launcher's run id (gridweave's spawn, torchrun's agent) or the rendezvous prefix,
    and torchrun's restart count; "" where the launcher gives none."""
    job = os.environ.get("GRIDWEAVE_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or session
    return f"{job}#{launch.restart_count()}" if job else ""


class Grid(LineArithmetic):
    """Named axes over the world's ranks. Use gw.init() to make one."""

    def __init__(self, dims: ParallelDims, *, rank, backend, placement, ranks_per_node, timeout, store, hostname,
                 device_index=-1, device=None, session="", check=None, emulate=None, flight_dir=""):
        axes = dims.axes()
        self.dims = dims  # the validated degrees
        self.axes = dict(axes)
        self.backend = backend
        # every tensor the library makes for this grid is made here
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", device_index) if device_index >= 0 else torch.device("cpu"))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.timeout = float(timeout)
        self.placement_policy = placement
        self._store = store  # the Python side of the native Store must stay alive
        self.check = check if check is not None else CheckLevel.Cheap
        self.emulate = emulation(emulate)
        self._native = _C.Grid(list(axes), placement, int(ranks_per_node), int(rank), backend, self.timeout,
                               hostname, int(device_index), store, session, self.check, EMULATIONS[self.emulate],
                               eager_bytes(), flight_dir=flight_dir, flight_run=flight_run(session))
        self.placement = self._native.placement
        self._names = [a for a, _ in axes]
        self._comms = {}  # axis argument -> native communicator: one lookup per op, not a native call
        self._parts = {}  # LinePart -> (axes, line, members)
        self.name = f"grid{next(_Names.counter)}"  # what custom ops call it (gw.grid.by_name)
        _Names.live[self.name] = self
        if self._native.nccl_rules:
            # NCCL's communicator creation blocks until the line's members come: made now, in one
            # order on every rank (the world, then each axis), two ranks cannot first touch two
            # shared lines in opposite orders. A job's other lines (tuples, line parts, links) are
            # made before its first step by Grid.connect, in one global order.
            self._native.connect([[]] + [[a] for a, s in axes if s > 1])

    # ---- geometry -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def world_size(self) -> int:
        return self._native.world_size

    @property
    def ranks_per_node(self) -> int:
        return self.placement.ranks_per_node

    @property
    def coords(self) -> dict:
        return dict(zip(self._names, self._native.coords))

    def _part(self, part: LinePart) -> tuple:
        """(the line's axes, its global ranks, the member indices of `part`), checked: the line's
        members split into equal blocks of consecutive members (a node's: each block on one node)."""
        got = self._parts.get(part)
        if got is not None:
            return got
        axes = self._axis_tuple(part.axes)
        line = self.placement.line(self.rank, axes)
        me = self.placement.index_in_line(self.rank, axes)
        if part.block:
            q = part.block
            if q < 1 or len(line) % q:
                raise GridError(f"blocks of {q} members do not divide the line over {tuple(axes)} of {len(line)}")
        else:
            nodes = [self.node_of(r) for r in line]
            q = nodes.count(nodes[0])  # member 0's node decides: the same on every member of the line
            blocks = [nodes[k:k + q] for k in range(0, len(line), q)]
            if len(line) % q or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
                raise GridError(f"the line over {tuple(axes)} ({len(line)} ranks on nodes {nodes}) does not split "
                                "into equal blocks of consecutive members, one block a node: a shard group of a "
                                f"node's ranks does not divide it (ranks_per_node {self.ranks_per_node})")
        members = part_members(len(line), me, part.span, q)
        self._parts[part] = got = (axes, line, members)
        return got

    def _members(self, part: LinePart) -> list:
        return self._part(part)[2]

    def _index_in(self, axes: list) -> int:
        return self.placement.index_in_line(self.rank, axes)

    def ranks(self, axis: AxisArg) -> list[int]:
        """Global ranks of this rank's line along `axis`, in index order."""
        axis = one_part(axis)
        if isinstance(axis, LinePart):
            _, line, members = self._part(axis)
            return [line[m] for m in members]
        return self.placement.line(self.rank, self._axis_tuple(axis))

    def node_of(self, rank: int) -> int:
        return self.placement.node_of(rank)

    def comm(self, axis: AxisArg = None, op: str = "op"):
        """This rank's native communicator along `axis` (None: the world, by global rank).
        The first call on an axis connects its members: all of them must make it."""
        axis = one_part(axis)
        try:
            return self._comms[axis]
        except (KeyError, TypeError):  # not made yet, or an unhashable axis list
            pass
        if isinstance(axis, LinePart):
            names, _, members = self._part(axis)
            try:
                self._comms[axis] = c = self._native.subset(names, members, axis.label)
            except CommError as e:
                raise type(e)(f"{op} on axis '{','.join(names)}:{axis.label}': {e}") from e
            return c
        names = self._axis_tuple(axis)
        try:
            c = self._native.comm(names)
        except CommError as e:
            label = ",".join(names) or "world"
            raise type(e)(f"{op} on axis '{label}': {e}") from e
        if isinstance(axis, (str, tuple)) or axis is None:
            self._comms[axis] = c
        return c

    def control(self, axis: AxisArg, op: str = "op"):
        """A host communicator over this rank's line along `axis` (the backend's own if it
        carries host memory, else Gloo): the control channel for what the data transport
        cannot do (e.g. receive-from-any)."""
        names = self._axis_tuple(axis)
        try:
            return self._native.control(names)
        except CommError as e:
            raise type(e)(f"{op} on axis '{','.join(names) or 'world'}' (control): {e}") from e

    # ---- collectives ----------------------------------------------------------------
    def _on_host(self, native_op, a, b=None, *extra) -> bool:
        """A synchronous op in one native call (native_op: a Communicator's *_host method) when
        its tensors a (and b) are contiguous CPU tensors of one dtype; False (nothing done)
        otherwise."""
        args = host_args(a, b)
        if args is None:
            return False
        native_op(*args, *extra, self.timeout)
        return True

    def _run(self, native, async_op, keep, finish=None):
        if keep and native.stream:
            _record_stream(keep, native.stream)
        if async_op:
            return Work(native, self.timeout, keep, finish)
        native.wait(self.timeout)  # a synchronous op needs no handle: its tensors are the caller's
        return finish() if finish else None

    @staticmethod
    def _staged(c, *tensors) -> bool:
        """CUDA tensors on a transport whose buffers must be host memory (Gloo, an MPI that
        is not CUDA-aware): the op runs on pinned host copies and the results are copied back
        (several ranks can then share one GPU, which NCCL refuses). On a transport that reads
        CUDA memory outside stream order (a CUDA-aware MPI) the stream is synchronised first."""
        for t in tensors:  # a loop, not any(genexpr): this runs on every op
            if isinstance(t, torch.Tensor) and t.is_cuda:
                break
        else:
            return False
        if c.device == _C.Device.CPU:
            return True
        if not c.stream_ordered:
            torch.cuda.current_stream().synchronize()
        return False

    def _via_host(self, name, t, /, *args, into=None, async_op=False, **kw):
        """Run the op `name` on a host copy of t; into: the device tensor the result is copied
        into (in-place ops), else the result is moved to t's device. Positional-only, so an
        op's own `op=` (the reduction) passes through **kw."""
        device = t.device
        res = getattr(self, name)(_to_host(t), *args, async_op=True, **kw)

        def back(r):
            if into is not None:
                return into.copy_(r)
            return r.to(device) if isinstance(r, torch.Tensor) else r

        work = _then(res, back)
        return work if async_op else work.wait()

    def all_gather(self, t, axis: AxisArg, dim: int = 0, async_op: bool = False, out=None):
        """Concatenate every member's `t` along `dim`, in index order along `axis`.
        `out` (dim 0 only) receives the result in place of a new tensor."""
        c = self.comm(axis, "all_gather")
        if out is not None and not async_op and dim == 0:  # the hot path: nothing made, one native call
            args = host_args(t, out)
            if args is not None and out.shape == _gathered(t, c.size):
                c.all_gather_host(*args, self.timeout)
                return out
        if self._staged(c, t, out):
            if out is not None:
                r = self._via_host("all_gather", t, axis, dim=dim, async_op=async_op)
                return _then(r, lambda v: out.copy_(v)) if async_op else out.copy_(r)
            return self._via_host("all_gather", t, axis, dim=dim, async_op=async_op)
        g = c.size
        dim = _dim(t, dim)
        src = _contig(t)
        if out is not None:
            _check_out(out, t, _gathered(t, g), dim, "all_gather")
            buf = out
        else:
            buf = empty_like_shape(t, (g,) + tuple(t.shape))

        def finish():
            return out if out is not None else _merge_leading(buf, dim)

        if not async_op and self._on_host(c.all_gather_host, src, buf):
            return finish()
        return self._run(c.all_gather(view(src, "all_gather input"), view(buf, "all_gather output"), async_op), async_op,
                         (src, buf), finish)

    def reduce_scatter(self, t, axis: AxisArg, op: str = "sum", dim: int = 0, async_op: bool = False, out=None):
        """Reduce `t` over the members and keep chunk `index(axis)` of `dim`.
        `out` (dim 0 only) receives the result in place of a new tensor."""
        c = self.comm(axis, "reduce_scatter")
        if out is not None and not async_op and dim == 0:  # the hot path (the engine checks the counts)
            args = host_args(t, out)
            if args is not None and out.shape[1:] == t.shape[1:]:
                c.reduce_scatter_host(*args, reduce_code(op), self.timeout)
                return out
        if self._staged(c, t, out):
            if out is not None:
                r = self._via_host("reduce_scatter", t, axis, op=op, dim=dim, async_op=async_op)
                return _then(r, lambda v: out.copy_(v)) if async_op else out.copy_(r)
            return self._via_host("reduce_scatter", t, axis, op=op, dim=dim, async_op=async_op)
        g = c.size
        dim = _dim(t, dim)
        if t.shape[dim] % g:
            raise GridError(f"reduce_scatter on axis {axis!r}: dim {dim} of size {t.shape[dim]} "
                            f"does not split into {g} equal chunks")
        src = _contig(_movedim(t, dim, 0))
        shape = (src.shape[0] // g,) + tuple(src.shape[1:])
        if out is not None:
            _check_out(out, t, shape, dim, "reduce_scatter")
            buf = out
        else:
            buf = empty_like_shape(t, shape)
        code = reduce_code(op)

        def finish():
            return _movedim(buf, 0, dim)

        if not async_op and self._on_host(c.reduce_scatter_host, src, buf, code):
            return finish()
        return self._run(c.reduce_scatter(view(src, "reduce_scatter input"), view(buf, "reduce_scatter output"),
                                          code, async_op), async_op, (src, buf), finish)

    def all_reduce(self, t, axis: AxisArg, op: str = "sum", async_op: bool = False):
        """In place: every member's `t` becomes the reduction over the members."""
        c = self.comm(self.reduce_line(axis), "all_reduce")
        code = reduce_code(op)
        args = None if async_op else host_args(t)
        if args is not None:  # the hot path: one native call
            c.all_reduce_host(*args, code, self.timeout)
            return t
        if self._staged(c, t):
            return self._via_host("all_reduce", t, axis, op=op, into=t, async_op=async_op)
        return self._run(c.all_reduce(view(t, "all_reduce buffer"), code, async_op), async_op, (t,), lambda: t)

    def broadcast(self, t, axis: AxisArg, src: int = 0, async_op: bool = False):
        """In place: `t` of member `src` (index along axis) is copied to every member."""
        c = self.comm(axis, "broadcast")
        args = None if async_op else host_args(t)
        if args is not None:  # the hot path: one native call
            c.broadcast_host(*args, int(src), self.timeout)
            return t
        if self._staged(c, t):
            return self._via_host("broadcast", t, axis, src=src, into=t, async_op=async_op)
        return self._run(c.broadcast(view(t, "broadcast buffer"), int(src), async_op), async_op, (t,), lambda: t)

    def reduce(self, t, axis: AxisArg, dst: int = 0, op: str = "sum", async_op: bool = False):
        """In place on member `dst`: the reduction over the members; other members' t is unchanged."""
        c = self.comm(axis, "reduce")
        if self._staged(c, t):
            return self._via_host("reduce", t, axis, dst=dst, op=op, into=t, async_op=async_op)
        code = reduce_code(op)
        return self._run(c.reduce(view(t, "reduce buffer"), code, int(dst), async_op), async_op, (t,), lambda: t)

    def scatter(self, out, full=None, axis: AxisArg = None, src: int = 0, async_op: bool = False):
        """Member `src` cuts `full` into size(axis) chunks along dim 0; member k receives chunk k in `out`."""
        c = self.comm(axis, "scatter")
        if self._staged(c, out, full):
            work = self.scatter(_to_host(out), _to_host(full), axis, src, async_op=True)
            staged = _then(work, lambda r: out.copy_(r))
            return staged if async_op else staged.wait()
        if c.rank == src:
            if full is None:
                raise GridError("scatter: the source member must pass `full`")
            full = _contig(full)
            fview = view(full, "scatter input")
        else:
            fview = view(out)  # ignored off the root
        return self._run(c.scatter(fview, view(out, "scatter output"), int(src), async_op), async_op, (full, out), lambda: out)

    def gather(self, t, axis: AxisArg = None, dst: int = 0, async_op: bool = False):
        """Member `dst` gets every member's `t` concatenated along dim 0; others get None."""
        c = self.comm(axis, "gather")
        if self._staged(c, t):
            return self._via_host("gather", t, axis, dst=dst, async_op=async_op)
        src = _contig(t)
        out = empty_like_shape(t, (c.size * t.shape[0],) + tuple(t.shape[1:])) if c.rank == dst else src
        res = (lambda: out) if c.rank == dst else (lambda: None)
        return self._run(c.gather(view(src, "gather input"), view(out), int(dst), async_op), async_op, (src, out), res)

    def all_to_all(self, t, axis: AxisArg, async_op: bool = False):
        """Chunk k of `t` (along dim 0) goes to member k; chunk j of the result came from member j."""
        c = self.comm(axis, "all_to_all")
        if self._staged(c, t):
            return self._via_host("all_to_all", t, axis, async_op=async_op)
        if t.shape[0] % c.size:
            raise GridError(f"all_to_all on axis {axis!r}: dim 0 of size {t.shape[0]} does not split into "
                            f"{c.size} chunks")
        src = _contig(t)
        out = empty_like_shape(t, tuple(t.shape))
        return self._run(c.all_to_all(view(src, "all_to_all input"), view(out), async_op), async_op, (src, out), lambda: out)

    def all_to_all_v(self, t, send_counts, recv_counts, axis: AxisArg, tag: int = 0, async_op: bool = False):
        """Rows of `t` (dim 0) in member order: send_counts[k] rows go to member k, and the
        result holds recv_counts[j] rows from member j, in member order (torch's
        all_to_all_single with splits; MoE's token dispatch). The counts are the caller's, so
        every size is known before anything moves (exchange them first, e.g. all_to_all of
        the per-expert counts). One group of sends and receives (on NCCL grouped sends and
        receives, as ProcessGroupNCCL runs an uneven all-to-all); this rank's own rows are
        copied, not sent; the messages count as the axis's sends and receives. async_op: a handle
        whose wait() returns the result (the group started; other work runs meanwhile)."""
        c = self.comm(axis, "all_to_all_v")
        n, me = c.size, c.rank
        counts = [list(send_counts), list(recv_counts)]
        if any(len(x) != n for x in counts) or any(not isinstance(v, int) or v < 0 for x in counts for v in x):
            raise GridError(f"all_to_all_v on axis {axis!r}: send and receive counts must be {n} non-negative "
                            f"integers (one per member), got {send_counts!r}, {recv_counts!r}")
        if sum(counts[0]) != t.shape[0]:
            raise GridError(f"all_to_all_v on axis {axis!r}: the send counts add up to {sum(counts[0])} rows; "
                            f"the tensor has {t.shape[0]}")
        src = _contig(t)
        out = empty_like_shape(t, (sum(counts[1]),) + tuple(t.shape[1:]))
        starts = [list(itertools.accumulate(x, initial=0)) for x in counts]
        ops = []
        for k in range(n):
            if k == me:
                out[starts[1][k]:starts[1][k + 1]] = src[starts[0][k]:starts[0][k + 1]]
                continue
            if counts[0][k]:
                ops.append(P2POp("isend", src[starts[0][k]:starts[0][k + 1]], k, axis, tag))
            if counts[1][k]:
                ops.append(P2POp("irecv", out[starts[1][k]:starts[1][k + 1]], k, axis, tag))
        works = self.batch_isend_irecv(ops)
        if async_op:
            return _Together(works, out)
        for w in works:
            w.wait()
        return out

    def send(self, t, dst: int, axis: AxisArg = None, tag: int = 0, async_op: bool = False):
        """Send to `dst` (an index along `axis`; a global rank when axis is None)."""
        c = self.comm(axis, "send")
        if self._staged(c, t):
            return self._via_host("send", t, dst, axis, tag=tag, async_op=async_op)
        src = _contig(t)
        return self._run(c.send(view(src, "send buffer"), int(dst), int(tag)), async_op, (src,), lambda: None)

    def recv(self, t, src: int, axis: AxisArg = None, tag: int = 0, async_op: bool = False):
        """Receive into `t` from `src` (index along `axis`; a global rank when axis is None)."""
        c = self.comm(axis, "recv")
        if self._staged(c, t):
            return self._via_host("recv", t, src, axis, tag=tag, into=t, async_op=async_op)
        return self._run(c.recv(view(t, "recv buffer"), int(src), int(tag)), async_op, (t,), lambda: t)

    def recv_any(self, t, srcs: Iterable[int], axis: AxisArg = None, tag: int = 0, async_op: bool = False):
        """Receive into `t` from whichever of `srcs` sends first; returns the sender (or a Work)."""
        c = self.comm(axis, "recv_any")
        if self._staged(c, t):
            host = _to_host(t)
            staged = _then(self.recv_any(host, srcs, axis, tag, async_op=True),
                           lambda source: (t.copy_(host), source)[1])
            return staged if async_op else staged.wait()
        native = c.recv_any(view(t, "recv buffer"), [int(s) for s in srcs], int(tag))
        work = Work(native, self.timeout, (t,), lambda: native.source)
        return work if async_op else work.wait()

    def batch_isend_irecv(self, ops) -> list:
        """Start every send and receive of `ops` (gw.P2POp, one axis) as one group: they
        progress together (ncclGroupStart/End on NCCL), so a send and the receive its peer
        waits on cannot deadlock. Returns a Work per op, in order; a receive's wait() returns
        its tensor."""
        ops = list(ops)
        if not ops:
            return []
        if not all(isinstance(o, P2POp) for o in ops):
            raise GridError("batch_isend_irecv takes a list of gw.P2POp")
        axis = ops[0].axis
        if any(o.axis != axis for o in ops):
            raise GridError(f"batch_isend_irecv: every op must be on one axis; got {sorted({str(o.axis) for o in ops})}")
        c = self.comm(axis, "batch_isend_irecv")
        staged = self._staged(c, *(o.tensor for o in ops))
        bufs, finish = [], []
        for o in ops:
            send = o.op == "isend"
            t = o.tensor if not send else _contig(o.tensor)
            if not send and not t.is_contiguous():
                raise GridError(f"batch_isend_irecv: the irecv tensor must be contiguous ({o!r})")
            buf = _to_host(t) if staged else t
            bufs.append(buf)
            finish.append((lambda o=o, b=buf: o.tensor.copy_(b)) if staged and not send else (lambda o=o: o.tensor))
        natives = c.batch([_C.P2P(P2POp.KINDS[o.op], view(b, f"{o.op} buffer"), o.peer, o.tag)
                           for o, b in zip(ops, bufs)])
        for n, b in zip(natives, bufs):
            if n.stream:
                _record_stream((b,), n.stream)
        return [Work(n, self.timeout, (b,), f) for n, b, f in zip(natives, bufs, finish)]

    def link(self, axis: AxisArg, a: int, b: int, channel: int):
        """A two-member communicator between members a and b of this rank's line along `axis`,
        for one kind of traffic (`channel`): what pipeline stages send each other on. Both
        members make it, the first time, in the same order of (a, b, channel) keys."""
        return self._native.link(self._axis_tuple(axis), int(a), int(b), int(channel))

    def ring(self, axis: str):
        """The engine's ring over `axis` (Li et al.): neighbours, double-buffered exchanges."""
        return Ring(self, axis)

    @property
    def tp(self):
        """The tensor-parallel mode object (None: no tensor axes)."""
        return self.dims.tp

    def capabilities(self, axis: AxisArg = None) -> dict:
        """What the transport of `axis` can do (code branches on these, never on a backend name)."""
        c = self.comm(axis, "capabilities")
        return {"recv_any": c.can_recv_any, "survives_peer_failure": c.survives_peer_failure,
                "matches_fingerprints": c.matches_fingerprints, "matches_tags": c.matches_tags,
                "stream_ordered": c.stream_ordered}

    def any(self, flag, axis: AxisArg = None):
        """Whether `flag` is true on any rank of `axis` (None: the world): one decision, the
        same on every rank (a failed write, a non-finite tensor). A bool gives a bool; a tensor
        on the device gives a 0-d bool tensor there, unread (a training step's skip decision)."""
        on_device = isinstance(flag, torch.Tensor)
        t = flag.detach().to(device=self.device, dtype=torch.float64, copy=True).reshape(1) if on_device else \
            torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.device)
        self.all_reduce(t, axis=axis, op="max")
        return t[0] > 0 if on_device else bool(t.item() > 0)

    def broadcast_ints(self, values, axis: AxisArg, src: int = 0) -> list:
        """Member `src`'s list of integers (a shape, a count), on every member of `axis`."""
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        self.broadcast(t, axis=axis, src=src)
        return [int(v) for v in t.tolist()]

    def all_gather_json(self, value, axis: AxisArg = None) -> list:
        """Every member's JSON-encodable `value`, in line order, on every member of `axis` (torch's
        all_gather_object without pickle: nothing a peer sends is executed)."""
        import json

        mine = json.dumps(value).encode()
        sizes = self.all_gather(torch.tensor([len(mine)], dtype=torch.int64, device=self.device), axis=axis).tolist()
        buf = torch.zeros(max(sizes), dtype=torch.int32, device="cpu")  # bytes as int32: every transport has it
        buf[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        every = self.all_gather(buf.to(self.device).reshape(1, -1), axis=axis).cpu()
        return [json.loads(bytes(every[k, :n].tolist())) for k, n in enumerate(sizes)]

    def barrier(self, axis: AxisArg = None):
        """Blocks the host until every member of `axis` (None: the world) has reached it, on every
        transport (torch's barrier): on a stream-ordered one (NCCL) the host waits for the op itself."""
        self.comm(self.reduce_line(axis), "barrier").barrier(False).wait_host(self.timeout)

    # ---- setup ----------------------------------------------------------------------
    def connect(self, items) -> int:
        """Makes every communicator `items` name, on every rank (collective over the world): axis
        arguments (str, tuple, None, LinePart), Control and Link. Every rank's items are merged and
        made in one global order, so no two ranks wait on each other's making and a line one rank
        named is made on all its members (torchtitan's device mesh, made before the first step:
        NCCL's communicator creation blocks the host and must not meet kernels in flight). A rank
        makes the links it is a member of. Returns how many it made or found."""
        mine = sorted({json.dumps(_encode(i)) for i in items})
        every = sorted({code for codes in self.all_gather_json(mine) for code in codes},
                       key=lambda c: _order(json.loads(c)))
        for code in every:
            item = _decode(json.loads(code))
            if isinstance(item, Link):
                me = self.index(item.axes or None)
                if me in (item.a, item.b):
                    self.link(item.axes or None, item.a, item.b, item.channel)
            elif isinstance(item, Control):
                self.control(item.axes or None, "connect")
            else:
                self.comm(item, "connect")
        return len(every)

    def seal(self) -> None:
        """Ends setup: a communicator made after it is counted as made late (communicators().
        NCCL's creation blocks the host, with other communicators' kernels possibly in flight)."""
        self._native.seal()

    def communicators(self) -> dict:
        """{"at_setup": N, "after_setup": M, "late": [their names]}: what this rank made before and after seal()."""
        return dict(self._native.made())

    # ---- traffic --------------------------------------------------------------------
    def stats(self) -> dict:
        """Traffic this rank has moved, per axis label ("y", "x,y", "world"):
        ops, and messages/bytes sent and received, intra- and inter-node."""
        return self._native.stats()

    def reset_stats(self) -> None:
        self._native.reset_stats()

    def traffic(self, axis: AxisArg, op: str, nbytes: int) -> dict:
        """SUPER's model of one segmented collective over the whole grid (§V, eqs. 3-7):
        every rank exchanges a message with each member of its line, itself included."""
        return self.placement.traffic(self._axis_tuple(axis), op, int(nbytes))

    # ---- flight recorder ------------------------------------------------------------
    def flight_records(self) -> list[dict]:
        """This rank's last operations as the engine's flight recorder holds them, oldest first: one
        dict an op (kind, line, members, seq, tag, peer, root, count, bytes, dtype, state and the
        steady-clock times issued_s / started_s / ended_s, None where not reached). Empty when the
        recorder is disabled (GRIDWEAVE_FLIGHT_ENTRIES=0)."""
        if not self._native.flight_enabled:
            return []
        return json.loads(self._native.flight_json())["entries"]

    def flight_dump(self, reason: str) -> None:
        """Writes the flight recorder to <flight_dir>/rank<R>.json now (nothing without a folder):
        what the engine does itself on a communication failure, a SIGTERM (a handler of the engine's,
        which then chains to the one set before it, so a rank blocked in a wait dumps too) and
        shutdown."""
        self._native.flight_dump(str(reason))

    def shutdown(self) -> None:
        """Dumps the flight recorder (reason "shutdown", unless a failure was dumped first) and
        closes the grid's communicators."""
        self._comms.clear()
        self._native.shutdown()

    def __repr__(self):
        axes = ", ".join(f"{k}={v}" for k, v in self.axes.items())
        return f"Grid({axes}; rank {self.rank}/{self.world_size}, {self.backend}, {self.placement_policy})"


def part_members(n: int, me: int, span: Span, q: int) -> list:
    """The member indices a line part keeps of a line of n members, seen from member `me`: its
    block of q consecutive members (WITHIN), or those at its position in every block (ACROSS)."""
    first = me // q * q
    return list(range(first, first + q)) if span is Span.WITHIN else list(range(me % q, n, q))


def one_part(axis):
    """A tuple of one LinePart (a placement's partial axes) is that LinePart; a LinePart does
    not combine with other axes in one line."""
    if isinstance(axis, (tuple, list)) and any(isinstance(a, LinePart) for a in axis):
        if len(axis) != 1:
            raise GridError(f"a line part is a whole axis argument: it does not combine with other axes, got {axis!r}")
        return axis[0]
    return axis


def _record_stream(tensors, stream: int) -> None:
    """A stream-ordered op (NCCL) returns before its kernel ends: its CUDA tensors are marked
    in use on the engine's stream, so torch's caching allocator reuses their memory only after
    it (ProcessGroupNCCL's recordStream)."""
    engine = torch.cuda.ExternalStream(stream)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(engine)


def _dim(t, dim: int) -> int:
    nd = len(t.shape)
    if nd == 0:
        raise GridError("collectives need a tensor with at least one dimension")
    if not -nd <= dim < nd:
        raise GridError(f"dim {dim} is out of range for a {nd}-d tensor")
    return dim % nd


def _gathered(t, g: int) -> tuple:
    """The shape of g members' t concatenated along dim 0."""
    return (g * t.shape[0], *t.shape[1:])


def _check_out(out, t, shape, dim, op):
    if dim != 0:
        raise GridError(f"{op}: out= is supported for dim=0 only")
    if tuple(out.shape) != tuple(shape) or out.dtype != t.dtype:
        raise GridError(f"{op}: out has shape {tuple(out.shape)} and dtype {out.dtype}; "
                        f"expected {tuple(shape)} and {t.dtype}")


def _contig(t):
    if isinstance(t, torch.Tensor):
        return t.contiguous()
    return t


def _movedim(t, a: int, b: int):
    if a == b:
        return t
    if isinstance(t, torch.Tensor):
        return t.movedim(a, b)
    import numpy as np

    return np.moveaxis(t, a, b) if isinstance(t, np.ndarray) else t.__class__.moveaxis(t, a, b)


def _merge_leading(out, dim: int):
    """(g, *shape) -> concatenation of the g blocks along `dim`."""
    if dim == 0:
        return out.reshape((out.shape[0] * out.shape[1],) + tuple(out.shape[2:]))
    moved = _movedim(out, 0, dim)  # (..., g, shape[dim], ...)
    shape = tuple(moved.shape)
    merged = shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2:]
    return moved.reshape(merged)


class _Session:
    """The grid of this process made by gw.init; gw.shutdown ends it."""

    current: Grid | None = None
    generation = 0


def init(dp: int = 1, pp: int = 1, tp=None, sp: int = 1, backend: str = "auto", placement: str = "topology",
         ranks_per_node: int | None = None, timeout: float = 300.0, *, rank: int | None = None,
         world_size: int | None = None, store=None, prefix: str | None = None, device=None,
         check: "CheckLevel | None" = None, emulate: str | None = None, flight_dir=None) -> Grid:
    """Build the grid. Rendezvous uses torchrun's variables (RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless rank/world_size/store are given.
    check: how every op verifies that the ranks of its line passed the same op, count,
    dtype and root (CheckLevel.Cheap, always on; CheckLevel.Detail fingerprints every
    call); default from GRIDWEAVE_DEBUG=DETAIL, like TORCH_DISTRIBUTED_DEBUG.
    device: where the grid computes (default: cuda:LOCAL_RANK with NCCL, cpu with Gloo; a CUDA
    device with Gloo shares GPUs between ranks, staging messages through host memory).
    emulate: "nccl" keeps NCCL's rules on the CPU transport (ops of a communicator run one at a
    time in issue order, a send waits for its receive, a pair's messages match in order, no
    receive-from-any), so code that would deadlock on GPUs times out on CPU; default from
    GRIDWEAVE_EMULATE.
    flight_dir: where each rank writes its flight recorder (its last operations) as rank<R>.json
    on a communication failure, a SIGTERM and shutdown, for `gridweave flight`; default from
    GRIDWEAVE_FLIGHT_DIR; none: nothing is written (grid.flight_records() still reads it).
    Every check here is local, so bad input raises GridError on every rank before any
    communication starts."""
    dims = ParallelDims(dp=dp, pp=pp, sp=sp, tp=tp)
    n = dims.world_size
    local = launch.local_world_size()
    backend = _resolve_backend(backend, local or world_size or _env_int("WORLD_SIZE") or 1, device)
    if backend == "mpi":  # mpirun / srun: who we are comes from MPI itself, no TCP store
        mpi_rank, mpi_size = launch.mpi_world()
        # The grid is MPI's world, or its first world_size ranks (the others do not call init,
        # but have initialised MPI: gw.launch.mpi_world()).
        world_size = mpi_size if world_size is None else world_size
        if not (isinstance(world_size, int) and 1 <= world_size <= mpi_size):
            raise GridError(f"world_size {world_size!r} does not fit MPI's world of {mpi_size} ranks")
        if rank is not None and rank != mpi_rank:
            raise GridError(f"rank {rank} is not this process's MPI rank {mpi_rank}; under MPI leave rank= out")
        if mpi_rank >= world_size:
            raise GridError(f"MPI rank {mpi_rank} is outside the grid's world of the first {world_size} ranks; "
                            "only those call gw.init")
        rank = mpi_rank
        store = store if store is not None else _mpi_store()
    rank = launch.launched_rank() if rank is None else rank
    world_size = (_env_int("WORLD_SIZE") or _env_int("SLURM_NTASKS")) if world_size is None else world_size
    if world_size is None:
        world_size, rank = 1, 0
    if rank is None:
        raise GridError("WORLD_SIZE is set but RANK is not; launch with torchrun or pass rank=")
    desc = " x ".join(f"{a}={s}" for a, s in dims.axes())
    if n != world_size:
        raise GridError(f"grid {desc} needs {n} ranks but the world has {world_size}")
    if not 0 <= rank < world_size:
        raise GridError(f"rank {rank} is outside the world of {world_size}")
    if placement not in ("naive", "topology"):
        raise GridError(f"placement must be 'naive' or 'topology', got {placement!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise GridError(f"timeout must be a positive number of seconds, got {timeout!r}")
    emulate = emulation(emulate)
    if emulate is not None and backend == "nccl":
        raise GridError("emulate='nccl' runs NCCL's rules on a CPU transport (gloo or mpi); the nccl backend "
                        "keeps its own")
    check = check_level() if check is None else check
    if not isinstance(check, CheckLevel):
        raise GridError(f"check must be a gw.CheckLevel, got {check!r}")
    flight_dir = os.environ.get("GRIDWEAVE_FLIGHT_DIR", "") if flight_dir is None else flight_dir
    if not isinstance(flight_dir, (str, os.PathLike)):
        raise GridError(f"flight_dir must be a folder's path, got {flight_dir!r}")
    rpn = ranks_per_node if ranks_per_node is not None else (local or world_size)
    if not isinstance(rpn, int) or rpn < 1:
        raise GridError(f"ranks_per_node must be a positive integer, got {rpn!r}")
    device = _resolve_device(device, backend, local or world_size)
    # the GPU a transport reads directly (NCCL; a CUDA-aware MPI), else none: staged via the host
    device_index = device.index if device.type == "cuda" and backend in ("nccl", "mpi") else -1

    if store is None:
        store = _default_store(rank, world_size, timeout)
    _Session.generation += 1
    # A given prefix names this grid alike on all its ranks (the session MPI's line handshake
    # checks); the default counts this process's grids, which ranks of a sub-world may not share.
    session = prefix if prefix is not None else ""
    # a restarted job's ranks meet in the store its failed ranks wrote to: their keys apart
    prefix = prefix if prefix is not None else f"gridweave/{launch.store_generation()}/{_Session.generation}"
    # The Python half of a Store subclass must outlive the native grid that calls it.
    adapter = store if isinstance(store, _C.Store) else _TorchStore(store, timeout)
    native_store = _C.prefix_store(prefix, adapter)
    keep = (store, adapter)
    hostname = launch.advertised_address(all_local=(local or world_size) >= world_size)
    grid = Grid(dims, rank=rank, backend=backend, placement=placement, ranks_per_node=rpn, timeout=timeout,
                store=native_store, hostname=hostname, device_index=device_index, device=device,
                session=session, check=check, emulate=emulate, flight_dir=os.fspath(flight_dir))
    grid._torch_store = keep
    _Session.current = grid
    return grid


def _mpi_store():
    from torch.distributed import HashStore

    return HashStore()  # MPI connects its own lines; the store is never read


def _resolve_backend(backend: str, local_ranks: int, device=None) -> str:
    """auto: NCCL when it is built and every rank on this node can have its own GPU (and no
    CPU device was asked for); else MPI when an MPI launcher started the ranks and gridweave
    has MPI (shared memory on a host); else Gloo."""
    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise GridError(f"unknown backend {backend!r}; use 'auto', 'gloo', 'nccl' or 'mpi'")
    if backend == "mpi":
        return backend
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if backend == "auto":
        cpu = device is not None and torch.device(device).type == "cpu"
        enough = has_gpu and torch.cuda.device_count() >= local_ranks
        if enough and _C.nccl_available and not cpu:
            return "nccl"
        return "mpi" if (_C.mpi_available and launch.mpi_ranks()) else "gloo"
    if backend == "nccl":
        if not _C.nccl_available:
            raise GridError("backend 'nccl' requested but gridweave was built without the NCCL transport "
                            "(rebuild with nvcc and NCCL present, GRIDWEAVE_CUDA=ON)")
        if not has_gpu:
            raise GridError("backend 'nccl' requested but this process sees no CUDA GPU; use backend='gloo'")
    return backend


def _resolve_device(device, backend: str, local_ranks: int) -> torch.device:
    """The grid's device, checked: NCCL computes on one GPU per rank; Gloo on the CPU, or on a
    GPU shared by several ranks."""
    local_rank = launch.local_rank()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        if backend == "nccl":
            if gpus < local_ranks:
                raise GridError(f"backend 'nccl' needs one GPU per rank: {local_ranks} ranks on this node but "
                                f"{gpus} GPUs visible (NCCL refuses two ranks on one GPU); use backend='gloo' "
                                "with device='cuda' to share them")
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise GridError(f"device {device!r} is not a torch device: {e}") from None
    if device.type == "cpu":
        if backend == "nccl":
            raise GridError("backend 'nccl' computes on GPUs; use device='cuda' or backend='gloo'")
        return device
    if device.type != "cuda":
        raise GridError(f"device must be cpu or cuda, got {device}")
    if gpus == 0:
        raise GridError(f"device {device} requested but this process sees no CUDA GPU; use device='cpu'")
    index = device.index if device.index is not None else local_rank % gpus
    if index >= gpus:
        raise GridError(f"device cuda:{index} requested but only {gpus} GPUs are visible")
    if backend == "nccl" and gpus < local_ranks:
        raise GridError(f"backend 'nccl' needs one GPU per rank: {local_ranks} ranks on this node but {gpus} GPUs "
                        "visible; use backend='gloo' to share them")
    return torch.device("cuda", index)


def rendezvous_store(timeout: float = 300.0):
    """The store gw.init meets in on this launched world (torchrun's TCPStore; a HashStore for one
    rank), for its ranks to agree on something before their grid exists: pass it on as
    init(store=). None under an MPI launcher (its ranks meet through MPI)."""
    if launch.mpi_launched():
        return None
    return _default_store(launch.launched_rank() or 0, _env_int("WORLD_SIZE") or 1, timeout)


def decided_once(store, key: str, decide, timeout: float) -> str:
    """decide() (a string) run by rank 0 alone and read by every rank from `store` (rendezvous_store's)
    within `timeout` seconds; a GridError rank 0 meets is every rank's."""
    adapter = _TorchStore(store, timeout)
    if (launch.launched_rank() or 0) == 0:
        try:
            value = "ok:" + decide()
        except GridError as e:
            value = "error:" + str(e)
        adapter.set(key, value.encode())
    else:
        value = bytes(adapter.get(key, timeout)).decode()
    kind, _, text = value.partition(":")
    if kind == "error":
        raise GridError(text)
    return text


def _default_store(rank: int, world_size: int, timeout: float):
    from torch.distributed import HashStore, TCPStore

    if world_size == 1:
        return HashStore()
    addr = os.environ.get("MASTER_ADDR")
    port = _env_int("MASTER_PORT")
    if addr is None or port is None:
        raise GridError("MASTER_ADDR and MASTER_PORT must be set (torchrun sets them) or pass store=")
    # Under torchrun the agent already serves a TCPStore on MASTER_PORT.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return TCPStore(addr, port, world_size, is_master=(rank == 0 and not agent),
                    timeout=timedelta(seconds=timeout), wait_for_workers=False)


def current() -> Grid:
    if _Session.current is None:
        raise GridError("no grid: call gw.init() first")
    return _Session.current


def shutdown() -> None:
    """Close the current grid's communicators."""
    if _Session.current is not None:
        _Session.current.shutdown()
        _Session.current = None


# Join the engine's threads before the interpreter tears down, also when a script
# forgets gw.shutdown(); then finalise MPI if gridweave initialised it (atexit runs these
# in reverse order).
atexit.register(_C.mpi_finalize)
atexit.register(shutdown)
