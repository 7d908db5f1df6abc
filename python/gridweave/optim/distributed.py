"""ZeRO 1-3 (Rajbhandari et al. 2020) and hybrid sharding: AdamW whose state, gradients and (stage 3)
parameters are sharded over the data axes, reduce-scattered and all-gathered in buckets."""
from __future__ import annotations

import contextlib
import enum

import torch

from ..checkpoint import FlatSlice
from ..errors import GridError
from ..grid import LinePart, Span
from ..measure import timed
from ..sharding import DATA_AXES, grad_norm_of, placement_of
from .base import GridOptimizer, _grad_hooks, _pinned, _Staging, adamw_, checked_state, dp_mean_scale
from .units import ParameterUnits


class ShardGroup(enum.Enum):
    """Over which ranks of the data axes ZeRO shards."""
    ALL = "all"  # every rank of them
    NODE = "node"  # those on one node, replicated across nodes (hybrid sharding: torchtitan's HSDP)


# DistributedAdam's elements per reduce-scatter bucket (whole parameters)
BUCKET = 1 << 22


def bucket_starts(sizes: list, bucket: int, units: list | None = None) -> list:
    """Where DistributedAdam's buckets start among one reduction's parameters (their sizes, in
    backward order): a new bucket where the current one holds something and the next parameter
    would take it past `bucket` elements; with units (ZeRO-3), where the next parameter is
    another unit's. A pure function, so the planner can tell when a stage's layers cut alike."""
    starts, fill = ([0] if sizes else []), 0
    for i, n in enumerate(sizes):
        if i and (units[i] != units[i - 1] if units is not None else fill + n > bucket):
            starts.append(i)
            fill = 0
        fill += n
    return starts


class _Group:
    """The parameters whose gradients are summed over the same axes, laid out flat and padded
    so that the shard axes split them into equal shards: this rank's shard is [lo, hi) of the
    group's padded range [start, start + padded). data: the data axes it is sharded over
    (shard_axes: them, or hybrid sharding's node part of them, whose other part is `replica`)."""

    def __init__(self, members, axes, data, grid, start, buf_lo, hybrid=False):
        self.members, self.axes, self.data = members, axes, data  # members: [(index, param)]
        self.shard_axes = LinePart(data, Span.WITHIN) if hybrid and data else data
        across = LinePart(data, Span.ACROSS) if hybrid and data else None
        self.replica = across if across is not None and grid.size(across) > 1 else None
        self.rest = tuple(a for a in axes if a not in data)  # summed, not sharded (e.g. tensor axes)
        shard_axes = self.shard_axes
        n = grid.size(shard_axes) if shard_axes else 1
        self.numel = sum(p.numel() for _, p in members)
        self.padded = -(-self.numel // n) * n
        self.start, self.shard = start, self.padded // n
        self.lo = start + (grid.index(shard_axes) if shard_axes else 0) * self.shard
        self.hi = self.lo + self.shard
        self.buf_lo, self.buf_hi = buf_lo, buf_lo + self.shard  # its shard in the optimizer's state buffers

    def spans(self):
        """(index, param, start, end, offset) of every parameter overlapping this rank's shard:
        [start, end) in the shard, from element `offset` of the (flattened) parameter."""
        off = self.start
        for i, p in self.members:
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                yield i, p, a - self.lo, b - self.lo, a - off
            off += p.numel()


class DistributedAdam(GridOptimizer):
    """ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020, §5.1-5.3; Megatron's distributed optimizer),
    and zero=0: every replica holds the whole state (all-reduced gradients, as torch DDP + AdamW):
    AdamW whose fp32 master weights and states are sharded over the data axes every gradient
    is partial over (dp, and sp where the sequence is split: torchtitan's dp_shard x cp).

    step(): the gradients are reduce-scattered over those axes (and all-reduced over any other
    partial axes, e.g. a 3-D mode's), each rank updates its shard (on the device, or in host
    memory in buckets of `bsize` with offload: ZeRO-Offload over AxoNN's OffloadAdam), and the
    updated parameters are all-gathered in the model's dtype. zero=2 also frees the full
    gradients once reduced (only this rank's shard is kept). The loss scaler, global-norm
    clipping (the norm over the shards, each element once) and weight-decay masks work as in
    OffloadAdam, whose protocol this follows. zero=3 (§5.3) shards the parameters too: one bucket
    per unit (a module: gw.zero.ParameterUnits gathers it before its forward and its backward and
    frees it after), the step updates the shards and gathers nothing; whole_parameters() is the
    context for reading them whole outside forward and backward."""

    STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, params, grid, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, zero=1,
                 offload=False, bsize=1 << 20, average_dp=True, max_grad_norm=None, decay=None, bucket=None,
                 overlap=True, units=None, prefetch=True, shard_group=ShardGroup.ALL, float8_params=()):
        """bucket: elements per reduce-scatter (whole parameters, in backward order; None: BUCKET); overlap: each
        bucket's reduction starts during the backward that completes its gradients (the last of
        `backwards_per_step` passes: the pipeline's micro-batches), in bucket order on every rank.
        units (zero=3): the modules whose parameters are gathered together, in forward order
        (e.g. GPTStage.shard_units()): each one a bucket; prefetch: the next unit's all-gather
        starts while this one computes. shard_group: ShardGroup.NODE shards within each node and
        keeps a replica per node (the gradient shards all-reduced across nodes). float8_params
        (zero=3): weights whose all-gathers carry float8 with one scale each (gw.float8.gathered_weights:
        torchao's float8 all-gather for FSDP2), in groups of their own."""
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise GridError("DistributedAdam got no parameters")
        if not isinstance(shard_group, ShardGroup):
            raise GridError(f"shard_group must be a gw.optim.ShardGroup, got {shard_group!r}")
        if shard_group is ShardGroup.NODE and not zero:
            raise GridError("shard_group=NODE is hybrid sharding: it needs zero 1, 2 or 3")
        if zero not in (0, 1, 2, 3):
            raise GridError(f"DistributedAdam takes zero 0 (no sharding), 1, 2 or 3, got {zero!r}")
        if grid is None:
            raise GridError("DistributedAdam needs the grid its parameters live on")
        unit_of = {}
        if zero == 3:
            if units is None:
                raise GridError("zero=3 gathers the parameters one unit at a time: pass units, the modules in "
                                "forward order (e.g. GPTStage.shard_units())")
            units = list(units)
            for u, mod in enumerate(units):
                for p in mod.parameters():
                    unit_of.setdefault(id(p), u)
            outside = [i for i, p in enumerate(self.params) if id(p) not in unit_of]
            if outside:
                raise GridError(f"zero=3: parameters {outside} are in none of the units (every parameter is "
                                "gathered with a unit)")
        elif units is not None:
            raise GridError(f"units are zero=3's (the parameters gathered together); zero is {zero}")
        float8_ids = {id(p) for p in float8_params}
        if float8_ids and zero != 3:
            raise GridError(f"float8_params are gathered in float8 by zero=3; zero is {zero}")
        if zero and all(grid.axes.get(a, 1) == 1 for a in DATA_AXES):
            raise GridError(f"zero={zero} shards over the data axes (dp, sp); this grid has none of size > 1: "
                            f"{dict(grid.axes) if grid is not None else None}")
        bucket = BUCKET if bucket is None else bucket
        if bsize < 1 or bucket < 1:
            raise GridError(f"bsize and bucket must be >= 1, got {bsize!r}, {bucket!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise GridError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        self.grid, self.zero, self.offload, self.bsize = grid, zero, offload, int(bsize)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.average_dp, self.max_grad_norm = average_dp, max_grad_norm
        by_axes: dict = {}
        for i, p in enumerate(self.params):  # float8-gathered weights in groups of their own
            by_axes.setdefault((placement_of(p).reduce_axes(grid), id(p) in float8_ids), []).append((i, p))
        parts = []  # (axes, members): a bucket, its members in backward order
        for (axes, _), members in by_axes.items():
            members = members[::-1]  # backward order: the last parameters' gradients come first
            starts = bucket_starts([p.numel() for _, p in members], bucket,
                                   [unit_of[id(p)] for _, p in members] if zero == 3 else None)
            parts += [(axes, members[a:b]) for a, b in zip(starts, starts[1:] + [len(members)])]
        if zero == 3:  # a unit's buckets in the order its backward completes them: the last unit's first
            parts.sort(key=lambda ap: -unit_of[id(ap[1][0][1])])
        self.groups, start, shard_lo = [], 0, 0
        for axes, part in parts:
            g = _Group(part, axes, tuple(a for a in axes if a in DATA_AXES) if zero else (), grid, start, shard_lo,
                       hybrid=shard_group is ShardGroup.NODE)
            g.unit = unit_of.get(id(part[0][1]))
            g.float8 = id(part[0][1]) in float8_ids
            self.groups.append(g)
            start, shard_lo = start + g.padded, g.buf_hi
        self.padded = start
        self._bucket_of = {id(p): k for k, g in enumerate(self.groups) for _, p in g.members}
        self.backwards_per_step = 1  # the pipeline's micro-batches: gw.train.train_step sets it
        self.phases = None  # a gw.measure.StepPhases timing the reduction (gw.train.train_step sets it)
        self._unit_of, self.overlap = unit_of, overlap
        self._reset_reduction()
        self._hooks = _grad_hooks(self, self.params) if overlap or zero == 3 else []
        dev, dtype = self.params[0].device, self.params[0].dtype
        if any(p.dtype != dtype or p.device != dev for p in self.params):
            raise GridError("DistributedAdam takes parameters of one dtype on one device (its all-gathers carry the "
                            f"model's dtype), got {sorted({(str(p.dtype), str(p.device)) for p in self.params})}")
        home = torch.device("cpu") if offload else dev
        self.dtype = torch.promote_types(dtype, torch.float32)  # fp32 masters of half-precision models
        self.master = torch.cat([self._gather_flat(g, lambda p: p.detach()).to(home, self.dtype)[g.lo - g.start:
                                                                                                 g.hi - g.start]
                                 for g in self.groups])
        if offload:
            self.master = _pinned(self.master)
        # each group's decayed stretches of its shard (no mask: the states stay 12 bytes an element)
        self._decayed = [[(a, b) for _, p, a, b, _ in g.spans() if decay is None or decay(p)] for g in self.groups]
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        if offload:  # *_like does not keep the pinning
            self.exp_avg, self.exp_avg_sq = _pinned(self.exp_avg), _pinned(self.exp_avg_sq)
        self.grad_shards = None  # zero=2: the reduced gradient shards the last step kept
        self._init_steps(grid.device)
        self._staging = _Staging(self.bsize, self.dtype, dev) if offload else None
        self.units = None
        if zero == 3:
            for g in self.groups:  # the parameter shard the all-gathers read: the master itself where it
                # has the model's dtype and device (no second copy), else a copy in the model's dtype
                g.param_shard = self.master[g.buf_lo:g.buf_hi].to(dev, dtype)
                g.aliased = bool(g.shard_axes) and g.param_shard.data_ptr() == self.master[g.buf_lo:].data_ptr()
            self.units = ParameterUnits(grid, units, self.groups, prefetch=prefetch)
            for g in self.groups:
                if not g.shard_axes:  # whole between uses: its parameters are the buffer
                    g.param_shard = g.full

    def _gather_flat(self, group, value):
        """The group's padded flat tensor of value(p) for its members (zeros in the padding)."""
        parts = [value(p).reshape(-1) for _, p in group.members]
        pad = group.padded - group.numel
        if pad:
            parts.append(torch.zeros(pad, dtype=parts[0].dtype, device=parts[0].device))
        return torch.cat(parts)

    def comm_lines(self) -> list:
        """The lines its steps and gathers use (Grid.connect items): every group's shard, summed and
        replica axes, and the world (the norm's and the skip decision's)."""
        items = [None]
        for g in self.groups:
            items += [a for a in (g.shard_axes, g.replica) if a]  # gathered, reduce-scattered and all-reduced
            items += [self.grid.reduce_line(a) for a in (g.axes, g.rest) if a]  # all-reduced
        return items

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        if self.units is not None:
            self.units.free_all()
        for work, _ in self._inflight.values():  # a step abandoned after its backward: finish what was sent
            if work is not None:
                work.wait()
        self._reset_reduction()

    def _reset_reduction(self):
        self._accumulated = {id(p): 0 for p in self.params}
        self._waiting = [len(g.members) for g in self.groups]  # parameters whose gradient is not final yet
        self._inflight: dict = {}  # bucket -> (work or None, its flat gradient / result)
        self._next = 0  # the next bucket to start: buckets start in order on every rank (NCCL's rule)

    def _grad_ready(self, p):
        """A parameter's gradient was accumulated: after its last backward of the step, its bucket
        may start (and every bucket before it that is complete); zero 3 frees a unit whose
        parameters all have their gradient of this backward."""
        key = id(p)
        if self.units is not None:
            self.units.accumulated(self._unit_of[key])
        if not self.overlap:
            return
        self._accumulated[key] += 1
        if self._accumulated[key] > self.backwards_per_step:
            raise GridError(f"a parameter's gradient was accumulated {self._accumulated[key]} times in one step; "
                            f"DistributedAdam.backwards_per_step is {self.backwards_per_step} (set it to the "
                            "backward passes per step, or call zero_grad between steps)")
        if self._accumulated[key] == self.backwards_per_step:
            self._waiting[self._bucket_of[key]] -= 1
            while self._next < len(self.groups) and self._waiting[self._next] == 0:
                self._launch(self._next)
                self._next += 1

    def _launch(self, k):
        """Bucket k's reduction, started: reduce-scatter over its shard axes (all-reduce when it has
        none); zero 2 drops the full gradients as soon as they are in the flat buffer."""
        g, scale = self.groups[k], self._dp_scale()
        flat = self._gather_flat(g, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
        if scale != 1.0:
            flat.mul_(scale)  # pre-divided: the sum over dp is then the mean (OffloadAdam's rule)
        if self.zero >= 2:
            for _, p in g.members:
                p.grad = None  # only the shards outlive the reduction (ZeRO-2)
        if g.shard_axes:
            work = self.grid.reduce_scatter(flat, axis=g.shard_axes, async_op=True)
        elif g.axes:
            work = self.grid.all_reduce(flat, axis=g.axes, async_op=True)
        else:
            work = None
        self._inflight[k] = (work, flat)

    @property
    def buckets_started(self) -> int:
        """Buckets whose reduction has started since the last step (the backward starts them)."""
        return self._next

    def _dp_scale(self) -> float:
        return dp_mean_scale(self.grid, self.average_dp)

    def reduce_gradients(self) -> list:
        """Each bucket's reduced gradient shard (the model's dtype): the buckets the backward did
        not start are started now, in order; then all of them are waited for, and all-reduced
        over their other partial axes (e.g. a 3-D mode's)."""
        while self._next < len(self.groups):
            self._launch(self._next)
            self._next += 1
        shards = []
        for k, g in enumerate(self.groups):
            work, flat = self._inflight[k]
            out = timed(self.phases, "reduction", work.wait) if work is not None else flat
            if g.shard_axes and g.rest:
                timed(self.phases, "reduction", self.grid.all_reduce, out, g.rest)
            if g.replica is not None:  # hybrid sharding: the node's shard summed over the other nodes
                timed(self.phases, "reduction", self.grid.all_reduce, out, g.replica)
            shards.append(out)
        self._reset_reduction()
        return shards

    def step(self, scaler=None, skip=None) -> torch.Tensor:
        """Reduce-scatter, (check, clip,) update the shard, all-gather. Returns whether the step
        was taken (a non-finite gradient or norm skips it on every rank, as OffloadAdam). skip: a bool
        tensor, true to skip the step (the loss was not finite); every decision is the device's, as
        OffloadAdam's, and the return a bool tensor there."""
        if self.units is not None:
            self.units.free_all()  # whatever a backward left gathered (a parameter without a gradient)
        shards = self.reduce_gradients()
        if self.zero >= 2:
            self.grad_shards = shards
        coef, bad = 1.0, skip  # bad: the device's skip flag
        if scaler is not None:
            coef, bad = self._unscale(scaler, shards, skip)
        if self.max_grad_norm is not None:
            coef = self._clip(grad_norm_of(self.norm_pieces(shards), self.grid) * coef, coef)
            bad = self._or_norm_not_finite(bad)
        found_inf = None if bad is None else bad.to(device=self._steps.device, dtype=torch.float32)
        for k, (g, s) in enumerate(zip(self.groups, shards)):
            lo, hi = g.buf_lo, g.buf_hi
            if self.offload:
                self._buckets(k, s, coef, found_inf)
            else:
                grad = s.to(self.dtype) if s.dtype != self.dtype else s.clone()
                if isinstance(coef, torch.Tensor) or coef != 1.0:
                    grad.mul_(coef)
                adamw_(self.master[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], grad, self.lr, self.betas,
                       self.eps, self._steps, self.weight_decay, self._decayed[k], found_inf=found_inf)
        taken = self._taken(bad, found_inf)
        if self._staging is not None:
            self._staging.order()  # the gathers read the host state the buckets wrote
        if self.units is not None:
            self._refresh_shards()  # the next forward gathers them
        else:
            self.gather_parameters(None if bad is None else taken)
        return taken

    def _refresh_shards(self) -> None:
        """ZeRO-3: each parameter shard the all-gathers read, from the updated master; the float8
        gathers' scales from them (one all-reduce of the amaxes)."""
        with torch.no_grad():
            for g in self.groups:
                if not g.aliased:
                    g.param_shard.copy_(self.master[g.buf_lo:g.buf_hi])
            self.units.rescale()

    def whole_parameters(self, writeback: bool = False):
        """A context in which every parameter is whole (zero 3 gathers them; the other stages hold
        them whole anyway): for code that reads or writes parameters outside forward and
        backward (checkpoints, export, evaluation by hand). writeback: what the block wrote into
        them becomes the shards and the fp32 master (collective over the data axes)."""
        self._host_state()  # the buckets' copies out are done
        if self.units is None:
            return contextlib.nullcontext()

        def write(g):
            if not g.aliased:
                self.master[g.buf_lo:g.buf_hi].copy_(g.param_shard)
        return self.units.whole(writeback, on_write=write)

    @property
    def param_shards(self) -> list:
        """ZeRO-3: the parameter shards this rank keeps between uses (the all-gathers' inputs)."""
        return [g.param_shard for g in self.groups] if self.units is not None else []

    def norm_pieces(self, shards) -> list:
        """(gradient slice, placement, shard axes) of every parameter slice in this rank's shards:
        grad_norm_of counts each element of the model once."""
        return [(s[a:b], placement_of(p), g.data) for g, s in zip(self.groups, shards) if self._counts(g)
                for _, p, a, b, _ in g.spans()]

    def _counts(self, g) -> bool:
        """Whether this rank's shard of group g is the copy that counts (hybrid sharding: the
        first node's; the other nodes hold the same shard)."""
        return g.replica is None or self.grid.index(g.replica) == 0

    def _buckets(self, k, shard, coef, found_inf=None):
        """Offload: group k's shard updated through the device buckets (_Staging)."""
        base, size, n = self.groups[k].buf_lo, self._staging.size, shard.numel()
        starts = range(0, n, size)
        buckets = [tuple(buf[base + b:base + min(b + size, n)] for buf in (self.master, self.exp_avg, self.exp_avg_sq))
                   for b in starts]
        buckets = [(host, shard[b:min(b + size, n)], coef) for host, b in zip(buckets, starts)]

        def update(w, m, v, g, at=iter(starts)):
            adamw_(w, m, v, g, self.lr, self.betas, self.eps, self._steps, self.weight_decay, self._decayed[k],
                   next(at), found_inf)
        self._staging.run(buckets, update)

    def gather_parameters(self, taken=None) -> None:
        """Every rank's updated shard, in the model's dtype, gathered into its parameters; where
        `taken` (a device flag) says the step was skipped, they stay as they are."""
        dev, dtype = self.params[0].device, self.params[0].dtype
        for g in self.groups:
            lo, hi = g.buf_lo, g.buf_hi
            mine = self.master[lo:hi].to(dev, dtype)
            full = self.grid.all_gather(mine, axis=g.shard_axes) if g.shard_axes else mine
            off = 0
            with torch.no_grad():
                for _, p in g.members:
                    new = full[off:off + p.numel()].view_as(p)
                    p.copy_(new if taken is None else torch.where(taken, new, p))
                    off += p.numel()

    # ---- the torch.optim.Optimizer protocol (full tensors per parameter, as OffloadAdam's) ----
    def _full(self, buf) -> list:
        """Per parameter, the full tensor of a sharded buffer (collective over each group's shard
        axes: every rank of them calls it), on the buffer's device."""
        self._host_state()  # the buckets' copies out are done
        out = [None] * len(self.params)
        dev = self.params[0].device
        for g in self.groups:
            lo, hi = g.buf_lo, g.buf_hi
            mine = buf[lo:hi].to(dev)
            full = (self.grid.all_gather(mine, axis=g.shard_axes) if g.shard_axes else mine).to(buf.device)
            off = 0
            for i, p in g.members:
                out[i] = full[off:off + p.numel()].view(p.shape)
                off += p.numel()
        return out

    def checkpoint_tensors(self) -> dict:
        """{id(param): {kind: value}} for gw.checkpoint.save: "param" (the parameter; at zero 3 the
        piece of it in this rank's shard) and the three states, as FlatSlices of this rank's shard:
        each rank writes what it holds, nothing is gathered."""
        self._host_state()  # the buckets' copies out are done
        out = {id(p): {} if self.units is not None else {"param": p} for p in self.params}
        for g in self.groups:
            for _, p, a, b, off in g.spans() if self._counts(g) else ():
                if self.units is not None:
                    out[id(p)]["param"] = FlatSlice(off, off + b - a, g.param_shard[a:b], g.data)
                for k in self.STATE_KEYS:
                    out[id(p)][k] = FlatSlice(off, off + b - a, getattr(self, k)[g.buf_lo + a:g.buf_lo + b], g.data)
        return out

    def state_dict(self) -> dict:
        """OffloadAdam's state_dict: {"state": {index: {"step", "master", "exp_avg", "exp_avg_sq"}},
        "param_groups": [...]}, each state the parameter's full tensor, gathered from the shards
        (collective: every rank calls it; a checkpoint of it resumes at any stage and dp)."""
        self._host_state()  # the buckets' copies out are done
        step = torch.tensor(float(self.step_count), device="cpu")
        full = {k: self._full(getattr(self, k)) for k in self.STATE_KEYS}
        state = {i: {"step": step, **{k: full[k][i] for k in self.STATE_KEYS}} for i in range(len(self.params))}
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                 "bsize": self.bsize, "zero": self.zero, "offload": self.offload,
                 "max_grad_norm": self.max_grad_norm, "params": list(range(len(self.params)))}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a state_dict of full tensors (this optimizer's, OffloadAdam's or one of any other
        shard count): each rank keeps its shard. Every entry is checked before anything is written."""
        self._host_state()  # the buckets' copies out are done
        entries, g, step = checked_state("DistributedAdam", state_dict, self.params, self.STATE_KEYS)
        entry = {id(p): s for p, s in zip(self.params, entries)}
        with torch.no_grad():
            for group in self.groups:
                lo, hi = group.buf_lo, group.buf_hi
                for k in self.STATE_KEYS:
                    buf = getattr(self, k)
                    flat = self._gather_flat(group, lambda p, k=k: entry[id(p)][k].to(buf.device, buf.dtype))
                    buf[lo:hi].copy_(flat[group.lo - group.start:group.hi - group.start])
        if self.units is not None:
            self._refresh_shards()
        self.lr, self.betas, self.eps, self.weight_decay = g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]
        self.step_count = step
