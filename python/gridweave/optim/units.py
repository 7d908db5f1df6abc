"""ZeRO stage 3's parameter sharding (Rajbhandari et al. 2020, §5.3 P_os+g+p; FSDP2's per-block
units): between uses a unit's parameters hold no storage, only each rank's flat shard; a unit is
all-gathered before its forward and again before its backward, freed after each, and the next
unit is prefetched (forward: the one after; backward: the one before). gw.optim.DistributedAdam
(zero=3) owns the flat layout (its groups) and hands each unit its groups. A group of float8 weights
is gathered in float8 (torchao's float8 all-gather for FSDP2): each weight's scale from its amax over
every shard (one all-reduce of the amaxes a step), each rank's shard cast before the gather, the
gathered bytes (half of bf16's) scaled back into the weights the products read."""
from __future__ import annotations

import contextlib

import torch

from .. import float8
from ..errors import GridError


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (an activation
    checkpoint's recomputation runs a unit's forward there: its backward follows at once)."""
    return torch._C._current_graph_task_id() != -1


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


class _Unit:
    """One module's flat groups: SHARDED (no storage), GATHERING (all-gathers in flight) or
    GATHERED."""

    def __init__(self, index, groups):
        self.index, self.all_groups = index, groups
        self.groups = [g for g in groups if g.shard_axes]  # the ones gathered and freed
        self.params = {id(p) for g in groups for _, p in g.members}
        self.work = None  # the all-gathers in flight
        self.exact = False  # whether they carry the float8 groups in the model's dtype too
        self.gathered = not self.groups  # a unit with nothing sharded is always whole
        self.pending = 0  # its parameters whose gradient this backward has accumulated


class _Float8Groups:
    """The float8 all-gathers of the groups whose .float8 is set: the e4m3 buffer each gathers into,
    each member weight's scale (torchao's amax_to_scale of its amax over every shard), and where each
    member lies in the group's flat buffer and in this rank's shard of it."""

    def __init__(self, grid, groups):
        self.grid = grid
        self.groups = [g for g in groups if g.float8 and g.shard_axes]
        self.dtype = float8.gather_dtype() if self.groups else None  # torchao loaded only where used
        for g in self.groups:
            g.full8 = torch.empty(g.padded, dtype=self.dtype, device=g.full.device)
            g.full8.untyped_storage().resize_(0)
            spans, off, lo, hi = [], 0, g.lo - g.start, g.hi - g.start
            for _, p in g.members:  # (member range in the buffer, its part of this rank's shard)
                spans.append(((off, off + p.numel()), (max(off, lo) - lo, min(off + p.numel(), hi) - lo)))
                off += p.numel()
            g.float8_spans = spans
        by_axes = {}  # the amaxes of every float8 group sharded over the same axes: one all-reduce
        for g in self.groups:
            by_axes.setdefault(g.shard_axes, []).append(g)
        self.by_axes = list(by_axes.items())

    def rescale(self) -> None:
        """Each weight's scale from its amax over every shard (after the shards changed: a step)."""
        for axes, groups in self.by_axes:
            amax = torch.stack([g.param_shard[a:b].abs().max().float() if b > a else
                                torch.zeros((), dtype=torch.float32, device=g.param_shard.device)
                                for g in groups for _, (a, b) in g.float8_spans])
            self.grid.all_reduce(amax, axis=axes, op="max")
            scales = float8.gather_scales(amax).split([len(g.float8_spans) for g in groups])
            for g, s in zip(groups, scales):
                g.float8_scales = s

    def start(self, g):
        """The group's shard in float8, its all-gather into the float8 buffer started."""
        g.full8.untyped_storage().resize_(g.padded * g.full8.element_size())
        shard = torch.zeros(g.param_shard.shape, dtype=self.dtype, device=g.param_shard.device)
        for k, (_, (a, b)) in enumerate(g.float8_spans):
            if b > a:
                shard[a:b] = float8.to_float8(g.param_shard[a:b], g.float8_scales[k])
        return self.grid.all_gather(shard, axis=g.shard_axes, async_op=True, out=g.full8)

    @staticmethod
    def unpack(g) -> None:
        """The gathered float8 weights scaled back into the group's buffer (the parameters' storage)."""
        with torch.no_grad():
            for k, ((a, b), _) in enumerate(g.float8_spans):
                g.full[a:b] = (g.full8[a:b].float() / g.float8_scales[k]).to(g.full.dtype)
        g.full8.untyped_storage().resize_(0)


class ParameterUnits:
    """The hooks and the gathers of ZeRO-3 over `modules` (forward order). groups: the
    optimizer's flat groups, each with .unit (its module's index), .members, .shard_axes, .start,
    .padded, .lo, .hi and .param_shard (this rank's shard in the model's dtype, which the
    all-gather reads). Each group gets .full, the padded flat buffer its parameters are views
    of; its storage is freed (resized to 0) while the unit is sharded."""

    def __init__(self, grid, modules, groups, prefetch=True):
        self.grid, self.prefetch = grid, prefetch
        self.modules = list(modules)
        self.units = [_Unit(u, [g for g in groups if g.unit == u]) for u in range(len(self.modules))]
        owner = {pid: u.index for u in self.units for pid in u.params}
        # the units whose parameters a module's forward reads (a tied weight: another unit's)
        self.needs = [sorted({owner[id(p)] for p in m.parameters() if id(p) in owner}) for m in self.modules]
        users = {}
        for m, units in enumerate(self.needs):
            for u in units:
                users.setdefault(u, set()).add(m)
        last = len(self.modules) - 1
        # gathered from its first use to its backward: read by two modules, or the last in forward
        # (its backward comes at once: FSDP2 keeps its root so)
        self.sticky = {u for u, ms in users.items() if len(ms) > 1 or u == last}
        with torch.no_grad():
            for g in groups:
                p0 = g.members[0][1]
                g.full = torch.empty(g.padded, dtype=p0.dtype, device=p0.device)
                off = 0
                for _, p in g.members:
                    g.full[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = g.full[off:off + p.numel()].view(p.shape)
                    off += p.numel()
        self.float8 = _Float8Groups(grid, groups)
        self.rescale()
        for u in self.units:
            self._free(u)
        self._hooks = []
        for m, mod in enumerate(self.modules):
            self._hooks.append(mod.register_forward_pre_hook(lambda _m, _a, m=m: self._pre_forward(m)))
            self._hooks.append(mod.register_forward_hook(lambda _m, _a, out, m=m: self._post_forward(m, out)))

    # ---- gathering and freeing -------------------------------------------------------------
    def start(self, u: _Unit, exact: bool = False) -> None:
        """The unit's all-gathers started (asynchronously), if it is sharded; exact: its float8
        groups too in the model's dtype (whole parameters read or written outside a step)."""
        if u.gathered or u.work is not None:
            return
        work = []
        for g in u.groups:
            g.full.untyped_storage().resize_(g.padded * g.full.element_size())
            work.append(self.float8.start(g) if g.float8 and not exact else
                        self.grid.all_gather(g.param_shard, axis=g.shard_axes, async_op=True, out=g.full))
        u.work, u.exact = work, exact

    def rescale(self) -> None:
        """The float8 gathers' scales from the parameter shards (after they changed)."""
        self.float8.rescale()

    def gather(self, u: _Unit, exact: bool = False) -> None:
        """The unit whole: its all-gathers started if they were not, and waited for."""
        self.start(u, exact)
        if u.work is not None:
            for w, g in zip(u.work, u.groups):
                w.wait()
                if g.float8 and not u.exact:
                    self.float8.unpack(g)
            u.work = None
            u.gathered = True

    def _free(self, u: _Unit) -> None:
        if not u.groups:
            return
        if u.work is not None:  # a prefetch nobody used: it completes before its buffer goes
            for w in u.work:
                w.wait()
            u.work = None
        for g in u.groups:
            g.full.untyped_storage().resize_(0)
            if g.float8:
                g.full8.untyped_storage().resize_(0)
        u.gathered = False

    def free_all(self) -> None:
        """Every unit sharded (after a step's backward; after a forward without one)."""
        for u in self.units:
            self._free(u)
            u.pending = 0

    # ---- the hooks ---------------------------------------------------------------------------
    def _pre_forward(self, m: int) -> None:
        for u in self.needs[m]:
            self.gather(self.units[u])
        if self.prefetch and not _in_backward() and m + 1 < len(self.modules):
            for u in self.needs[m + 1]:
                self.start(self.units[u])

    def _post_forward(self, m: int, out) -> None:
        if _in_backward():
            return  # a recomputation (activation checkpointing): this unit's backward comes next
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda _g, m=m: self._pre_backward(m))
        for u in self.needs[m]:
            if not torch.is_grad_enabled() or u not in self.sticky:
                self._free(self.units[u])

    def _pre_backward(self, m: int) -> None:
        for u in self.needs[m]:
            self.gather(self.units[u])
        if self.prefetch and m > 0:
            for u in self.needs[m - 1]:
                self.start(self.units[u])

    def accumulated(self, unit: int) -> None:
        """A parameter of `unit` has its gradient of this backward: when all of them have, the
        unit is freed (its backward is over)."""
        u = self.units[unit]
        u.pending += 1
        if u.pending == len(u.params):
            u.pending = 0
            self._free(u)

    def rehearse(self) -> int:
        """One micro-batch's forward and backward as the hooks run them, without running the
        modules (the planner records its gathers on a recording grid); returns the most elements
        gathered at once (whole units beside the shards)."""
        peak = 0

        def held():
            return sum(g.padded for u in self.units if u.gathered or u.work is not None for g in u.groups)
        for m in range(len(self.modules)):
            self._pre_forward(m)
            peak = max(peak, held())
            for u in self.needs[m]:
                if u not in self.sticky:
                    self._free(self.units[u])
        for m in reversed(range(len(self.modules))):
            self._pre_backward(m)
            peak = max(peak, held())
            self._free(self.units[m])  # a unit's gradients are complete after its owner's backward
        self.free_all()
        return peak

    # ---- whole parameters for code that reads them outside forward and backward ---------------
    @contextlib.contextmanager
    def whole(self, writeback: bool = False, on_write=None):
        """Every unit gathered for the block; with writeback, each rank's shard is taken back
        from the (changed) whole parameters after it (on_write(group) then updates the rest)."""
        if any(u.work is not None for u in self.units):
            raise GridError("ZeRO-3: whole parameters were asked for while a unit's gather is in flight "
                            "(inside a forward or backward)")
        self.free_all()  # a unit left gathered holds its float8 gather's values
        for u in self.units:
            self.gather(u, exact=True)
        try:
            yield
        finally:
            if writeback:
                with torch.no_grad():
                    for u in self.units:
                        for g in u.all_groups:
                            g.param_shard.copy_(g.full[g.lo - g.start:g.hi - g.start])
                            if on_write is not None:
                                on_write(g)
                self.rescale()
            self.free_all()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
