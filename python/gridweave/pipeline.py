"""Pipeline x data parallelism (AxoNN, AxoNN; Megatron-LM's 1F1B as the baseline).

A stage is an nn.Module holding this rank's contiguous run of layers. pipeline_step runs
one batch shard through the "pp" axis under the engine's schedule (cpp/pipeline.h):
"message_driven" (AxoNN Algorithm 2, pipeline_limit microbatches in flight) or "1f1b"
(Megatron's synchronous one-forward-one-backward with flush). The loss of every
microbatch is divided by the number of microbatches, so gradients are the shard's mean.
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import _C, schedules
from .split import chunk_store
from .axes import stage_axes
from .errors import GridError
from .grid import Control, Link
from .measure import timed


def optimal_ac(layers_per_stage: int, total_layers: int) -> int:
    """AxoNN §V-A: the factor of the layers per stage closest to sqrt(total layers)."""
    if layers_per_stage < 1:
        raise GridError("a stage needs at least one layer")
    factors = [f for f in range(1, layers_per_stage + 1) if layers_per_stage % f == 0]
    return min(factors, key=lambda f: (abs(f - math.sqrt(total_layers)), f))


class PipelineStage(nn.Module):
    """This rank's layers. With ac > 1, only every ac-th layer's output is kept and the
    rest are recomputed in backward (torch.utils.checkpoint); ac="auto" uses optimal_ac."""

    def __init__(self, layers, total_layers=None, ac=1):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        n = len(self.layers)
        self.ac = resolve_ac(ac, n, total_layers or n)

    def forward(self, x):
        return run_layers(self.layers, x, self.ac)


def resolve_ac(ac, layers_per_stage: int, total_layers: int) -> int:
    """An activation-checkpointing factor: 1 (none), "auto" (optimal_ac) or a factor of the
    stage's layers (only every ac-th layer's output is kept)."""
    if ac == "auto":
        return optimal_ac(layers_per_stage, total_layers)
    if not isinstance(ac, int) or isinstance(ac, bool) or ac < 1 or layers_per_stage % ac:
        raise GridError(f"ac must be 'auto' or a factor of the {layers_per_stage} layers on a stage, got {ac!r}")
    return ac


def run_layers(layers, x, ac: int = 1, documents=None):
    """x through `layers`, keeping only every ac-th output for backward (the rest are
    recomputed: torch.utils.checkpoint); documents (packed documents' ids) go to every layer."""
    if ac == 1 or not torch.is_grad_enabled():
        return _run(layers, x, documents)
    for i in range(0, len(layers), ac):
        x = checkpoint(lambda t, g=layers[i:i + ac]: _run(g, t, documents), x, use_reentrant=False)
    return x


def _run(layers, x, documents=None):
    for layer in layers:
        x = layer(x) if documents is None else layer(x, documents)
    return x


class _DeviceBytes:
    """Device memory the engine owns, seen through __cuda_array_interface__ as raw bytes
    (every dtype, bf16 included, is then a view of them)."""

    def __init__(self, addr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, True),
                                         "version": 3, "strides": None}


def _tensor_at(addr: int, shape, dtype, device, host_messages: bool) -> torch.Tensor:
    """A copy on `device` of the message bytes the engine received at `addr` (host memory
    when the transport's messages live there, else memory on the device): one copy, from the
    engine's buffer straight into the new tensor."""
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    if host_messages:  # the host bytes seen as a tensor in place (frombuffer: host memory, no copy)
        src = torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)
    else:
        src = torch.as_tensor(_DeviceBytes(addr, nbytes), device=device)
    t.view(-1).view(torch.uint8).copy_(src)
    return t


SCHEDULES = {"message_driven": _C.PipelineSchedule.MessageDriven, "1f1b": _C.PipelineSchedule.OneFOneB,
             "interleaved": _C.PipelineSchedule.Interleaved}
# The zero-bubble schedules, run from their tables (gw.schedules) by the engine's run_table:
# ZB-H1 on one chunk a stage, ZB-V and DualPipeV on two in a V
TABLES = {"zb1": schedules.zb_h1, "zbv": schedules.zbv, "dualpipev": schedules.dualpipev}
V_SCHEDULES = ("zbv", "dualpipev")
ENGINE_KINDS = {kind: getattr(_C.StageOpKind, kind.name) for kind in schedules.Kind}
# --schedule auto: the message-driven schedule where a micro-batch runs no collective over the data
# axes, else 1F1B (pipeline.resolve_schedule)
AUTO = "auto"
SCHEDULE_NAMES = (*SCHEDULES, *TABLES, AUTO)


def placement_of(schedule: str) -> schedules.Placement:
    """Where a schedule puts a stage's chunks: a V for ZB-V and DualPipeV, else a loop."""
    return schedules.Placement.V if schedule in V_SCHEDULES else schedules.Placement.LOOP


def check_chunks(schedule: str, chunks: int) -> None:
    """One clear error unless `schedule` runs `chunks` model chunks a stage: several need
    interleaved, the V schedules run exactly 2 and ZB-H1 one."""
    if schedule in V_SCHEDULES and chunks != 2:
        raise GridError(f"the {schedule} schedule runs 2 model chunks a stage (a V), got chunks={chunks}")
    if schedule in TABLES and schedule not in V_SCHEDULES and chunks != 1:
        raise GridError(f"the {schedule} schedule runs 1 model chunk a stage, got {chunks}")
    if chunks > 1 and schedule not in ("interleaved", *V_SCHEDULES):
        raise GridError(f"chunks={chunks} needs schedule=interleaved (or zbv / dualpipev with 2)")


def fixed_order_reason(pp: int, dp: int, zero: int, moe: bool) -> str | None:
    """Why this pipeline needs every data replica of a stage to run its micro-batches in one order
    (a collective over the data axes inside each micro-batch), or None. The message-driven schedule
    runs micro-batches as their messages arrive, so replicas of a stage may take them in different
    orders and such a collective would meet another micro-batch's (or hang)."""
    if pp > 1 and zero == 3:
        return "ZeRO-3 gathers each layer's parameters over the data axes inside every micro-batch"
    if pp > 1 and dp > 1 and moe:
        return ("a mixture of experts exchanges tokens and sums its routing statistics over the data axes "
                "inside every micro-batch")
    return None


def resolve_schedule(schedule: str, pp: int, dp: int, zero: int, moe: bool) -> str:
    """The schedule a job runs: `schedule`, or for "auto" the message-driven one (AxoNN) unless a
    micro-batch needs one order on every replica (fixed_order_reason), then 1F1B."""
    if schedule != AUTO:
        return schedule
    return "1f1b" if fixed_order_reason(pp, dp, zero, moe) else "message_driven"


RECEIVE = {"auto": _C.ReceiveStrategy.Auto, "any": _C.ReceiveStrategy.Any, "per_peer": _C.ReceiveStrategy.PerPeer,
           "announced": _C.ReceiveStrategy.Announced}


# Grid.link channels: what one stage sends its neighbour (a pair's two directions are two links)
ACTIVATIONS, GRADIENTS = 0, 1


def _link_roles(s: int, prev: int | None, next_: int | None, vee: bool = False) -> dict:
    """{role: (sender, receiver, channel)} of stage s: activations to `next_` and from `prev`,
    gradients to `prev` and from `next_` (None at an end of a plain pipeline); in a V also the
    second chunk's, which flow the other way."""
    want = {}
    if next_ is not None:
        want["to_next"] = (s, next_, ACTIVATIONS)
        want["from_next"] = (next_, s, GRADIENTS)
        if vee:
            want["act_from_next"] = (next_, s, ACTIVATIONS)
            want["grad_to_next"] = (s, next_, GRADIENTS)
    if prev is not None:
        want["from_prev"] = (prev, s, ACTIVATIONS)
        want["to_prev"] = (s, prev, GRADIENTS)
        if vee:
            want["act_to_prev"] = (s, prev, ACTIVATIONS)
            want["grad_from_prev"] = (prev, s, GRADIENTS)
    return want


def stage_links(grid, axis, prev: int | None, next_: int | None, vee: bool = False):
    """This stage's links (engine StageLinks): activations to `next_` and from `prev`, gradients
    to `prev` and from `next_` (stage indices; None at an end of a plain pipeline), and in a V
    the second chunk's the other way. Every rank makes its links in one global order (by the
    pair's lower stage, then sender, then channel), so no two stages can wait on each other's
    making (a job makes them at setup: comm_lines)."""
    want = _link_roles(grid.index(axis), prev, next_, vee)
    made = {}
    for key in sorted(set(want.values()), key=lambda k: (min(k[0], k[1]), max(k[0], k[1]), k[0], k[2])):
        made[key] = grid.link(axis, *key)
    return _C.StageLinks(**{role: made[key] for role, key in want.items()})


def _channels(grid, axis, schedule: str, receive: str, interleaved: bool, can_recv_any: bool) -> tuple:
    """What a schedule talks over besides the pp line, decided once for pipeline_step and
    comm_lines: ((prev, next) stages to link, or None; an announcing control channel over the pp
    line; the stage group's control axes, or ())."""
    s, n = grid.index(axis), grid.size(axis)
    if schedule in TABLES:  # a known order, every message on a link of its own
        return (s - 1 if s > 0 else None, s + 1 if s < n - 1 else None), False, ()
    message_driven = schedule == "message_driven" and not interleaved
    announced = receive == "announced" or (receive == "auto" and not can_recv_any)
    any_peer = message_driven and (receive == "any" or (receive == "auto" and can_recv_any))
    if interleaved:
        neighbours = ((s - 1) % n, (s + 1) % n)
    else:  # receive-from-any takes every message on pp itself; every other way talks over the links
        neighbours = None if any_peer else (s - 1 if s > 0 else None, s + 1 if s < n - 1 else None)
    group = stage_axes(grid.axes, axis) if message_driven else ()
    return neighbours, announced and message_driven, group


def comm_lines(grid, schedule: str, receive: str = "auto", chunks: int = 1, axis: str = "pp") -> list:
    """The communicators pipeline_step and pipeline_forward use with this schedule (Grid.connect
    items): the pp line, this stage's links, the control channels."""
    interleaved = schedule not in TABLES and (schedule == "interleaved" or chunks > 1)
    names = grid._axis_tuple(axis)
    neighbours, announced, group = _channels(grid, axis, schedule, receive, interleaved,
                                             grid.capabilities(None)["recv_any"])
    items = [axis]
    if neighbours is not None and grid.size(axis) > 1:
        items += [Link(tuple(names), *key)
                  for key in _link_roles(grid.index(axis), *neighbours, schedule in V_SCHEDULES).values()]
    if announced:
        items.append(Control(tuple(names)))
    if group:
        items.append(Control(tuple(group)))
    return items


@functools.cache
def _use_torch_allocator() -> None:
    """The engine's CUDA message buffers from torch's caching allocator, on the stream current
    when each is made (no cudaMalloc / cudaFree per message). Once per process."""
    _C.use_cuda_allocator(lambda n: torch.cuda.caching_allocator_alloc(n), torch.cuda.caching_allocator_delete)


def _stage_stream(grid, pp) -> int:
    """The stream the stage computes on, which its messages are filled and read in (0: host)."""
    if grid.device.type != "cuda" or pp.device != _C.Device.CUDA:
        return 0
    _use_torch_allocator()
    return torch.cuda.current_stream(grid.device).cuda_stream


def _chunks(stage) -> list:
    """This rank's model chunks: a gw.models.ModelChunks' or a list's (the interleaved
    schedule), else the one stage."""
    owned = getattr(stage, "chunks", None)
    if owned is None and isinstance(stage, (list, tuple, nn.ModuleList)):
        owned = stage
    return list(owned) if owned is not None else [stage]


def _microbatches(grid, pp, axis, inputs, targets) -> int:
    """The microbatch count, which only the first (inputs) and last (targets) stages know:
    every stage learns it from them."""
    s, n_stages = pp.rank, pp.size
    m = len(inputs) if s == 0 else len(targets) if s == n_stages - 1 and targets is not None else None
    counts = torch.tensor([float(m if m is not None else -1)], dtype=torch.float64, device=grid.device)
    grid.all_reduce(counts, axis=axis, op="max")
    return int(counts.item())


def _microbatch_count(grid, pp, axis, inputs, targets, microbatches, documents) -> int:
    """pipeline_step's micro-batches: the job's count, or the one the end stages hold (agreed over
    pp); at least one, and as many as the packed documents' ids."""
    m = _microbatches(grid, pp, axis, inputs, targets) if microbatches is None else int(microbatches)
    if m < 1:
        raise GridError("pipeline_step needs at least one microbatch")
    if documents is not None and len(documents) != m:
        raise GridError(f"documents: {len(documents)} micro-batches of document ids for {m} micro-batches")
    return m


class _StageCallbacks:
    """The engine's forward(mb, chunk, addr) and backward(mb, chunk, addr) over this rank's
    model chunks (one for the plain schedules): chunk c of stage s is virtual stage
    c * stages + s; inputs feed stage 0's chunk 0, targets the last stage's last chunk. Each
    microbatch loss is divided by m, so gradients are the shard's mean.

    A message is copied once: from the engine's receive buffer (which takes the message after
    next) into the tensor the stage computes on, which autograd saves. What a callback returns
    is sent in place (cpp/pipeline.h): the tensor stays in `outgoing` until the engine calls
    sent(address), once its send is done. copies / copied_bytes count the payload copies made
    here (pipeline_step adds them to the engine's PipelineStats)."""

    def __init__(self, chunks, pp, inputs, targets, loss_fn, m, activation_shape, dtype, device, documents=None,
                 phases=None, vee=False, stores=None, split=()):
        self.chunks, self.inputs, self.targets, self.loss_fn, self.m = chunks, inputs, targets, loss_fn, m
        self.vee = vee  # chunks in a V: the loss is stage 0's second chunk
        self.stores = stores  # per chunk, the weight gradients B leaves for W (split schedules), or None
        self.split = frozenset(split)  # the (micro-batch, chunk)s whose forward builds for a B then W
        self.phases = phases  # a gw.measure.StepPhases timing the callbacks, or None
        self.documents = documents  # per micro-batch (packed documents), given to every chunk, or None
        self.shape, self.dtype, self.device = tuple(activation_shape), dtype, device
        self.s = pp.rank
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1
        # Gloo's messages are host memory: CUDA activations are sent from a host copy
        self.host_messages = pp.device == _C.Device.CPU
        self.payload = math.prod(activation_shape) * dtype.itemsize
        # outgoing: address -> the tensors whose bytes the engine is sending from there
        self.ctx, self.outgoing, self.losses = {}, {}, []
        self.copies = self.copied_bytes = 0

    def _head(self, c):
        return self.first and c == 0

    def _tail(self, c):
        return (self.first if self.vee else self.last) and c == len(self.chunks) - 1

    def forward(self, mb, c, addr):
        return self._split((mb, c) in self.split, mb, c, "forward", self._forward, addr)

    def backward(self, mb, c, addr, input_only=False):
        return self._split(input_only, mb, c, "backward", self._backward, addr)

    def _split(self, split, mb, c, phase, fn, addr):
        """fn timed as `phase`; where this micro-batch's backward is split, its chunk's linears
        defer their weight gradients (the forward builds them so; B's recomputation too)."""
        if not split:
            return timed(self.phases, phase, fn, mb, c, addr)
        store = self.stores[c]
        store.current = mb
        try:
            return timed(self.phases, phase, fn, mb, c, addr)
        finally:
            store.current = None

    def weight(self, mb, c):
        """W: the weight gradients micro-batch mb's B left on chunk c."""
        timed(self.phases, "backward", self.stores[c].run, mb)  # W is backward work

    def sent(self, addr):
        """The engine sends from `addr` no more: the tensor there may go."""
        held = self.outgoing.get(addr)
        if held:
            held.pop(0)
            if not held:
                del self.outgoing[addr]

    def _copied(self, t):
        self.copies += 1
        self.copied_bytes += t.numel() * t.element_size()
        return t

    def _received(self, addr):
        """The message at `addr` in a tensor of the stage's own: the one copy a message makes."""
        return self._copied(_tensor_at(addr, self.shape, self.dtype, self.device, self.host_messages))

    def _send(self, t):
        """The address the engine sends `t`'s bytes from, in place; `t` is held until sent()."""
        if not t.is_contiguous():
            t = self._copied(t.contiguous())
        if self.host_messages and t.device.type != "cpu":
            t = self._copied(t.to("cpu"))  # the host transport's messages are host memory
        if t.numel() == 0:
            return 0  # an empty payload: the engine sends a word of its own
        if t.data_ptr() % 16:  # a view at an odd offset: the transports move whole 8-byte words
            t = self._copied(t.clone())
        addr = t.data_ptr()
        self.outgoing.setdefault(addr, []).append(t)
        return addr

    def _forward(self, mb, c, addr):
        x = self.inputs[mb] if self._head(c) else self._received(addr).requires_grad_()
        y = self.chunks[c](x) if self.documents is None else self.chunks[c](x, self.documents[mb])
        if self._tail(c):
            loss = self.loss_fn(y, self.targets[mb]) / self.m
            self.losses.append(loss.detach())
            self.ctx[(mb, c)] = (x, loss)
            return 0
        if tuple(y.shape) != self.shape or y.dtype != self.dtype:
            where = f"chunk {c} of stage {self.s}" if len(self.chunks) > 1 else f"stage {self.s}"
            raise GridError(f"{where} produced {tuple(y.shape)} {y.dtype}, the pipeline carries {self.shape} "
                            f"{self.dtype}")
        self.ctx[(mb, c)] = (x, y)
        return self._send(y.detach())

    def _backward(self, mb, c, addr):
        x, y = self.ctx.pop((mb, c))
        if self._tail(c):
            y.backward()
        else:
            y.backward(self._received(addr))
        if self._head(c):
            return 0
        return self._send(x.grad)

    def loss(self):
        return torch.stack(self.losses).sum() if self.losses else None


def _with_copies(stats, cb):
    """The engine's PipelineStats with the callbacks' payload copies added to its own."""
    stats.copies += cb.copies
    stats.copied_bytes += cb.copied_bytes
    return stats


def pipeline_step(stage: nn.Module, grid, inputs, targets, loss_fn, activation_shape, dtype=torch.float32,
                  schedule="message_driven", pipeline_limit=2, axis="pp", receive="auto", documents=None,
                  phases=None, microbatches=None):
    """Forward and backward of every microbatch of this rank's batch shard.

    inputs: the microbatches (used on stage 0); targets: theirs (used on the last stage);
    loss_fn(output, target) -> scalar mean loss of one microbatch; activation_shape: the
    shape of what crosses a stage boundary. schedule: "message_driven" (AxoNN), "1f1b" or
    "interleaved" (Megatron's, Megatron-LM Fig. 4: `stage` is this rank's model chunks, a
    gw.models.ModelChunks or a list, chunk c being virtual stage c * p + s); receive: "auto"
    (receive-from-any where the transport can, else "announced"), "any", "per_peer" (one
    receive per neighbour, polled) or "announced" (each message announced on a host control
    channel, the data receive posted for exactly it: what NCCL needs). Returns (loss, stats):
    the mean microbatch loss on the last stage (None elsewhere) and the engine's PipelineStats.
    documents: packed documents' (batch, seq) ids of every microbatch, given on every stage (each
    chunk is called as chunk(x, documents[mb])), or None. phases: a gw.measure.StepPhases that
    the micro-batches' forward and backward times are added to, or None. microbatches: the count,
    where every stage knows it (a job's configuration): no collective agrees on it each step.
    """
    if schedule not in SCHEDULES and schedule not in TABLES:
        raise GridError(f"schedule must be one of {sorted([*SCHEDULES, *TABLES])}, got {schedule!r}")
    chunks = _chunks(stage)
    if schedule in TABLES:
        return _table_step(schedule, stage, chunks, grid, inputs, targets, loss_fn, activation_shape, dtype, axis,
                           documents, phases, microbatches)
    interleaved = schedule == "interleaved" or len(chunks) > 1 or isinstance(stage, (list, tuple))
    _check_placement(stage, schedule)
    if receive not in RECEIVE:
        raise GridError(f"receive must be one of {sorted(RECEIVE)}, got {receive!r}")
    pp = grid.comm(axis, "pipeline")
    if interleaved and pp.size < 2:
        raise GridError("the interleaved schedule needs at least 2 pipeline stages")
    if documents is not None and any(b is not None and len(b) != len(documents) for b in (inputs, targets)):
        raise GridError(f"documents: {len(documents)} micro-batches of document ids for "
                        f"{len(inputs if inputs is not None else targets)} micro-batches")
    m = _microbatch_count(grid, pp, axis, inputs, targets, microbatches, documents)
    held = inputs if pp.rank == 0 else targets if pp.rank == pp.size - 1 else None
    if held is not None and len(held) != m:
        raise GridError(f"microbatches={m}, but this stage holds {len(held)} micro-batches")
    if interleaved and m % pp.size:
        raise GridError(f"the interleaved schedule needs a positive multiple of the {pp.size} stages as "
                        f"microbatches, got {m}")
    cb = _StageCallbacks(chunks, pp, inputs, targets, loss_fn, m, activation_shape, dtype, grid.device, documents,
                         phases)
    if receive == "any" and not pp.can_recv_any and not interleaved:
        raise GridError(f"receive='any': the {pp.backend} transport cannot receive from any peer; use 'announced'")
    neighbours, announced, group = _channels(grid, axis, schedule, receive, interleaved, pp.can_recv_any)
    links = _C.StageLinks() if neighbours is None else stage_links(grid, axis, *neighbours)
    if interleaved:
        stats = _C.run_interleaved(pp, pp.rank, pp.size, len(chunks), m, cb.payload, cb.forward, cb.backward,
                                   links, _stage_stream(grid, pp), cb.sent)
        return cb.loss(), _with_copies(stats, cb)
    # the message-driven schedule's members of a stage take their messages in one order (cpp/pipeline.h)
    stats = _C.run_pipeline(pp, SCHEDULES[schedule], pp.rank, pp.size, m, pipeline_limit, cb.payload,
                            lambda mb, addr: cb.forward(mb, 0, addr), lambda mb, addr: cb.backward(mb, 0, addr),
                            RECEIVE[receive], grid.control(axis, "pipeline") if announced else None, links,
                            _stage_stream(grid, pp), grid.control(group, "pipeline stage") if group else None,
                            cb.sent)
    return cb.loss(), _with_copies(stats, cb)


def _check_placement(stage, schedule: str) -> None:
    """One clear error where `stage`'s chunks were built in another placement than `schedule`
    runs them in (ModelChunks' placement; a plain list of chunks says none)."""
    built, runs = getattr(stage, "placement", None), placement_of(schedule)
    if built is not None and built is not runs:
        raise GridError(f"the {schedule} schedule runs its chunks in {runs.value} placement; these were built "
                        f"{'in a V' if built is schedules.Placement.V else 'in a loop'} (ModelChunks' placement)")


def table_for(schedule: str, stages: int, microbatches: int, chunks: int):
    """The gw.schedules table a zero-bubble schedule runs, or one clear error: ZB-H1 on one chunk
    a stage, ZB-V and DualPipeV on two (a V); DualPipeV needs 2 stages' worth of micro-batches."""
    check_chunks(schedule, chunks)
    return TABLES[schedule](stages, microbatches)


def _table_step(schedule, chunks_of, chunks, grid, inputs, targets, loss_fn, activation_shape, dtype, axis, documents,
                phases, microbatches):
    """pipeline_step for a schedule given as a table: B and W apart (gw.split)."""
    pp = grid.comm(axis, "pipeline")
    if pp.size < 2:
        raise GridError(f"the {schedule} schedule needs at least 2 pipeline stages")
    vee = schedule in V_SCHEDULES
    m = _microbatch_count(grid, pp, axis, inputs, targets, microbatches, documents)
    table = table_for(schedule, pp.size, m, len(chunks))
    tail = 0 if vee else pp.size - 1  # the stage with the loss: in a V the first
    for held, where, name in ((inputs, 0, "inputs"), (targets, tail, "targets")):
        if pp.rank == where and (held is None or len(held) != m):
            raise GridError(f"microbatches={m}, but stage {where} holds "
                            f"{'no' if held is None else len(held)} micro-batches of {name}")
    _check_placement(chunks_of, schedule)
    stores = [chunk_store(chunk) for chunk in chunks]
    cb = _StageCallbacks(chunks, pp, inputs, targets, loss_fn, m, activation_shape, dtype, grid.device, documents,
                         phases, vee=vee, stores=stores,
                         split=[(op.mb, op.chunk) for op in table.ops[pp.rank] if op.kind is schedules.Kind.B])
    neighbours, _, _ = _channels(grid, axis, schedule, "auto", False, pp.can_recv_any)
    ops = [(ENGINE_KINDS[op.kind], op.chunk, op.mb) for op in table.ops[pp.rank]]
    try:
        stats = _C.run_table(pp, pp.rank, pp.size, len(chunks),
                             _C.ChunkPlacement.V if vee else _C.ChunkPlacement.Loop, m, ops, cb.payload, cb.forward,
                             cb.backward, cb.weight, stage_links(grid, axis, *neighbours, vee),
                             _stage_stream(grid, pp), cb.sent)
    except BaseException:
        for store in stores:  # a failed step's W, and all they hold, go
            store.clear()
        raise
    left = [(c, mb) for c, store in enumerate(stores) for mb in store.pending]
    if left:
        for store in stores:  # kept for the chunk's next step: empty
            store.clear()
        raise GridError(f"the {schedule} table left weight gradients unapplied: (chunk, micro-batch) {left}")
    return cb.loss(), _with_copies(stats, cb)


def pipeline_forward(stage: nn.Module, grid, inputs, targets, loss_fn, activation_shape, dtype=torch.float32,
                     axis="pp"):
    """Forward only (evaluation), no autograd: each microbatch goes through the stages in
    turn (receive from the previous stage, run, send to the next). Returns the mean
    microbatch loss on the last stage (None elsewhere)."""
    pp = grid.comm(axis, "pipeline")
    s, n_stages = pp.rank, pp.size
    chunks = _chunks(stage)
    v = len(chunks)
    # the virtual stages' places (gw.schedules.Table): chunk c of stage s in a loop or a V
    table = schedules.Table("forward", n_stages, 1, v, getattr(stage, "placement", schedules.Placement.LOOP), ())
    last = table.virtual_stages - 1
    m = _microbatches(grid, pp, axis, inputs, targets)
    losses = []
    with torch.no_grad():
        for mb in range(m):
            here = None  # the output handed to this stage's next chunk (a V's turn)
            for c, chunk in enumerate(chunks):  # in virtual order: a V's chunk 1 is after its chunk 0
                u = table.virtual(s, c)
                if u == 0:
                    x = inputs[mb]
                elif table.stage_of(u - 1) == s:
                    x = here
                else:
                    x = torch.empty(activation_shape, dtype=dtype, device=grid.device)
                    grid.recv(x, table.stage_of(u - 1), axis)
                y = chunk(x)
                if u == last:
                    losses.append(loss_fn(y, targets[mb]).detach())
                elif table.stage_of(u + 1) == s:
                    here = y
                else:
                    grid.send(y.to(dtype).contiguous(), table.stage_of(u + 1), axis)
    return torch.stack(losses).mean() if losses else None
