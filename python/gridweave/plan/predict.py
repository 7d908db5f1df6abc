"""One grid's predicted step: its recorded schedule (record.step_schedule) costed part by part,
its memory, and the engine's traffic counters it leaves."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict
from typing import TypedDict

from .. import _C
from ..pipeline import TABLES, table_for
from ..errors import GridError
from ..grid import part_members
from ..optim import link_bytes_per_element
from .. import schedules
from ..schedules import peaks
from .record import GROUPED_SEND, Experts, optimizer_census, step_schedule, tally_of
from .cluster import Cluster
from .costs import _label_line, _links, _measured, bubble_fraction, collective_time, transformer_flops
from .shape import GridShape, Model


def step_counters(schedule, axes: dict, placement, rank: int) -> dict:
    """The engine's traffic counters (gw.Grid.stats: ops, messages and bytes sent per axis label)
    that one step of `schedule` (recorder.step_schedule for this rank's stage) leaves on
    `rank` of a grid of `axes` placed by `placement` (gw.Grid.placement or _C.Placement): each op's
    messages are the engine's own (_C.message_schedule), so equal counters mean the planner
    costs the algorithms that ran."""
    names, sizes = list(axes), dict(axes)
    out = {}
    for c, times in schedule.collectives:
        line, part = _label_line(c.axis)  # "pp:control": the host channel over the pp line
        axes = names if line == "world" else line.split(",")
        g = math.prod(sizes[a] for a in axes)
        member = placement.index_in_line(rank, axes)
        if part is not None:  # a line part: blocks of q consecutive members (within), or one of each (across)
            members = part_members(g, member, *part)
            g, member = len(members), members.index(member)
        op = "send" if c.op == GROUPED_SEND else c.op
        sent = [b for _, b, send in _C.message_schedule(op, g, member, int(c.member_bytes), c.root, c.elem) if send]
        d = out.setdefault(c.axis, {"ops": 0, "sent_messages": 0, "sent_bytes": 0})
        d["ops"] += times
        d["sent_messages"] += times * len(sent)
        d["sent_bytes"] += times * sum(sent)
    return out


# Gradient all-reduce bucket (elements) of a fused device optimizer (Megatron's DDP buckets are
# tens of millions of elements)
FUSED_BUCKET = 1 << 24


def _dtype(model: Model):
    import torch

    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[model.bytes_per_value]


def schedule_of(model: Model, grid: GridShape, microbatches: int, stage: int = 0, bsize: int = 1 << 14,
                coarsening: int = 4, clip: bool = True, overlap: bool = False, flat_gradients: bool = False):
    """The recorded step (recorder.step_schedule) of `model` on `grid`, on a rank of
    pipeline stage `stage`; a model of vocab 0 is its layer stack alone (Bian et al.'s and SUPER's
    measurements: no embedding, head, loss or optimizer)."""
    b = model.batch // grid.dp
    return step_schedule(model.config, grid.tp, grid.dp, grid.pp, grid.sp, (("pp", stage),), microbatches,
                         b / microbatches, _dtype(model), bsize, coarsening, clip, False, bool(model.vocab),
                         model.fused_attention, zero=grid.zero if model.vocab else 0,
                         attention=(model.attention, model.ulysses_degree), agreed=grid.resolved_schedule(model.config) == "message_driven",
                         overlap=overlap,
                         experts=None if model.config.moe is None else Experts(grid.ep, model.expert_imbalance),
                         flat_gradients=flat_gradients, fused_loss=model.fused_loss, recipe=model.float8)


def work_ops(micro) -> list:
    """A recorded micro-batch as costed work: ("gemm", flops, calls), ("vector", bytes, kernels)
    and (collective, axis, bytes) in issue order (receives cost nothing: their time is the send's)."""
    ops = [("gemm", micro.flops, micro.gemm_calls), ("vector", micro.kernel_bytes, micro.kernels)]
    return ops + [(c.op, c.axis, c.nbytes) for c in micro.collectives if c.op != "recv"]


def layer_ops(model: Model, grid: GridShape, tokens: float) -> list:
    """One transformer layer's work on one rank for `tokens` tokens of its replica, forward and
    backward, as the mode's layer runs it (recorded)."""
    one = dataclasses.replace(model, config=dataclasses.replace(model.config, layers=1), embedding=False,
                              batch=tokens / model.seq * grid.dp)
    return work_ops(schedule_of(one, dataclasses.replace(grid, pp=1), 1).microbatch)


def _check_recompute(recompute) -> None:
    if recompute not in (False, True, "selective"):
        raise GridError(f"recompute must be False, True or 'selective', got {recompute!r}")


def _at(rate: float):
    """Seconds of n units at `rate` units a second (a rate of 0: not counted)."""
    return (lambda n: n / rate) if rate else (lambda n: 0.0)


class Prediction(TypedDict):
    """One grid's predicted step (predict's return; a dict, as JSON and the table take it)."""
    dp: int
    pp: int
    tp: str  # the mode's spec
    sp: int
    placement: str
    zero: int
    schedule: str
    chunks: int
    ep: int
    step_time_s: float  # the step: the pipeline, the step's own collectives, the optimizer, fixed cost
    compute_s: float  # the paper's FLOPs formula over the ranks at the GEMM rate (for comparison)
    bubble: float  # the pipeline's bubble fraction
    microbatches: int
    memory_bytes: float  # device memory per rank, the most loaded stage's
    parameters: int  # the model's matrix parameters
    host_bytes: float  # OffloadAdam's fp32 master and two states in host memory
    state_bytes: dict  # parameters / gradients / optimizer held after a step (the ZeRO paper's accounting)
    memory_stage: int
    critical_stage: int
    pipeline_s: float
    kernels: int  # what the critical rank issues a step
    collectives: int
    fixed_cost_collectives: int  # of them, those charged the cluster's collective_s
    measured_collectives: int  # and those charged its measured_call_s
    time_breakdown_s: dict  # compute, recompute, communication per axis, bubble: they add up to step_time_s
    memory_breakdown_bytes: dict  # parameters, gradients, optimizer, activations: they add up to memory_bytes
    bytes_per_axis: dict  # {axis: {"intra", "inter"}}
    seconds_per_axis: dict
    axis_links: dict  # the grid's axes and the lines this step uses: intra or inter (n nodes)


class _Costing:
    """The cluster's rates and a grid's lines: what a piece of recorded work costs."""

    def __init__(self, grid: GridShape, cluster: Cluster, busy_share: float = 1.0):
        self.cluster, self.launch = cluster, cluster.launch_s
        # a step's kernels against the probes', over the share of the step its ranks are busy
        # (a pipeline's ranks idle in its bubble): the contention is the busy ranks'
        self.scale = 1.0 + (cluster.compute_scale - 1.0) * busy_share
        self.links, _ = _links(grid, cluster)
        self.vector, self.gemm_bytes = _at(cluster.vector_bandwidth_Bps), _at(cluster.gemm_bandwidth_Bps)

    def cost(self, op, nbytes, line) -> tuple:
        """(seconds of one collective on `line`, whether they hold collective_s, whether
        measured_call_s, the seconds of a message on the wire: a send's link latency and
        bandwidth; none of a collective's, whose peers arrive as the cores schedule them)."""
        cluster = self.cluster
        measured = _measured(op, nbytes, line, cluster)  # the whole call, as timed
        if measured is not None:
            return measured[0], False, measured[1], 0.0
        link = collective_time("send" if op == GROUPED_SEND else op, line[4], nbytes, line[:2], cluster)
        wire = link if op in (GROUPED_SEND, "send") else 0.0
        if op == GROUPED_SEND:  # in its group's launch: its link's latency and bandwidth alone
            return link, False, False, wire
        return self.launch + cluster.collective_s + link, True, False, wire

    def fixed_cost(self, op, axis, nbytes) -> bool:  # comm charges it collective_s
        return self.links[axis] is not None and self.cost(op, nbytes, self.links[axis])[1]

    def measured_call(self, op, axis, nbytes) -> bool:  # comm charges it measured_call_s
        return self.links[axis] is not None and self.cost(op, nbytes, self.links[axis])[2]

    @staticmethod
    def issued(sched, microbatches: int, holds) -> int:
        """How many collectives a step of `sched` (its micro-batches', the step's own, the
        overlapped chunks) issues that `holds` (fixed_cost, measured_call)."""
        return (microbatches * sum(n for k, n in sched.microbatch.tally if holds(*k))
                + sum(n for k, n in sched.step_tally + tally_of(sched.in_backward) if holds(*k)))

    def comm(self, tally, per_axis, repeat, wire: list | None = None) -> float:
        """Seconds of the collectives of `tally` (((op, axis, nbytes), times issued), each of them
        issued `repeat` times again); per axis too; wire[0] gains their seconds on the wire
        (cost's). Each distinct collective is costed once."""
        t = 0.0
        for (op, axis, nbytes), n in tally:
            line = self.links[axis]
            if line is None:
                continue
            c, _, _, on_wire = self.cost(op, nbytes, line)
            acc = per_axis.setdefault(axis, [0.0, 0.0])
            acc[0] += c * n * repeat
            acc[1] += nbytes * n * repeat
            t += c * n
            if wire is not None:
                wire[0] += on_wire * n
        return t

    def attention(self, w) -> float:
        """The fused attention kernels of `w`: by the query's head size where the cluster measured
        them so (each kernel's setup, each query row, each query x key pair at that head size),
        else their FLOPs at the attention rate, each row and each pair."""
        cluster = self.cluster
        if cluster.attention_by_head_size and w.attention_scores:
            head = w.attention_head_scores / w.attention_scores  # (a layer has one head size)
            return (w.attention_calls * cluster.attention_call_s + w.attention_rows * cluster.attention_row_s
                    + w.attention_scores * cluster.attention_pair_s(head))
        return (w.fused_attention_flops / (cluster.attention_flops or cluster.gemm_flops)
                + w.attention_rows * cluster.attention_row_s + w.attention_scores * cluster.attention_score_s)

    def busy(self, w) -> float:
        """GEMMs at the GEMM rate and their operands' bandwidth (fused attention: attention()), the
        other kernels at memory bandwidth (softmax's further passes per element),
        each a launch; times the contention's scale."""
        cluster = self.cluster
        return self.scale * (((w.flops - w.fused_attention_flops - w.float8_flops) / cluster.gemm_flops
                + self.gemm_bytes(w.gemm_bytes) + w.float8_flops / (cluster.float8_gemm_flops or cluster.gemm_flops)
                + self.attention(w)
                + w.softmax_elements * cluster.softmax_at(w.softmax_elements / 2)  # a loss's forward and backward
                + (w.gemm_calls + w.kernels) * self.launch + self.vector(w.kernel_bytes)))


@dataclasses.dataclass
class _StageTime:
    """A pipeline stage's micro-batch: its time (compute, recomputation, communication), the
    compute and recomputation alone, its recorded schedule, seconds and bytes per axis, and the
    seconds of its messages on the wire (what ranks sharing cores do not speed up)."""
    seconds: float
    compute: float
    recompute: float
    schedule: object
    per_axis: dict
    wire: float


def accumulation(model: Model, sched, microbatches: int) -> tuple:
    """(kernels, bytes) a step's gradient accumulation adds to its recorded micro-batches': each
    micro-batch after the first adds its gradients into the held ones (autograd's AccumulateGrad:
    an add_ a parameter tensor, two reads and a write of its elements); none where the
    weight-gradient GEMMs accumulate (Model.fused_accumulation)."""
    if model.fused_accumulation:
        return 0, 0.0
    further = microbatches - 1
    return further * sched.parameter_tensors, further * 3 * model.bytes_per_value * sched.parameters


def stage_time(model: Model, grid: GridShape, costing: _Costing, microbatches: int, stage: int,
               offload_bsize, recompute, coarsening: int, clip: bool, overlap: bool) -> _StageTime:
    """One micro-batch of pipeline stage `stage` (recorded, costed); recompute as predict's."""
    sched = schedule_of(model, grid, microbatches, stage, offload_bsize or FUSED_BUCKET, coarsening, clip, overlap,
                        _flat_gradients(model, grid, offload_bsize))
    mb = sched.microbatch
    adds, added_bytes = accumulation(model, sched, microbatches)  # a micro-batch's share of the step's
    accumulate = costing.scale * (adds * costing.launch + costing.vector(added_bytes)) / microbatches
    compute = costing.busy(mb) + accumulate + costing.cluster.microbatch_s
    # recomputation: each layer's forward again in backward, a third of its work (AxoNN eq. 3)
    redo = sched.layers * (costing.busy(sched.layer) / 3 if recompute is True else
                           sched.layer.attention_flops / costing.cluster.gemm_flops if recompute else 0.0)
    per_axis, chunks = {}, grid.chunks
    tally = mb.tally + tuple((k, n * (chunks - 1)) for k, n in mb.tally if k[:2] == ("send", "pp") and chunks > 1)
    wire = [0.0]
    t = compute + redo + costing.comm(tally, per_axis, microbatches, wire)  # the sends again: each chunk's boundary
    return _StageTime(t, compute, redo, sched, per_axis, wire[0])


def optimizer_time(model: Model, sched, costing: _Costing, offload_bsize, coarsening: int, clip: bool) -> float:
    """The optimizer's own work a step on this rank's elements (its parameters, or its ZeRO shard)."""
    phi_local = sched.shard
    if model.vocab and offload_bsize:  # OffloadAdam's own work (AxoNN §V-B: bsize-element buckets)
        staged = costing.cluster.host_link_Bps > 0  # the state in host memory apart from the device's
        census = optimizer_census(offload_bsize, coarsening, clip, True, staged)
        buckets = -(-phi_local // offload_bsize)
        kernels = census["fixed"] + census["per_tensor"] * sched.parameter_tensors
        # a staged bucket's measured seconds where calibrated: its copies and update are launched
        # from Python without autograd's bookkeeping, cheaper each than launch_s's layer kernels
        bucket_s = costing.cluster.offload_bucket_s if staged else 0.0
        per_buckets = buckets * bucket_s if bucket_s else census["per_bucket"] * buckets * costing.launch
        # staged, the buckets' copies also cross the host link (their device-side bytes, counted in
        # the census too, are a rounding error beside it)
        link = link_bytes_per_element(_dtype(model)) * phi_local / costing.cluster.host_link_Bps \
            if staged else 0.0
        return kernels * costing.launch + per_buckets + costing.vector(census["bytes_per_element"] * phi_local) + link
    if model.vocab:  # a fused Adam: weights and gradient read, fp32 master and two states read and written
        return costing.vector((3 * model.bytes_per_value + 2 * 12) * phi_local)
    return 0.0


def activations_in_flight(grid: GridShape, stage: int, microbatches: int) -> float:
    """The micro-batches whose activations stage `stage` holds at its peak: pp - s under 1F1B
    (Megatron-LM §2.2; the message-driven schedule's pipeline_limit max(pp, 2) is not lower); a
    zero-bubble schedule's from its table (gw.schedules.peaks: chunk activations, each 1/chunks of
    a micro-batch's on the stage; a deferred W keeps what it multiplies)."""
    if grid.pp < 2:
        return 1
    schedule = grid.schedule
    if schedule in TABLES:
        table = table_for(schedule, grid.pp, microbatches, grid.chunks)
        return peaks(table)[stage] / grid.chunks
    return min(microbatches, grid.pp - stage)


def stage_memory(model: Model, grid: GridShape, stage: int, sched, microbatches: int, offload_bsize,
                 recompute) -> dict:
    """Stage s's memory per rank: its parameters as its modules place them, their gradients
    and the flat gradient buffer in the model's dtype; AxoNN's 16 bsize of device buckets
    (offload) or the fp32 master, exp_avg and exp_avg_sq here (12 phi, with the fp32 gradient
    16: 20 phi with half-precision weights and gradients); the kept activations of the
    micro-batches in flight (recorded). Stage s holds pp - s of them at most (1F1B's bound,
    Megatron-LM §2.2; the message-driven schedule's pipeline_limit max(pp, 2) is not lower):
    the last stage runs each micro-batch's backward as soon as its forward. A pipeline
    stage also holds the engine's messages."""
    e, m = model.bytes_per_value, microbatches
    b = model.batch // grid.dp
    aliased = _aliased(model, grid, offload_bsize)
    phi_here = sched.parameters
    in_flight = activations_in_flight(grid, stage, m)
    # the recorded peak of one micro-batch (its kept activations, their gradients and the
    # temporaries, the gradients made, and DistributedAdam's flat copies of them as its buckets
    # complete) beside the gradients, plus the others in flight
    flat = _flat_gradients(model, grid, offload_bsize)
    grads = e * phi_here * (2 if flat else 1)
    mb = sched.microbatch
    act = max(mb.peak_bytes - grads, 0.0) + mb.saved_bytes * (in_flight - 1)
    if recompute is True:  # only each layer's input is kept, and one layer's activations at a time
        layers_here = model.layers // grid.pp
        act = (2 * b / m * model.seq / grid.sp * model.hidden * e * layers_here * in_flight
               + mb.saved_bytes / max(layers_here, 1))
    if grid.pp > 1:  # the pipeline engine's messages (cpp/pipeline.cpp): two receives posted
        # (double buffers), the message being sent, and the tensor it was copied from
        payload = max((c.nbytes for c in mb.collectives if c.op == "send" and c.axis == "pp"), default=0)
        act += (2 + 1 + 1) * payload
    # OffloadAdam's bucket buffers and the flat gradient it sums (model dtype), or fused Adam's
    # states and fp32 gradient (of this rank's ZeRO shard). At ZeRO 0 and 1 the flat copies are
    # recorded among the gradients (all-reduced in place at 0; at 1 reduce-scattered into a shard
    # in the model's dtype, which the step reads); ZeRO 2 and 3 drop each gradient as its copy is
    # made (DistributedAdam._launch), so the recorded gradients stand for the copies there.
    if offload_bsize:
        optimizer = 16 * offload_bsize + e * phi_here
    elif flat:
        optimizer = (12 + (e if grid.zero else 0)) * sched.shard
    else:
        optimizer = (16 - 4 * aliased) * sched.shard
    # ZeRO-3: the shard, and the units gathered whole at once (the one computing, the one prefetched,
    # the ones kept from forward to backward)
    params = e * (sched.shard + sched.gathered) if grid.zero == 3 else e * phi_here
    return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": act}


def _flat_gradients(model: Model, grid: GridShape, offload_bsize) -> bool:
    """DistributedAdam on the device at ZeRO 0 or 1: each bucket's flat gradient is made as the
    backward completes it and kept beside the gradients (ZeRO 2 and 3 drop those) to the step."""
    return bool(model.vocab) and not offload_bsize and grid.zero < 2


def _aliased(model: Model, grid: GridShape, offload_bsize) -> bool:
    """ZeRO-3 in fp32 on the device: the parameter shard is the fp32 master (one copy, not two)."""
    return grid.zero == 3 and not offload_bsize and model.bytes_per_value == 4


def _shared_pipeline(name: str, grid: GridShape, cluster: Cluster, m: int, stages: dict) -> float:
    """The pipeline's span where ranks share cores: its schedule's (`name`) table (gw.schedules) simulated
    with each stage's micro-batch time (a forward a third, the backward the rest: AxoNN eq. 3's
    split) and, while k of its p stages run, each at the speedup of k/p of the node's ranks
    running (Cluster.speedup): a lone stage of a one-micro-batch pipeline runs at its rank's
    rate alone, not the all-busy rate the stage times are costed at; its sends' share of the
    stage time (_StageTime.wire) at one second a second."""
    p, chunks = grid.pp, grid.chunks
    if name in TABLES:
        table = table_for(name, p, m, chunks)
    elif chunks > 1 and m % p == 0:
        table = schedules.interleaved(p, m, chunks)
    else:  # the message-driven schedule takes 1F1B's order where its stages keep pace
        table, chunks = schedules.one_f_one_b(p, m), 1
    like = [stages[min(s, 1) if s < p - 1 else p - 1] for s in range(p)]
    per_stage = tuple(v.seconds / (3 * chunks) for v in like)
    # the share of a stage's time its messages spend on the wire: a latency idle cores do not shorten
    # (a message between two ranks took 0.4-1.3 ms with 0 to 6 others computing, on 2 cores)
    waiting = tuple(min(1.0, v.wire / v.seconds) if v.seconds > 0 else 0.0 for v in like)
    node = min(cluster.gpus_per_node, grid.dp * p * grid.tp_ranks() * grid.sp)
    return schedules.simulate(table, per_stage, per_stage, per_stage, waiting=waiting,
                              speed=lambda k: cluster.speedup(max(1, round(k * node / p)))).span


def predict(model: Model, grid: GridShape, cluster: Cluster, microbatches: int | None = None,
            offload_bsize: int | None = None, recompute: bool | str = False, coarsening: int = 4,
            clip: bool = True, overlap_grad_reduce: bool = False) -> Prediction:
    """Predicted step time (s), memory per GPU (bytes) and bytes per axis for one gw.train step:
    the step recorded from the code that runs it (record.step_schedule: every GEMM and
    its FLOPs, every other kernel and its bytes, every collective and message, the activations
    kept, the optimizer's own work), costed on `cluster` (alpha-beta links from the engine's
    placement, GEMM rate, memory bandwidth, a per-kernel and per-collective cost): stage_time,
    optimizer_time and stage_memory, put together.
    recompute: False, True (every layer's forward again in backward) or "selective" (the
    attention core's, Korthikanti et al. 2022). The grid's chunks: model chunks per pipeline
    stage (Megatron's interleaved schedule: the bubble is (p-1)/(v m), v times the messages).
    offload_bsize: gw.optim.OffloadAdam's bsize (what gw.train runs: states in host memory,
    updated bsize elements at a time, its kernels and bytes recorded); None: a fused Adam on
    the device, its states there too (Megatron's: 20 phi with half-precision weights).
    overlap_grad_reduce: OffloadAdam's chunks start in the last micro-batch's backward (gw.train's
    default); only what outlasts that backward is exposed, at least the last chunk."""
    _check_recompute(recompute)
    chunks = grid.chunks
    if chunks > 1 and grid.pp < 2:
        raise GridError(f"chunks={chunks} needs pp > 1")
    e = model.bytes_per_value
    dims = grid.dims()
    dims.check_batch(model.batch)
    dims.check_layers(model.layers)
    grid.check_experts(model.config)
    b = model.batch // grid.dp  # sequences per data-parallel replica
    m = microbatches or (min(b, 4 * grid.pp) if grid.pp > 1 else 1)
    schedule = grid.resolved_schedule(model.config)
    bubble = bubble_fraction(grid.pp, m, schedule, chunks)
    shared = cluster.shares_cores
    # where ranks share cores, the simulated pipeline below speeds up the ranks the bubble leaves
    # running (their stage times are at the all-busy rate); elsewhere a step's contention is its busy share's
    costing = _Costing(grid, cluster, 1.0 if shared else 1 / (1 + bubble))
    links = costing.links
    # the middle stages (stage 1 stands for them) do what these do, without embedding or head
    stages = {s: stage_time(model, grid, costing, m, s, offload_bsize, recompute, coarsening, clip,
                            overlap_grad_reduce and bool(offload_bsize)) for s in sorted({0, min(1, grid.pp - 1),
                                                                                            grid.pp - 1})}
    s_star = max(stages, key=lambda k: stages[k].seconds)
    critical = stages[s_star]
    t_stage, compute, redo, sched, per_axis = (critical.seconds, critical.compute, critical.recompute,
                                               critical.schedule, critical.per_axis)
    # (m + p - 1) micro-batch slots of the slowest stage; where ranks share cores, the schedule's
    # step simulated with each stage's own time and the ranks it leaves running sped up
    pipeline = (_shared_pipeline(schedule, grid, cluster, m, stages)
                if shared and grid.pp > 1 else m * t_stage * (1 + bubble))
    step_comm = costing.comm(sched.step_tally, per_axis, 1)
    if sched.in_backward:  # overlapped chunks (DDP's buckets): they travel during the last backward (2/3 of a
        # micro-batch's work), the last chunk after it; each axis is charged its share of what is exposed
        alone = {}
        reduce_s = costing.comm(tally_of(sched.in_backward), alone, 1)
        # where ranks share cores the chunks' transport threads take the cores the backward computes
        # on: nothing is hidden (the overlap then only saves the wait for the last chunk's peers)
        hidden = 0.0 if shared else 2 / 3 * compute
        exposed = max(costing.comm(tally_of(sched.in_backward[-1:]), {}, 1), reduce_s - hidden)
        for k, (sec, nbytes) in alone.items():
            acc = per_axis.setdefault(k, [0.0, 0.0])
            acc[0] += sec * exposed / reduce_s
            acc[1] += nbytes
        step_comm += exposed
    optimizer_s = optimizer_time(model, sched, costing, offload_bsize, coarsening, clip)
    step = pipeline + step_comm + optimizer_s + cluster.step_s
    phi = model.config.matrix_parameters(embedding=model.embedding)
    compute_paper = (transformer_flops(model, recompute) / (grid.dp * grid.pp * grid.tp_ranks() * grid.sp)
                     / cluster.gemm_flops)
    by_stage = {s: stage_memory(model, grid, s, v.schedule, m, offload_bsize, recompute) for s, v in stages.items()}
    s_mem = max(by_stage, key=lambda k: sum(by_stage[k].values()))
    memory_breakdown = by_stage[s_mem]
    top = stages[s_mem].schedule
    aliased = _aliased(model, grid, offload_bsize)
    # the offloaded fp32 master and two states
    host = 12 * (top.shard if grid.zero else top.parameters) if offload_bsize else 0
    # the ZeRO paper's accounting after a step (Rajbhandari et al. 2020, Fig. 1), as gw.train's
    # metrics.json memory_bytes measures it: each term over N_d where the stage shards it
    held = {"parameters": e * (top.shard if grid.zero == 3 else top.parameters),
            "gradients": e * (top.shard if grid.zero >= 2 else top.parameters),
            "optimizer": (12 - 4 * aliased) * top.shard}
    return Prediction(
        **{k: v for k, v in asdict(grid).items() if k != "tp"}, tp=grid.tp.spec(),
        step_time_s=step, compute_s=compute_paper, bubble=bubble, microbatches=m,
        memory_bytes=sum(memory_breakdown.values()), parameters=phi,
        host_bytes=host, state_bytes=held, memory_stage=s_mem, critical_stage=s_star,
        pipeline_s=pipeline,
        # what the critical rank issues in the step: kernels and collectives (with messages)
        kernels=m * (sched.microbatch.kernels + sched.microbatch.gemm_calls) + accumulation(model, sched, m)[0],
        collectives=m * sum(n for _, n in sched.microbatch.tally) + len(sched.step) + len(sched.in_backward),
        # of them, those charged collective_s (the rest measured whole, or a group's later sends)
        fixed_cost_collectives=costing.issued(sched, m, costing.fixed_cost),
        # and those charged measured_call_s (line all-reduces timed whole)
        measured_collectives=costing.issued(sched, m, costing.measured_call),
        # where the step time goes (they add up to step_time_s) and the memory (to memory_bytes)
        time_breakdown_s={"compute": compute * m + optimizer_s + cluster.step_s, "recompute": redo * m,
                          "communication": {k: v[0] for k, v in per_axis.items()},
                          "bubble": pipeline - m * t_stage},
        memory_breakdown_bytes=memory_breakdown,
        bytes_per_axis={k: {"intra": v[1] * (1 - links[k][3]), "inter": v[1] * links[k][3]}
                        for k, v in per_axis.items()},
        seconds_per_axis={k: v[0] for k, v in per_axis.items()},
        # the grid's axes and the lines this step uses (the lines' cache holds other grids' too)
        axis_links={k: ("intra" if v[2] == 1 else f"inter ({v[2]} nodes)") for k, v in links.items()
                    if k in per_axis or k in dict(grid.axes())})
